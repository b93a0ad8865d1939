"""The Slurm launcher against a real Slurm: four fake nodes on this host (`ci/slurm.sh`, started
for this module and stopped by pid after it; skipped with the reason where it cannot start).

Shown: the charcount SFT pair at 2 nodes x 1 rank through Slurm in one allocation, bit for bit
the local `--nnodes 2` pair; every preset with every mutant (the fast paths' differential jobs,
tests/run/catalogue.py) bit for bit its plain launch, in one allocation and as --parallel jobs; a
mutant pair diverging at the metric and step it does locally (test_mutants.py's table), the
op-trace rerun in the same allocation; `check` and `bisect` naming a planted commit; and
the faults: SIGTERM (nothing left queued or running, exit 143), a rank killed (the node named),
Slurm's TIMEOUT, sbatch's refusal (exit 2 with its message), an allocation pending too long,
a folder the nodes do not share, and --parallel sides on different nodes (the topology line).
Those launch torchrun through srun and carry the `parity` mark; the unit tests at the end do not.

The TIMEOUT case waits out Slurm's one-minute minimum time limit: it is started first, in the
background, and judged last, so that the other tests run meanwhile.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.judge.compare import compare_frames
from parity.readers import read_metrics
from parity.run import slurm
from parity.run.job import run_job
from parity.spec import LauncherSpec
from tests.orchestration.history import JOB, commit_of, make_repo
from tests.run.catalogue import assert_bitwise
from tests.run.procs import procs_mentioning
from tests.worker.test_mutants import CHECKS

ROOT = Path(__file__).resolve().parents[2]
DUMMY = ROOT / "tests" / "jobs" / "dummy_job.py"
SLURM_SH = ROOT / "ci" / "slurm.sh"


def parity(
    *args: str, cwd: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "parity.cli", *args], cwd=cwd, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def queued() -> set[str]:
    """The ids of the jobs Slurm still has pending or running."""
    done = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True)
    return set(done.stdout.split())


def jobs_under(folder: Path) -> set[str]:
    """Every job id the harness submitted for runs under ``folder`` (sbatch.txt's second line)."""
    return {p.read_text().split("\n")[1] for p in folder.rglob("sbatch.txt")} - {""}


def left_queued(folder: Path) -> set[str]:
    found = jobs_under(folder)
    assert found, f"no job was submitted under {folder}"
    return found & queued()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Slurm up for this module (SLURM_CONF set for it), down by pid after it."""
    if os.geteuid() != 0 or shutil.which("slurmctld", path="/usr/sbin:/usr/bin") is None:
        pytest.skip("a Slurm on this host needs root and Debian's slurmctld/slurmd/munge "
                    "(bash ci/slurm.sh install)")  # fmt: skip
    folder = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(["bash", str(SLURM_SH), "up", str(folder), "4"], capture_output=True,
                        text=True, timeout=120)  # fmt: skip
    if up.returncode != 0:
        subprocess.run(["bash", str(SLURM_SH), "down", str(folder)], timeout=60)
        pytest.skip(f"Slurm did not start here: {up.stderr.strip()[-300:]}")
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(folder / "slurm.conf")
    try:
        yield folder
    finally:
        subprocess.run(["scancel", "--user", "root"], capture_output=True)
        subprocess.run(["bash", str(SLURM_SH), "down", str(folder)], timeout=60)
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
    assert not procs_mentioning(str(folder)), procs_mentioning(str(folder))


SLEEP_JOB = "import time\ntime.sleep(600)\n"


@pytest.fixture(scope="module")
def timeout_run(cluster, tmp_path_factory):
    """A side longer than its allocation's time (1 minute, Slurm's least), started now."""
    folder = tmp_path_factory.mktemp("slurm-timeout")
    (folder / "sleep.py").write_text(SLEEP_JOB)
    (folder / "spec.toml").write_text(
        'command = ["sleep.py"]\ndistributed = false\ntimeout_s = 900\n'
        '[launcher]\nkind = "slurm"\ntime = "1"\n'
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "parity.cli", "pair", "--spec", "spec.toml", "--out", "out"],
        cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    yield proc, folder
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.parity
def test_timeout_side_started(timeout_run):
    """Starts the TIMEOUT case early (judged in the last test)."""
    proc, _ = timeout_run
    assert proc.poll() is None


# --- the pair: bit for bit the local one --------------------------------------------------------

SFT = ["--task", "charcount-sft", "--world", "2", "--nnodes", "2", "--steps", "4"]


@pytest.fixture(scope="module")
def slurm_pair(cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("slurm-pair")
    done = parity("pair", *SFT, "--a", "legacy", "--b", "worker", "--launcher", "slurm",
                  "--out", str(out), "--json")  # fmt: skip
    return done, out


@pytest.mark.parity
def test_sft_pair_through_slurm_is_the_local_pair_bit_for_bit(slurm_pair, tmp_path):
    done, out = slurm_pair
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["verdict"] == "aligned"
    local = parity("pair", *SFT, "--a", "legacy", "--b", "worker", "--out", str(tmp_path))
    assert local.returncode == 0, local.stderr
    for side in ("a", "b"):
        same = compare_frames(read_metrics(out / side), read_metrics(tmp_path / side))
        assert same.verdict == "aligned", same.table()  # every value bit for bit (mfu: timing)
        judged = [m for m in same.metrics.values() if m.policy != "ignore"]
        assert len(judged) >= 5 and all(m.policy == "exact" for m in judged)
    # both sides in one allocation, on the same nodes with the same rank-to-node map
    where = json.loads((out / "summary.json").read_text())["topology"]
    assert where["a"]["launcher"] == "slurm" and where["a"]["job_id"] == where["b"]["job_id"]
    assert where["a"]["nodes"] == where["b"]["nodes"] and len(set(where["a"]["nodes"])) == 2
    assert where["line"] == ""
    assert where["a"]["slurm"]["SLURM_JOB_NUM_NODES"] == "2"
    assert where["a"]["ranks"] == where["a"]["nodes"]  # rank i on node i (1 rank per node)
    report = (out / "report.md").read_text()
    assert f"slurm job {where['a']['job_id']}: node 0 {where['a']['nodes'][0]}" in report
    assert "allocation" in os.listdir(out) and not left_queued(out)


@pytest.mark.parity
def test_mutant_pair_through_slurm_diverges_as_locally(cluster, tmp_path):
    args = [*SFT, "--a", "legacy", "--b", "worker", "--inject-b", "layer-grad-halved", "--json"]
    slurm = parity("pair", *args, "--launcher", "slurm", "--out", str(tmp_path / "slurm"))
    assert slurm.returncode == 1, slurm.stderr
    ours = json.loads(slurm.stdout)
    _, _, metric, step = CHECKS["layer-grad-halved"]  # where it diverges locally
    assert (ours["diagnosis"]["metric"], ours["diagnosis"]["step"]) == (metric, step)
    assert ours["diagnosis"]["kind"] == "same batches, numbers differ"
    # the op-trace rerun ran in the pair's allocation too, and named the first differing op
    assert ours["trace_rerun"]["reason"] == "" and ours["diagnosis"]["ops"]["status"] == "differ"
    ids = {json.loads((tmp_path / "slurm" / f"{d}.launch" / "topology.json").read_text())["job_id"]
           for d in ("a", "b", "trace-a", "trace-b")}  # fmt: skip
    assert len(ids) == 1


@pytest.mark.parity
def test_every_preset_and_mutant_through_slurm_is_bitwise_plain(cluster, catalogue_runs, tmp_path):
    """The differential test's jobs (tests/run/catalogue.py) through Slurm, each bit for bit its
    plain launch: the presets with every mutant as steps of one allocation, one after the other,
    and the clean presets at once as jobs of their own (--parallel). Each Slurm step is a fresh
    torchrun, so the clean-after-mutated order the warm paths need adds nothing here."""
    specs, plain = catalogue_runs.specs[:-1], catalogue_runs.plain
    mutated, clean = range(0, len(specs), 2), range(1, len(specs), 2)
    held = LauncherSpec(kind="slurm")
    with slurm.hold(held, 1, tmp_path / "allocation"):
        steps = [run_job(specs[k].replace(launcher=held), tmp_path / f"step-{k}") for k in mutated]
    apart = LauncherSpec(kind="slurm", parallel=True)
    runs = slurm.run_parallel([
        lambda k=k: run_job(specs[k].replace(launcher=apart), tmp_path / f"parallel-{k}")
        for k in clean
    ])  # fmt: skip
    for path, ks, done in (("slurm", mutated, steps), ("slurm --parallel", clean, runs)):
        assert_bitwise(path, [specs[k] for k in ks], [r.metrics for r in done],
                       [plain[k] for k in ks])  # fmt: skip
    assert len(jobs_under(tmp_path)) == 1 + len(clean)


# --- check and bisect --------------------------------------------------------------------------


@pytest.mark.parity
def test_check_and_bisect_through_slurm_name_the_planted_commit(cluster, tmp_path):
    (tmp_path / "repo").mkdir()
    repo = make_repo(tmp_path / "repo")
    check = parity("check", "--spec", "spec.toml", "--base", "HEAD~3", "--head", "HEAD~2",
                   "--launcher", "slurm", "--out", str(tmp_path / "check"), "--json",
                   cwd=repo)  # fmt: skip
    assert check.returncode == 1, check.stderr
    found = json.loads(check.stdout)
    assert found["head"]["commit"] == commit_of(repo, 3) and found["verdict"] == "diverged"
    ids = {json.loads((tmp_path / "check" / f"{d}.launch" / "topology.json").read_text())["job_id"]
           for d in ("base", "head")}  # fmt: skip
    assert len(ids) == 1  # both revisions in one allocation
    step = (tmp_path / "check" / "allocation" / "steps" / "0.sh").read_text()  # base's
    assert f"cd {tmp_path}/check/allocation/parity-worktree-" in step  # on the shared folder
    assert not list((tmp_path / "check" / "allocation").glob("parity-worktree-*"))  # removed
    bisect = parity("bisect", "--good", "HEAD~4", "--bad", "main", "--spec", "spec.toml",
                    "--launcher", "slurm", "--out", str(tmp_path / "bisect"), "--json",
                    cwd=repo)  # fmt: skip
    assert bisect.returncode == 1, bisect.stderr
    result = json.loads(bisect.stdout)
    assert result["first_bad"]["commit"] == commit_of(repo, 3)
    assert result["first_bad"]["metric"] == "train/loss" and result["first_bad"]["step"] == 4
    probes = [*(tmp_path / "bisect" / "commits").glob("*.launch"), tmp_path / "bisect/good.launch"]
    ids = {json.loads((p / "topology.json").read_text())["job_id"] for p in probes}
    assert len(probes) >= 3 and len(ids) == 1  # every probe in the one allocation
    assert not left_queued(tmp_path)


# --- faults ------------------------------------------------------------------------------------


def _dummy_spec(folder: Path, mode: str, **launcher: object) -> Path:
    table = "".join(f"{k} = {json.dumps(v)}\n" for k, v in {"kind": "slurm", **launcher}.items())
    path = folder / f"{mode}.toml"
    path.write_text(
        f'command = ["{DUMMY}", "--mode", "{mode}", "--out", "{{out}}"]\nworld_size = 2\n'
        f"nnodes = 2\ntimeout_s = 120\n[launcher]\n{table}"
    )
    return path


@pytest.mark.parity
def test_sigterm_cancels_the_allocation_and_leaves_nothing(cluster, tmp_path):
    spec = _dummy_spec(tmp_path, "hang")
    proc = subprocess.Popen(
        [sys.executable, "-m", "parity.cli", "pair", "--spec", str(spec), "--out",
         str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not list((tmp_path / "out" / "a.launch").glob("node1/slurm-node")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(1)
        (job,) = jobs_under(tmp_path)
        assert job in queued()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert "interrupted by SIGTERM" in err and len(err.strip().splitlines()) <= 3, err
    assert job not in queued()
    assert not procs_mentioning(str(tmp_path)), procs_mentioning(str(tmp_path))


QUICK_HEARTBEAT = (
    "import sys; import parity.run.slurm as slurm; slurm.HEARTBEAT_S = 5; "
    "from parity.cli import main; raise SystemExit(main(sys.argv[1:]))"
)


@pytest.mark.parity
def test_a_sigkilled_harness_ends_its_allocation_with_the_running_side(cluster, tmp_path):
    """SIGKILL runs no cleanup: the agent sees the heartbeat stop (here after 5 s), also while
    a side's step runs, and ends; Slurm then ends the job and its step, and nothing is left."""
    spec = _dummy_spec(tmp_path, "hang")
    proc = subprocess.Popen(
        [sys.executable, "-c", QUICK_HEARTBEAT, "pair", "--spec", str(spec), "--out",
         str(tmp_path / "out")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not list((tmp_path / "out" / "a.launch").glob("node1/slurm-node")):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        (job,) = jobs_under(tmp_path)
        proc.kill()
        proc.wait()
        killed = time.monotonic()
        while job in queued() or procs_mentioning(str(tmp_path)):
            assert time.monotonic() - killed < 40, procs_mentioning(str(tmp_path))
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "went quiet for 5 s" in (tmp_path / "out" / "allocation" / "agent.log").read_text()


SECRET_JOB = """\
import hashlib, json, os, sys
from pathlib import Path
token = os.environ.get("HF_TOKEN", "").encode()
assert hashlib.sha256(token).hexdigest() == sys.argv[2], "the job did not get its HF_TOKEN"
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
lines = [{"step": 1, "train/loss": 1.0}, {"event": "end", "steps": 1}]
(out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in lines))
"""


@pytest.mark.parity
def test_a_secret_in_env_reaches_the_job_and_no_file(cluster, tmp_path):
    """HF_TOKEN from the spec's [env] gets to the job through Slurm, and no file of the run
    holds it: not the step scripts (kept, readable by the nodes' users), nor any log."""
    import hashlib

    secret = "hf_" + os.urandom(8).hex()
    (tmp_path / "job.py").write_text(SECRET_JOB)
    digest = hashlib.sha256(secret.encode()).hexdigest()
    (tmp_path / "spec.toml").write_text(
        f'command = ["job.py", "{{out}}", "{digest}"]\ndistributed = false\ntimeout_s = 120\n'
        f'[env]\nHF_TOKEN = "{secret}"\n[launcher]\nkind = "slurm"\n'
    )
    done = parity("pair", "--spec", "spec.toml", "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    assert list(out.glob("allocation/steps/*.sh"))
    holding = [p for p in out.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert holding == []
    assert secret not in done.stdout + done.stderr and not left_queued(out)


@pytest.mark.parity
def test_a_killed_rank_is_failed_naming_its_node(cluster, tmp_path):
    done = parity("pair", "--spec", str(_dummy_spec(tmp_path, "sigkill")), "--out",
                  str(tmp_path / "out"), "--json")  # fmt: skip
    assert done.returncode == 3, done.stderr
    topo = json.loads((tmp_path / "out" / "a.launch" / "topology.json").read_text())
    assert f"rank 1 on {topo['nodes'][1]}: killed by SIGKILL (first failure)" in done.stderr
    failure = json.loads(done.stdout)["failures"][0]
    assert failure == {"rank": 1, "exitcode": -9, "signal": "SIGKILL", "host": topo["nodes"][1]}
    assert not left_queued(tmp_path)


@pytest.mark.parity
def test_a_side_past_its_timeout_s_has_its_step_cancelled(cluster, tmp_path):
    spec = _dummy_spec(tmp_path, "hang")
    spec.write_text(spec.read_text().replace("timeout_s = 120", "timeout_s = 6"))
    done = parity("pair", "--spec", str(spec), "--out", str(tmp_path / "out"))
    assert done.returncode == 3, done.stderr
    assert "side a: timed out after 6 s (the job's timeout_s): its step was cancelled" in (
        done.stderr
    )
    assert not left_queued(tmp_path)
    assert not procs_mentioning(str(tmp_path)), procs_mentioning(str(tmp_path))


@pytest.mark.parity
def test_sbatch_refusal_is_bad_input_with_slurms_message(cluster, tmp_path):
    done = parity("pair", "--spec", str(_dummy_spec(tmp_path, "ok", partition="nope")),
                  "--out", str(tmp_path / "out"))  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "sbatch refused" in done.stderr and "invalid partition" in done.stderr.lower()
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parity
def test_an_allocation_pending_too_long_is_cancelled_and_failed(cluster, tmp_path):
    spec = _dummy_spec(tmp_path, "ok", nodes=9, max_pending_s=3)
    done = parity("pair", "--spec", str(spec), "--out", str(tmp_path / "out"))
    assert done.returncode == 3, done.stderr
    assert "still pending after 3 s" in done.stderr, done.stderr
    assert not left_queued(tmp_path)


@pytest.mark.parity
def test_a_folder_the_nodes_do_not_share_is_failed_not_waited_on(cluster, tmp_path, monkeypatch):
    """As if the nodes wrote to a disk of their own: the agent's files never appear here."""
    from parity.run import slurm
    from parity.spec import LauncherSpec

    monkeypatch.setattr(slurm, "_AGENT", "#!/bin/bash\n# {folder} {heartbeat}\nsleep 60\n")
    allocation = slurm.Allocation(LauncherSpec("slurm", visible_s=2), 1, tmp_path / "alloc")
    allocation.submit()
    start = time.monotonic()
    assert not allocation.wait_started()
    assert time.monotonic() - start < 30
    assert "did not appear here within 2 s" in allocation.failure
    assert "shared with the nodes" in allocation.failure
    assert not left_queued(tmp_path)


@pytest.mark.parity
def test_parallel_sides_on_different_nodes_carry_the_topology_line(cluster, tmp_path):
    (tmp_path / "job.py").write_text(JOB.format(nudge=False, label="one"))
    (tmp_path / "spec.toml").write_text(
        'command = ["job.py", "--out", "{out}"]\ntimeout_s = 120\n[launcher]\nkind = "slurm"\n'
    )
    done = parity("pair", "--spec", "spec.toml", "--launcher", "slurm", "--parallel", "--out",
                  "out", "--json", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    where = json.loads((tmp_path / "out" / "summary.json").read_text())["topology"]
    assert where["a"]["job_id"] != where["b"]["job_id"]
    assert where["a"]["nodes"] != where["b"]["nodes"]  # at once: on two different nodes
    assert "the sides ran on different nodes" in where["line"]
    assert "only a tolerance verdict is meaningful" in where["line"]
    assert where["line"] in (tmp_path / "out" / "report.md").read_text()
    compared = parity("compare", "out/a", "out/b", cwd=tmp_path)  # the same line, later
    assert compared.returncode == 0 and f"topology: {where['line']}" in compared.stdout


@pytest.mark.parity
def test_a_side_past_its_time_limit_is_failed_with_slurms_timeout(timeout_run):
    proc, folder = timeout_run
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 3, err
    assert "TIMEOUT" in err and "reason TimeLimit" in err, err
    assert not left_queued(folder)


# --- without a cluster -------------------------------------------------------------------------


def test_srun_task_lines_give_each_nodes_exit_code():
    from parity.run.slurm import _node_codes

    text = ("srun: error: n2: task 1: Exited with exit code 3\n"
            "srun: error: n1: tasks 0,2-3: Killed\n")  # fmt: skip
    assert _node_codes(text, {}) == {0: -9, 1: 3, 2: -9, 3: -9}


def test_topology_line_only_when_the_nodes_differ():
    from parity.judge import topology

    a = {"launcher": "slurm", "job_id": "7", "nodes": ["n1", "n2"], "nproc_per_node": 1}
    assert topology.line(a, dict(a, job_id="8")) == ""  # other job, same nodes: same topology
    assert topology.line(a, {}) == ""  # unknown: nothing claimed
    moved = dict(a, job_id="8", nodes=["n3", "n4"])
    line = topology.line(a, moved, "aligned")
    assert "A: slurm job 7: node 0 n1, node 1 n2" in line and "B: slurm job 8: node 0 n3" in line
    assert "not a guarantee" in line and "only a tolerance verdict is meaningful" in line


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"kind": "slurm", "partitio": "x"}, "unknown key 'partitio' in [launcher] (did you mean"),
        ({"kind": "slurm", "ntasks_per_node": 2}, "one torchrun per node"),
        ({"kind": "local", "partition": "x"}, 'launcher partition: only for kind = "slurm"'),
        ({"kind": "pbs"}, "launcher kind must be one of local, slurm"),
        ({"kind": "slurm", "parallel": "yes"}, "launcher parallel must be true or false"),
        ({"kind": "slurm", "nodes": 1}, "launcher nodes 1 is fewer than the job's nnodes 2"),
        ({"kind": "slurm", "poll_s": 0}, "launcher poll_s must be a number of seconds > 0"),
    ],
)
def test_bad_launcher_tables_are_refused(tmp_path, table, message):
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items())
    path = tmp_path / "spec.toml"
    path.write_text(f'command = ["x.py"]\nworld_size = 2\nnnodes = 2\n[launcher]\n{lines}')
    done = parity("spec", str(path))
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_the_sides_of_a_pair_share_one_launcher(tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text('command = ["x.py"]\n[launcher]\nkind = "slurm"\n[b]\nlauncher = "local"\n')
    done = parity("spec", str(path))
    assert done.returncode == 2 and "must run on one launcher" in done.stderr, done.stderr


def test_flags_that_need_slurm_are_refused_without_it(tmp_path):
    job = ["pair", "--spec", str(tmp_path / "spec.toml"), "--out", str(tmp_path / "out")]
    (tmp_path / "spec.toml").write_text('command = ["x.py"]\n')
    parallel = parity(*job, "--parallel")
    assert parallel.returncode == 2 and 'launcher parallel: only for kind = "slurm"' in (
        parallel.stderr
    )
    in_process = parity(*job, "--launcher", "slurm", "--in-process")
    assert in_process.returncode == 2 and "not with launcher 'slurm'" in in_process.stderr


def test_no_slurm_tools_is_bad_input(tmp_path):
    (tmp_path / "spec.toml").write_text('command = ["x.py"]\n')
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    done = subprocess.run(
        [sys.executable, "-m", "parity.cli", "pair", "--spec", "spec.toml", "--launcher", "slurm",
         "--out", "out"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "sbatch: not found: the slurm launcher runs where Slurm's client tools are" in (
        done.stderr
    )


SECRET = "hf_secret_value_123"
FAKE_SRUN = f"""#!/bin/bash
[ "$HF_TOKEN" = {SECRET!r} ] && [ "$SEED" = 7 ] && echo "srun saw the job's variables"
"""


def test_a_step_script_holds_no_secret_and_its_job_still_gets_it(tmp_path):
    """The step script (kept after the run, readable by the nodes' users) exports no secret: the
    secrets go through a file of the user's only, that the step reads and removes as it starts;
    srun still passes them to the job. Run with stand-ins for srun and scontrol."""
    from parity.run.launch import LaunchRequest
    from parity.run.slurm import Allocation, Side
    from parity.spec import LauncherSpec

    launcher = LauncherSpec(kind="slurm")
    allocation = Allocation(launcher, 1, tmp_path / "allocation")
    (allocation.folder / "steps").mkdir(parents=True)
    env = {"HF_TOKEN": SECRET, "SEED": "7"}
    request = LaunchRequest(["job.py"], 1, tmp_path / "a.launch", 60, env, cwd=tmp_path,
                            exit_grace_s=1)  # fmt: skip
    side = Side(request, 1, launcher)
    seq = allocation.queue(side)
    step, secrets = (allocation.folder / "steps" / f"{seq}{ext}" for ext in (".sh", ".env"))
    assert SECRET not in step.read_text() and "SEED=7" in step.read_text()
    assert secrets.stat().st_mode & 0o777 == 0o600

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, text in (("srun", FAKE_SRUN), ("scontrol", "#!/bin/bash\necho n1\n")):
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    done = subprocess.run(["bash", str(step)], cwd=allocation.folder, timeout=60,
                          env={**os.environ, "PATH": path, "SLURM_JOB_NODELIST": "n1"})  # fmt: skip
    assert done.returncode == 0
    assert "srun saw the job's variables" in (tmp_path / "a.launch" / "srun.log").read_text()
    assert not secrets.exists()
    written = [*allocation.folder.rglob("*"), *side.run_dir.rglob("*")]  # not the stand-ins
    assert [p for p in written if p.is_file() and SECRET in p.read_text()] == []


def test_a_step_signalled_as_its_allocation_ends_is_failed_with_slurms_end(tmp_path, monkeypatch):
    """At its time limit Slurm signals the step and the agent at once, so the step's exit (143)
    can be written before Slurm shows the job ended: the side is failed with Slurm's end
    (TIMEOUT, TimeLimit), as when the job's state comes first, never as the job's own crash."""
    from parity.run import slurm
    from parity.run.launch import LaunchRequest
    from parity.spec import LauncherSpec

    launcher = LauncherSpec.from_value({"kind": "slurm"})
    allocation = slurm.Allocation(launcher, 1, tmp_path / "allocation")
    allocation.job_id = "7"
    (allocation.folder / "steps").mkdir(parents=True)
    (allocation.folder / "steps" / "0.exit").write_text("143\n")
    states = iter([slurm.JobState("7", "RUNNING"), slurm.JobState("7", "TIMEOUT", "TimeLimit")])
    monkeypatch.setattr(slurm, "job_state", lambda job_id: next(states))
    request = LaunchRequest(["job.py"], 1, tmp_path / "a.launch", 60.0, exit_grace_s=5.0,
                            label="side a")  # fmt: skip
    side = slurm.Side(request, 1, launcher)
    result = allocation._wait(side, 0, time.monotonic())
    assert not result.ok and "TIMEOUT" in result.describe() and "TimeLimit" in result.describe()
    assert allocation.failure.startswith("the allocation ended while side a ran")
