"""`pip install llm-parity` goes into the user's environment and leaves what is there as it was.

The harness's wheel (built once a session from this tree, no extras) goes into:
- a fresh venv without torch: pip brings no torch, transformers, accelerate, pytest or
  hypothesis; `parity compare` and `parity report` read two run folders (aligned exit 0, a
  changed value exit 1); a third party's reader plugin (tests/readers/plugin_reader, the
  llm_parity.readers entry points) is read by --format and by detection. Its install time and
  size are printed (-s) and recorded, against what the previous release (0.1.0, which required
  torch==2.13.0 and transformers==5.24.0) would bring: resolved by pip --dry-run, never
  installed, its size measured on this venv's own copies of the same releases;
- the user's own torch, the oldest and the newest of the range the recorder is tested on: 2.4.1
  (PyPI's CUDA 12.1 build, with numpy 1.26, ~5.0 GB) and 2.14.1 (the CUDA build this machine
  has on disk, ~5.4 GB), each the cached environment `user-torch-<version>` of subjects.envs,
  built once per machine (~80 s each here); torch 2.13.0 is what the rest of the suite runs.
  pip changes nothing the environment had (its freeze, and torch's files by inode, size and
  mtime; into 2.4.1's, the harness goes in under the env's own freeze as constraints: a plain
  install replaces its numpy 1.26.4 with numpy 2, which pandas 3.1 requires, a strict xfail
  here), and the recorder runs a 2-rank gloo loop (tests/jobs/foreign_loop.py) with one step traced
  op by op: two runs `parity compare` finds aligned, and a third with a planted gradient bug
  diverged, its trace naming the planted ops' parameter;
- `parity check` of a plain-python job on two revisions of a git repo: in the venv without torch
  as one plain process (distributed = false, no torchrun), and in each user's torch's under that
  torch's own torchrun (distributed = true, a world of 1: its launch, log layout and exit);
- the HF callback (tests/jobs/hf_callback_run.py, as tests/record/test_recorder.py runs it) under
  transformers 4.57.1 (cached env `hf-4.57.1`: torch 2.13.0, accelerate 1.11.0), the oldest
  tested; the newest, 5.24.0, is the suite's own, where test_recorder.py runs it.

A user's environment is a clone of a cached one (subjects.envs.clone: a fresh venv whose
site-packages are hard links of the cached env's), so pip sees torch installed in the venv it
installs into and could replace it, as in a user's venv; the cached env stays as it was. Every
pip here runs with this machine's pip configuration; an index it cannot reach skips.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest

from parity.run.proc_scan import kill_carrying
from subjects.envs import (
    TORCH_BASE,
    EnvBuildError,
    EnvSpec,
    EnvUnavailable,
    clone,
    ensure,
    find,
    pip,
    root,
    site_packages,
)
from tests.jobs import hf_callback_run
from tests.orchestration.history import git

ROOT = Path(__file__).resolve().parents[2]
LOOP = ROOT / "tests" / "jobs" / "foreign_loop.py"
HF_RUN = ROOT / "tests" / "jobs" / "hf_callback_run.py"
PLUGIN = ROOT / "tests" / "readers" / "plugin_reader"

NOT_BROUGHT = ("torch", "transformers", "accelerate", "pytest", "hypothesis")
# llm-parity 0.1.0's dependencies (its pyproject.toml): what `pip install llm-parity` brought
PREVIOUS = (
    "torch==2.13.0", "transformers==5.24.0", "accelerate>=1.0", "tokenizers==0.23.3",
    "safetensors>=0.4", "numpy>=1.26", "pandas>=2.0", "pyyaml>=6.0", "matplotlib>=3.5",
    "pytest>=8.0", "hypothesis>=6.100", "tqdm>=4.60",
)  # fmt: skip
# the user's torch: the oldest and the newest release the recorder is tested on
USER_TORCH_ENVS = {
    "2.4.1": EnvSpec(
        "user-torch-2.4.1",
        # a user's env of its time: numpy 1.x (torch 2.4.1 runs with numpy 2 as well), so the
        # harness's own low end, numpy>=1.26, is what its wheel finds there
        requirements=("torch==2.4.1", "numpy<2"),
        constraints=("torch==2.4.1",),
    ),
    "2.14.1": EnvSpec(
        "user-torch-2.14.1",
        requirements=("torch==2.14.1",),
        constraints=("torch==2.14.1",),
    ),
}
# where a plain `pip install` replaces a package the user has, so the harness goes in under the
# env's own freeze as constraints: pandas>=2.0 resolves to pandas 3.1, which needs numpy>=2.0.2,
# so pip upgrades numpy 1.26.4 to 2.x (docs/install.md: `pip install llm-parity -c <(pip freeze)`)
KEEP_BY_CONSTRAINTS = {"2.4.1"}
USER_TORCH_DISK = 8 << 30  # free bytes a first build needs (~5 GB each, and pip's downloads)
TRACE_STEP = 3  # the step foreign_loop.py traces: its planted bugs start there (PLANT_STEP)
#: the user's transformers the HF callback is installed under: the oldest tested; the newest,
#: 5.24.0 (with accelerate 1.16.0), is the suite's own, where tests/record/test_recorder.py runs
#: the same job, and pip leaving a user's packages as they were is shown on every env here
HF_ENVS = {
    "4.57.1": EnvSpec(
        "hf-4.57.1",
        requirements=("torch==2.13.0", "transformers==4.57.1", "accelerate==1.11.0"),
        base=TORCH_BASE,
    ),
}


# --- helpers ------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    """This process's environment without what would put another python's packages first."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(cmd: list, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own, its output into files (a rank that outlives it keeps
    no pipe of ours open): past ``timeout`` every process it started is killed, found by a mark
    in its environment as the harness finds a launch's (parity.run.proc_scan; a torchrun's ranks
    in sessions of their own included), then TimeoutExpired with what it printed."""
    token = uuid.uuid4().hex
    timed_out = False
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, stdout=out, stderr=err,
                                env={**_env(), "PARITY_TEST_RUN": token}, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_carrying("PARITY_TEST_RUN", token, proc)
        printed = []
        for f in (out, err):
            f.seek(0)
            printed.append(f.read())
    if timed_out:
        raise subprocess.TimeoutExpired(proc.args, timeout, *printed)
    return subprocess.CompletedProcess(proc.args, proc.returncode, *printed)


def test_run_past_its_timeout_kills_what_it_started_in_other_sessions(tmp_path):
    """A torchrun's rank in a session of its own (torch 2.4.1) that outlives it: killed with
    the command at the timeout, which comes back at once with what was printed."""
    unique = uuid.uuid4().hex
    orphan = f"import time; time.sleep(120 if {unique!r} else 0)"
    parent = ("import subprocess, sys, time; "
              f"subprocess.Popen([sys.executable, '-c', {orphan!r}], start_new_session=True); "
              "print('started', flush=True); time.sleep(120)")  # fmt: skip
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as e:
        _run([sys.executable, "-c", parent], tmp_path, timeout=3)
    assert time.monotonic() - start < 30 and e.value.stdout == "started\n"
    left = [pid for pid in Path("/proc").iterdir() if pid.name.isdigit()
            and unique.encode() in _cmdline(pid)]  # fmt: skip
    assert left == []


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def _pip(python: Path, args: list[str], log: Path, timeout: float = 900) -> float:
    """pip with `python`, skipping when the index cannot be reached; its seconds."""
    started = time.monotonic()
    try:
        pip(python, args, log, timeout)
    except EnvUnavailable as e:
        pytest.skip(str(e))
    return time.monotonic() - started


def _freeze(python: Path) -> list[str]:
    out = _run([python, "-m", "pip", "freeze", "--all", "--disable-pip-version-check"], ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _names(freeze: list[str]) -> set[str]:
    return {re.sub(r"[-_.]+", "-", line.split("==")[0].split(" @ ")[0]).lower() for line in freeze}


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def _metrics(folder: Path, losses: list[float]) -> Path:
    folder.mkdir(parents=True)
    lines = [json.dumps({"step": i, "train/loss": x}) for i, x in enumerate(losses, 1)]
    lines.append(json.dumps({"event": "end", "steps": len(losses)}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@dataclass
class Venv:
    """A venv the harness's wheel went into: its python, how long pip took, what it added."""

    python: Path
    install_s: float
    added_bytes: int

    @property
    def parity(self) -> Path:
        return self.python.parent / "parity"


def _install(python: Path, wheel: Path, log: Path, keep: list[str] | None = None) -> Venv:
    """`pip install WHEEL` (with `keep`, a `pip freeze`, as its constraints: the user's way to
    have pip keep every package's version), timed and measured."""
    site = site_packages(python.parent.parent)
    before = _tree_bytes(site)
    args = ["install", str(wheel)]
    if keep is not None:
        (log.parent / "keep.txt").write_text("".join(f"{x}\n" for x in keep if "==" in x))
        args += ["-c", str(log.parent / "keep.txt")]
    seconds = _pip(python, args, log)
    return Venv(python, seconds, _tree_bytes(site) - before)


def _clone_dir(python: Path, tmp: Path) -> Path:
    """Where a clone of `python`'s env can go: `tmp`, or a folder beside the cached envs when
    `tmp` is on another filesystem (a hard link cannot cross one)."""
    if tmp.stat().st_dev == python.parent.stat().st_dev:
        return tmp / "venv"
    import tempfile

    return Path(tempfile.mkdtemp(prefix=".clone-", dir=python.parent.parent.parent)) / "venv"


# --- session fixtures ---------------------------------------------------------------------------


@dataclass
class Wheels:
    harness: Path
    plugin: Path


@pytest.fixture(scope="session")
def wheels(tmp_path_factory) -> Wheels:
    """The harness's wheel, built from a copy of this tree's pyproject.toml and parity/ (no
    stale build/ of the checkout gets in), and the reader plugin's."""
    tmp = tmp_path_factory.mktemp("wheels")
    src = tmp / "src"
    shutil.copytree(ROOT / "parity", src / "parity", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copytree(PLUGIN, tmp / "plugin", ignore=shutil.ignore_patterns("__pycache__"))
    for folder in (src, tmp / "plugin"):
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        out = _run([*cmd, folder, "-w", tmp / "dist"], tmp)
        assert out.returncode == 0, out.stdout + out.stderr
    found = (next((tmp / "dist").glob(f"{n}-*.whl")) for n in ("llm_parity", "parity_mylog"))
    return Wheels(*found)


@pytest.fixture(scope="session")
def bare(wheels, tmp_path_factory) -> Venv:
    """A fresh venv without torch, the harness installed into it (timed, measured)."""
    tmp = tmp_path_factory.mktemp("bare")
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", str(tmp / "venv")], check=True, timeout=300)
    return _install(tmp / "venv" / "bin" / "python", wheels.harness, tmp / "pip.log")


@dataclass
class UserVenv(Venv):
    torch: str
    freeze_before: list[str]
    freeze_after: list[str]
    torch_before: dict[str, tuple[int, int, int]]
    torch_after: dict[str, tuple[int, int, int]]


def _torch_files(python: Path) -> dict[str, tuple[int, int, int]]:
    """Every file torch's RECORD lists in site-packages (and the RECORD): inode, size, mtime.
    (Its console scripts in bin/ are not cloned.)"""
    site = site_packages(python.parent.parent)
    (record,) = site.glob("torch-*.dist-info/RECORD")
    paths = [line.split(",")[0] for line in record.read_text().splitlines() if line]
    paths = [p for p in paths if not p.startswith("../")]
    out = {}
    for rel in [*paths, str(record.relative_to(site))]:
        st = (site / rel).lstat()
        out[rel] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def _user_torch_env(torch_version: str) -> Path:
    """The python of the cached env of that user's torch, built first if this machine has none
    (skips without the disk or the index)."""
    spec = USER_TORCH_ENVS[torch_version]
    if find(spec) is None and shutil.disk_usage(root()).free < USER_TORCH_DISK:
        free = shutil.disk_usage(root()).free
        pytest.skip(f"{root()}: {_mb(free)} free, torch {torch_version}'s env needs ~8 GB")
    try:
        return ensure(spec)
    except EnvUnavailable as e:
        pytest.skip(f"no torch {torch_version} env: {e}")


@pytest.fixture(scope="session", params=list(USER_TORCH_ENVS))
def user_torch(request, wheels, tmp_path_factory) -> UserVenv:
    """A clone of the cached env of one user's torch (each of USER_TORCH_ENVS) with the harness
    installed into it, and what it held before and after pip."""
    torch_version = request.param
    base = _user_torch_env(torch_version)
    tmp = tmp_path_factory.mktemp(f"user-torch-{torch_version}")
    python = clone(base, _clone_dir(base, tmp))
    freeze, files = _freeze(python), _torch_files(python)
    keep = freeze if torch_version in KEEP_BY_CONSTRAINTS else None
    venv = _install(python, wheels.harness, tmp / "pip.log", keep)
    after = UserVenv(python, venv.install_s, venv.added_bytes, torch_version, freeze,
                     _freeze(python), files, _torch_files(python))  # fmt: skip
    yield after
    if not python.is_relative_to(tmp):
        shutil.rmtree(python.parent.parent.parent, ignore_errors=True)


# --- no torch -----------------------------------------------------------------------------------


@pytest.mark.parity
def test_the_core_brings_no_torch_and_compares_and_reports(bare, tmp_path, record_property):
    installed = _names(_freeze(bare.python))
    assert "llm-parity" in installed
    assert not installed & set(NOT_BROUGHT), sorted(installed & set(NOT_BROUGHT))
    assert _run([bare.parity, "--help"], tmp_path).returncode == 0
    a = _metrics(tmp_path / "a", [2.0, 1.5, 1.25, 1.0])
    again = _metrics(tmp_path / "again", [2.0, 1.5, 1.25, 1.0])
    changed = _metrics(tmp_path / "changed", [2.0, 1.5, 1.25000001, 1.0])
    out = _run([bare.parity, "compare", a, again], tmp_path)
    assert out.returncode == 0 and "verdict: aligned" in out.stdout, out.stdout + out.stderr
    out = _run([bare.parity, "compare", a, changed], tmp_path)
    assert out.returncode == 1 and "verdict: diverged" in out.stdout, out.stdout + out.stderr
    for other, code in ((again, 0), (changed, 1)):
        report = tmp_path / f"report-{other.name}"
        out = _run([bare.parity, "report", a, other, "-o", report], tmp_path)
        assert out.returncode == code, out.stdout + out.stderr
        assert (report / "report.md").is_file() and (report / "report.html").is_file()
    print(
        f"core install (no extras, no torch): {bare.install_s:.1f} s, "
        f"{_mb(bare.added_bytes)} in site-packages, {len(installed - {'pip', 'setuptools'})} "
        f"packages: {', '.join(sorted(installed - {'pip', 'setuptools'}))}"
    )
    record_property("core_install_s", round(bare.install_s, 1))
    record_property("core_install_bytes", bare.added_bytes)


@pytest.mark.parity
def test_the_core_against_the_previous_release(bare, tmp_path, record_property):
    """0.1.0 brought torch and transformers: resolved by pip --dry-run (nothing installed), each
    release's size taken from this venv's own copy of it."""
    (tmp_path / "previous.txt").write_text("\n".join(PREVIOUS) + "\n")
    report = tmp_path / "report.json"
    args = ["install", "--dry-run", "--ignore-installed", "--report", str(report)]
    seconds = _pip(bare.python, [*args, "-r", str(tmp_path / "previous.txt")], tmp_path / "log")
    resolved = [i["metadata"] for i in json.loads(report.read_text())["install"]]
    size, unmeasured = 0, []
    for item in resolved:
        try:
            dist = metadata.distribution(item["name"])
        except metadata.PackageNotFoundError:
            dist = None
        if dist is None or dist.version.split("+")[0] != item["version"].split("+")[0]:
            unmeasured.append(f"{item['name']}=={item['version']}")
            continue
        files = [f.locate() for f in dist.files or ()]
        size += sum(p.stat().st_size for p in files if p.is_file())
    names = {re.sub(r"[-_.]+", "-", i["name"]).lower() for i in resolved}
    assert {"torch", "transformers", "pytest"} <= names
    line = (f"previous release (0.1.0): {len(resolved)} packages, {_mb(size)} in site-packages "
            f"(resolved in {seconds:.1f} s, not installed"
            + (f"; not measured: {', '.join(unmeasured)}" if unmeasured else "") + "); "
            f"core: {bare.install_s:.1f} s, {_mb(bare.added_bytes)}")  # fmt: skip
    print(line)
    record_property("previous_install_bytes", size)
    assert bare.added_bytes < size


@pytest.mark.parity
def test_a_reader_plugin_is_read_by_format_and_by_detection(bare, wheels, tmp_path):
    """tests/readers/plugin_reader registers `mylog` (JSON lines with `it` for the step): a folder
    holding `train.mylog` is its by detection; the file itself, JSON lines the built-in jsonl
    claims first (and refuses: no step), only with --format mylog, which the error names."""
    _pip(bare.python, ["install", "--no-deps", str(wheels.plugin)], tmp_path / "pip.log")
    runs = {}
    for name, loss3 in (("a", 1.25), ("again", 1.25), ("changed", 1.5)):
        (tmp_path / name).mkdir()
        lines = [json.dumps({"it": i, "loss": x}) for i, x in enumerate([2.0, 1.5, loss3], 1)]
        (tmp_path / name / "train.mylog").write_text("\n".join(lines) + "\n")
        runs[name] = tmp_path / name
    for given in ([], ["--format", "mylog"]):
        for side in (runs["again"], runs["again"] / "train.mylog"):
            out = _run([bare.parity, "compare", runs["a"], side, *given], tmp_path)
            if not given and side.is_file():
                assert out.returncode == 2 and "give --format mylog" in out.stderr, out.stderr
                continue
            assert out.returncode == 0, out.stdout + out.stderr
            assert "[mylog]" in out.stdout and "verdict: aligned" in out.stdout, out.stdout
        out = _run([bare.parity, "compare", runs["a"], runs["changed"], *given], tmp_path)
        assert out.returncode == 1 and "loss" in out.stdout, out.stdout + out.stderr
    out = _run([bare.parity, "compare", "--help"], tmp_path)
    assert "mylog" in out.stdout


# --- parity check of a plain-python job ---------------------------------------------------------

JOB = """\
import json
import sys
from pathlib import Path

FACTOR = {factor}  # {comment}

out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
with open(out / "metrics.jsonl", "w") as f:
    for i in range(1, 6):
        f.write(json.dumps({{"step": i, "train/loss": 1.0 / i * (FACTOR if i >= 3 else 1.0)}}))
        f.write("\\n")
    f.write(json.dumps({{"event": "end", "steps": 5}}) + "\\n")
"""
SPEC = """\
task = "custom"
distributed = {distributed}
world_size = 1
steps = 5
command = ["job.py", "--out", "{out}"]
timeout_s = 120
"""


def _repo(root_: Path, distributed: bool) -> Path:
    """Three commits of job.py: base; a refactor that changes no number; a change of the loss
    from step 3 on."""
    repo = root_ / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "job.toml").write_text(SPEC.replace("{distributed}", str(distributed).lower()))
    for factor, comment in (("1.0", "base"), ("1.0", "refactor"), ("1.5", "change")):
        (repo / "job.py").write_text(JOB.format(factor=factor, comment=comment))
        git(repo, "add", ".")
        git(repo, "commit", "-q", "-m", comment)
    return repo


def _check(venv: Venv, tmp_path: Path, distributed: bool) -> None:
    repo = _repo(tmp_path, distributed)
    cases = (("HEAD~2", "HEAD~1", 0, "aligned"), ("HEAD~1", "HEAD", 1, "diverged"))
    for base, head, code, verdict in cases:
        out = tmp_path / f"check-{code}"
        cmd = [venv.parity, "check", "--spec", "job.toml", "--base", base, "--head", head]
        done = _run([*cmd, "--out", out, "--json"], repo)
        assert done.returncode == code, done.stdout + done.stderr
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["verdict"] == verdict
        if verdict == "diverged":
            assert result["metrics"]["train/loss"]["first_divergent_step"] == 3
        launcher_log = (out / "base.launch" / "launcher.log").read_text()
        assert ("torch.distributed.run" in launcher_log) == distributed, launcher_log[:500]


@pytest.mark.parity
def test_check_runs_a_plain_python_job_without_torch(bare, tmp_path):
    _check(bare, tmp_path, distributed=False)


@pytest.mark.parity
def test_check_runs_a_job_under_the_users_torchrun(user_torch, tmp_path):
    _check(user_torch, tmp_path, distributed=True)


# --- the user's torch ---------------------------------------------------------------------------


def _loop(v: UserVenv, out: Path, plant: str, tmp_path: Path) -> Path:
    """tests/jobs/foreign_loop.py on 2 gloo ranks under the user's torch, step TRACE_STEP traced."""
    cmd = [v.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [LOOP, "--out", out, "--steps", "4", "--fingerprint-steps", "all"]
    cmd += ["--trace-step", TRACE_STEP, "--plant", plant]
    # twice in CI (2026-12-07, torch 2.4.1) rank 1 hung for good at the loop's end, in
    # ~ProcessGroupGloo joining a gloo thread that waited for the GIL (freeing DDP's reducer;
    # foreign_loop.py now ends before its locals are freed). A hang is a failure with what the
    # run printed and wrote, its ranks killed, never a wait without end.
    try:
        done = _run(cmd, tmp_path, timeout=180)
    except subprocess.TimeoutExpired as e:
        written = sorted(str(p.relative_to(out)) for p in out.rglob("*")) if out.exists() else []
        pytest.fail(f"torchrun under torch {v.torch} hung {e.timeout:.0f} s; stdout "
                    f"{e.stdout!r:.2000} stderr {e.stderr!r:.2000} written {written}")  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


@pytest.mark.parity
def test_pip_leaves_the_users_torch_and_the_recorder_runs_on_it(
    user_torch, tmp_path, record_property
):
    """Each user's torch (USER_TORCH_ENVS): pip leaves it as it was, and parity.record's run
    folders and op traces, written under it, read as under the suite's torch: two runs aligned,
    every traced op the same, each forward and backward op under its module's name; a planted
    gradient bug diverged, the ops only it runs named by their parameter."""
    from parity.judge.opdiff import compare_ops

    v = user_torch
    gone = [line for line in v.freeze_before if line not in v.freeze_after]
    assert not gone, f"pip changed or removed: {gone}"
    assert any(line.startswith(f"torch=={v.torch}") for line in v.freeze_after)
    changed = [p for p, st in v.torch_before.items() if v.torch_after.get(p) != st]
    assert not changed and len(v.torch_before) > 1000, changed[:5]
    code = "import parity, torch; print(parity.__file__, torch.__version__)"
    where = _run([v.python, "-c", code], tmp_path)
    parity_file, version = where.stdout.split()
    assert Path(parity_file).is_relative_to(site_packages(v.python.parent.parent)), parity_file
    assert version.startswith(v.torch), version
    started = time.monotonic()
    a, b = (_loop(v, tmp_path / name, "none", tmp_path) for name in ("a", "b"))
    planted = _loop(v, tmp_path / "planted", "numeric", tmp_path)
    loop_s = (time.monotonic() - started) / 3
    manifest = json.loads((a / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["backend"] == "gloo"
    assert manifest["environment"]["torch"].startswith(v.torch), manifest["environment"]
    out = _run([v.parity, "compare", a, b], tmp_path)
    assert out.returncode == 0 and "verdict: aligned" in out.stdout, out.stdout + out.stderr
    out = _run([v.parity, "compare", a, planted], tmp_path)
    assert out.returncode == 1 and "verdict: diverged" in out.stdout, out.stdout + out.stderr
    assert f"first differing op at step {TRACE_STEP}" in out.stdout, out.stdout
    same = compare_ops(a, b)
    assert same.status == "same" and same.ops_compared > 100, same.line()
    lines = (a / "ops" / "rank0.jsonl").read_text().splitlines()[:-1]
    named = {(r["phase"], r["module"]) for r in map(json.loads, lines)}
    modules = ("embed", "fc1", "act", "fc2")
    assert {(ph, m) for ph in ("forward", "backward") for m in modules} <= named, sorted(named)
    d = compare_ops(a, planted)
    only = {(s["side"], s["phase"], s["module"], s["op"]) for s in d.structural}
    assert d.step == TRACE_STEP and d.status == "differ", d.line()
    assert ("b", "step", "fc2.weight.grad", "aten.add_.Tensor") in only, sorted(only)
    added = sorted(_names(v.freeze_after) - _names(v.freeze_before))
    print(f"core into torch {version}'s env: {v.install_s:.1f} s, {_mb(v.added_bytes)}, "
          f"{len(added)} packages added: {', '.join(added)}; a traced 2-rank loop: "
          f"{loop_s:.1f} s")  # fmt: skip
    record_property("user_torch_install_s", round(v.install_s, 1))


# --- the HF callback under the user's transformers ----------------------------------------------


def _hf_env(version: str) -> Path:
    try:
        return ensure(HF_ENVS[version])
    except EnvUnavailable as e:
        pytest.skip(f"no transformers {version} env: {e}")


@pytest.mark.parity
@pytest.mark.parametrize("transformers", sorted(HF_ENVS))
def test_the_hf_callback_under_the_users_transformers(transformers, wheels, tmp_path):
    """tests/jobs/hf_callback_run.py in a clone of an env with that transformers, the harness
    installed from its wheel; its two runs checked here as tests/record/test_recorder.py checks
    them."""
    base = _hf_env(transformers)
    python = clone(base, _clone_dir(base, tmp_path))
    try:
        before = _freeze(python)
        _install(python, wheels.harness, tmp_path / "pip.log")
        after = _freeze(python)
        assert not [x for x in before if x not in after], "pip changed the user's packages"
        assert f"transformers=={transformers}" in after
        for name, norm in (("a", "1.0"), ("b", "1e-3")):
            cmd = [python, HF_RUN, "--out", tmp_path / name, "--max-grad-norm", norm]
            done = _run(cmd, tmp_path)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        hf_callback_run.check(tmp_path / "a", tmp_path / "b")
        manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
        assert manifest["environment"]["transformers"] == transformers
    finally:
        if not python.is_relative_to(tmp_path):
            shutil.rmtree(python.parent.parent.parent, ignore_errors=True)


# --- in this venv -------------------------------------------------------------------------------


def test_the_cli_imports_no_torch_or_pytest(tmp_path):
    """`import parity.cli` and `parity compare` leave torch, transformers, pytest and hypothesis
    unimported, though this venv has them: the CLI runs where none is installed."""
    for name in ("a", "b"):
        _metrics(tmp_path / name, [2.0, 1.5])
    code = (
        "import sys, parity.cli\n"
        f"code = parity.cli.main(['compare', {str(tmp_path / 'a')!r}, {str(tmp_path / 'b')!r}])\n"
        f"print(code, [m for m in {NOT_BROUGHT!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.splitlines()[-1] == "0 []", out.stdout + out.stderr


def test_clone_refuses_another_filesystem(tmp_path, monkeypatch):
    """subjects.envs.clone names both folders when hard links cannot reach (checked by device)."""
    real_stat = Path.stat

    def stat(self, *args, **kwargs):
        st = real_stat(self, *args, **kwargs)
        if self.name == "site-packages" and str(self).startswith(str(tmp_path / "dest")):
            return os.stat_result((*st[:2], st.st_dev + 1, *st[3:]))
        return st

    monkeypatch.setattr(Path, "stat", stat)
    with pytest.raises(EnvBuildError, match=r"dest: not on the filesystem of .*; clone it beside"):
        clone(Path(sys.executable), tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
