"""`parity ci`: the CI recipe for a user's own repository, and the project's ci/*.sh scripts.

The workflow is checked for the shape GitHub Actions needs (no schema is at hand offline: `on`,
`jobs.<id>.runs-on`, steps each with `uses` or `run`) and for the steps that make the check
meaningful (the whole history, so that the merge base exists; the installs; the check with the
spec and the merge base; the summary and the artifact kept also when the check fails). Its check
and summary steps and the script form are then run for real against a throwaway repository whose
job is one plain process (about a second a check): exit 0 on an unchanged job, 1 on a planted
change, the report written, report.md appended to a fake $GITHUB_STEP_SUMMARY, a second run in the
same checkout into a fresh folder. The pytest recipe of docs/ci.md (a golden made at the base) runs
too. Every ci/*.sh answers --help with its usage and does nothing else.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from parity.cli import main
from tests.orchestration.history import commit, git, new_repo

ROOT = Path(__file__).resolve().parents[2]
CI_SCRIPTS = sorted((ROOT / "ci").glob("*.sh"))

JOB = """\
import json
import sys
from pathlib import Path

FACTOR = {factor}  # {label}
out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
with open(out / "metrics.jsonl", "w") as f:
    for step in range(1, 4):
        f.write(json.dumps({{"step": step, "train/loss": FACTOR / step}}) + "\\n")
    f.write(json.dumps({{"event": "end", "steps": 3}}) + "\\n")
"""

SPEC = """\
task = "custom"
distributed = false
command = ["job.py", "--out", "{out}"]
timeout_s = 60
"""

RECORDED_JOB = """\
import sys

from parity.record import record_run

FACTOR = {factor}
out = sys.argv[sys.argv.index("--out") + 1]
with record_run(out) as rec:  # the manifest a golden needs: the environment's fingerprint
    for step in range(1, 4):
        rec.log(step, {{"train/loss": FACTOR / step}})
"""

PYTEST_RECIPE = """\
import pytest
from parity.spec import load_spec


@pytest.mark.parity
def test_the_job_matches_its_golden(parity_runner, parity_golden):
    run = parity_runner.job(load_spec("parity.toml"))
    parity_golden.check("my-job", run)  # fixtures/golden/my-job/<environment>/
"""


def _commit(repo: Path, factor: str, label: str) -> None:
    commit(repo, label, {"job.py": JOB.format(factor=factor, label=label)})


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A user's repository: main with the job and its spec, a branch `feature` one commit on
    that changes nothing the job computes."""
    repo = new_repo(tmp_path / "repo")
    (repo / "parity.toml").write_text(SPEC)
    _commit(repo, "1.0", "the job")
    git(repo, "checkout", "-q", "-b", "feature")
    _commit(repo, "1.0", "a comment only")
    return repo


@pytest.fixture
def shell_env(tmp_path: Path) -> dict[str, str]:
    """The environment CI gives a step: `parity` on PATH (this interpreter's harness, already
    installed), a step summary file, OMP_NUM_THREADS."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "parity"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m parity.cli "$@"\n')
    shim.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env["GITHUB_STEP_SUMMARY"] = str(tmp_path / "step-summary.md")
    return env


def _recipe(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main(["ci", *argv]) == 0
    return capsys.readouterr().out


def _workflow(capsys, spec: Path, *argv: str) -> dict:
    return yaml.safe_load(_recipe(capsys, "--spec", str(spec), *argv))


def _steps(workflow: dict) -> list[dict]:
    (job,) = workflow["jobs"].values()
    return job["steps"]


def _step(workflow: dict, text: str) -> dict:
    """The one step whose name, uses or run contains ``text``."""
    found = [s for s in _steps(workflow) if any(text in str(s.get(k, "")) for k in
                                                 ("name", "uses", "run"))]  # fmt: skip
    assert len(found) == 1, (text, found)
    return found[0]


# --- the workflow -------------------------------------------------------------------------------


def test_the_workflow_has_the_shape_github_actions_reads(repo: Path, capsys) -> None:
    workflow = _workflow(capsys, repo / "parity.toml")
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert "pull_request" in triggers
    assert isinstance(workflow["name"], str)
    ((job_id, job),) = workflow["jobs"].items()
    assert job_id.replace("-", "").replace("_", "").isalnum()
    assert isinstance(job["runs-on"], str) and job["steps"]
    for step in job["steps"]:
        assert isinstance(step, dict) and (("uses" in step) != ("run" in step)), step
        assert set(step) <= {"name", "id", "if", "uses", "with", "run", "env", "shell"}, step
        if "with" in step:
            assert "uses" in step and isinstance(step["with"], dict)


def test_the_workflow_has_the_steps_a_check_needs_in_order(repo: Path, capsys) -> None:
    workflow = _workflow(capsys, repo / "parity.toml")
    steps = _steps(workflow)
    checkout = _step(workflow, "actions/checkout@")
    assert checkout["with"]["fetch-depth"] == 0  # the merge base must be in the clone
    assert _step(workflow, "actions/setup-python@")["with"]["python-version"] == "3.11"
    project = _step(workflow, "pip install -e .")
    harness = _step(workflow, "pip install llm-parity")
    check = _step(workflow, "parity check")
    assert 'git merge-base "$ref" HEAD' in check["run"]
    assert 'ref="origin/$TARGET"' in check["run"] and "github.base_ref" in check["env"]["TARGET"]
    assert 'parity check --base "$base" --spec parity.toml --out parity-report' in check["run"]
    summary = _step(workflow, "GITHUB_STEP_SUMMARY")
    upload = _step(workflow, "actions/upload-artifact@")
    assert upload["with"]["path"] == "parity-report"
    assert summary["if"] == upload["if"] == "always()"  # also when the check fails
    order = [steps.index(s) for s in (checkout, project, harness, check, summary)]
    assert order == sorted(order) and steps.index(check) < steps.index(upload)
    for step in steps:
        if "run" in step:
            bash = subprocess.run(["bash", "-n"], input=step["run"], text=True, capture_output=True)
            assert bash.returncode == 0, (step, bash.stderr)


def test_base_install_and_python_are_the_users(repo: Path, capsys) -> None:
    install = "pip install git+https://example.com/llm-parity.git"
    workflow = _workflow(capsys, repo / "parity.toml", "--base", "origin/dev", "--install",
                         install, "--project-install", "pip install -e .[train]",
                         "--python", "3.12")  # fmt: skip
    check = _step(workflow, "parity check")
    assert "ref=origin/dev" in check["run"] and "env" not in check
    assert _step(workflow, install) and _step(workflow, "pip install -e .[train]")
    assert _step(workflow, "actions/setup-python@")["with"]["python-version"] == "3.12"
    bare = _workflow(capsys, repo / "parity.toml", "--install", "")
    assert not any("llm-parity" in s.get("run", "") for s in _steps(bare))


def test_the_spec_path_is_the_repositorys_wherever_parity_ci_runs(repo: Path, capsys) -> None:
    (repo / "conf").mkdir()
    shutil.copy(repo / "parity.toml", repo / "conf" / "job.toml")
    workflow = _workflow(capsys, repo / "conf" / "job.toml")  # an absolute path, cwd elsewhere
    assert "--spec conf/job.toml --out" in _step(workflow, "parity check")["run"]


def _run_steps(workflow: dict, clone: Path, env: dict, tmp_path: Path) -> tuple[list, str]:
    """The check step's and the summary step's `run` as GitHub runs them (bash -e), in ``clone``."""
    outputs = tmp_path / "github-output"
    env = {**env, "GITHUB_OUTPUT": str(outputs), "TARGET": "main"}
    codes = []
    for text in ("parity check", "GITHUB_STEP_SUMMARY"):
        done = subprocess.run(["bash", "-e", "-c", _step(workflow, text)["run"]], cwd=clone,
                              env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
        codes.append((done.returncode, done.stdout + done.stderr))
    return codes, outputs.read_text()


def test_the_workflows_check_runs_against_the_merge_base(
    repo: Path, shell_env: dict, tmp_path: Path, capsys
) -> None:
    """A clone as actions/checkout makes it (origin/main there), the check step run as written:
    aligned on the feature branch, diverged once it changes the loss; the exit code kept."""
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    git(clone, "checkout", "-q", "feature")
    workflow = _workflow(capsys, clone / "parity.toml")
    (check, summary), outputs = _run_steps(workflow, clone, shell_env, tmp_path)
    assert check[0] == 0 and summary[0] == 0, check[1] + summary[1]
    assert "exit-code=0" in outputs
    assert "aligned" in (clone / "parity-report" / "report.md").read_text()
    assert Path(shell_env["GITHUB_STEP_SUMMARY"]).read_text().strip()
    _commit(clone, "1.5", "a planted change of the loss")
    (clone / "parity-report").rename(tmp_path / "first-report")  # CI: a fresh checkout each time
    (check, summary), outputs = _run_steps(workflow, clone, shell_env, tmp_path)
    assert check[0] == 1 and summary[0] == 0, check[1] + summary[1]
    assert outputs.splitlines()[-1] == "exit-code=1"
    assert "diverged" in (clone / "parity-report" / "report.md").read_text()


# --- the script -----------------------------------------------------------------------------------


def _script(repo: Path, tmp_path: Path, capsys, *argv: str) -> Path:
    script = tmp_path / "parity-check.sh"
    script.write_text(_recipe(capsys, "--spec", str(repo / "parity.toml"), "--format", "script",
                              "--project-install", "echo the project installed",
                              "--install", "echo the harness installed", *argv))  # fmt: skip
    return script


def _bash(script: Path, repo: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_the_script_exits_0_aligned_1_diverged_and_keeps_every_report(
    repo: Path, shell_env: dict, tmp_path: Path, capsys
) -> None:
    script = _script(repo, tmp_path, capsys, "--base", "main")
    summary = Path(shell_env["GITHUB_STEP_SUMMARY"])
    done = _bash(script, repo, shell_env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the project installed" in done.stdout and "the harness installed" in done.stdout
    first = (repo / "parity-report" / "report.md").read_text()
    assert "aligned" in first and summary.read_text() == first
    # a second run in the same checkout: a fresh folder, said where; the first report kept
    done = _bash(script, repo, shell_env)
    assert done.returncode == 0, done.stdout + done.stderr
    (second,) = [p for p in (repo / "parity-report").iterdir() if (p / "report.md").is_file()]
    assert f"report in parity-report/{second.name}" in done.stdout
    assert (repo / "parity-report" / "report.md").read_text() == first
    _commit(repo, "1.5", "a planted change of the loss")
    done = _bash(script, repo, shell_env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "diverged" in summary.read_text().split(first)[-1]
    assert summary.read_text().count("# ") >= 3  # three reports appended, none replaced


def test_the_script_says_2_without_a_merge_base_and_3_when_the_install_fails(
    repo: Path, shell_env: dict, tmp_path: Path, capsys
) -> None:
    script = _script(repo, tmp_path, capsys)  # default base origin/main: no origin here
    done = _bash(script, repo, shell_env)
    assert done.returncode == 2 and "no merge base of origin/main" in done.stderr
    done = _bash(script, repo, shell_env, "no-such-branch")
    assert done.returncode == 2 and "no merge base of no-such-branch" in done.stderr
    failing = tmp_path / "failing.sh"
    text = _recipe(capsys, "--spec", str(repo / "parity.toml"), "--format", "script",
                   "--install", "false")  # fmt: skip
    failing.write_text(text.replace("pip install -e .", "true"))
    done = _bash(failing, repo, shell_env, "main")
    assert done.returncode == 3 and "the harness's install failed" in done.stderr
    assert not (repo / "parity-report").exists()


# --- the pytest recipe of docs/ci.md --------------------------------------------------------------


def test_the_pytest_recipe_a_golden_made_at_the_base(repo: Path, shell_env: dict) -> None:
    """docs/ci.md's pytest way: at the base, `pytest -m parity --parity-update-golden` writes the
    golden (committed) and checks the run against it; after a change `pytest -m parity` fails,
    naming the golden and the metric. (Two sessions: each job imports torch for the recorder.)"""
    pytest.importorskip("torch")
    git(repo, "checkout", "-q", "main")
    (repo / "job.py").write_text(RECORDED_JOB.format(factor="1.0"))
    (repo / "tests").mkdir()
    (repo / "tests" / "test_parity.py").write_text(PYTEST_RECIPE)
    (repo / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")

    def pytest_run(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "parity"]
        return subprocess.run([*argv, *args], cwd=repo, env=shell_env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip

    done = pytest_run("--parity-update-golden")
    assert done.returncode == 0, done.stdout[-3000:]
    (baseline,) = (repo / "fixtures" / "golden" / "my-job").iterdir()
    assert (baseline / "metrics.jsonl").is_file()
    commit(repo, "the parity test and its golden")
    (repo / "job.py").write_text(RECORDED_JOB.format(factor="1.5"))
    done = pytest_run()
    assert done.returncode == 1, done.stdout[-3000:]
    assert "fixtures/golden/my-job" in done.stdout and "train/loss" in done.stdout


# --- refusals ------------------------------------------------------------------------------------


def test_a_missing_or_wrong_spec_is_exit_2_in_one_line(tmp_path: Path, capsys) -> None:
    assert main(["ci", "--spec", str(tmp_path / "nope.toml")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "nope.toml" in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    pair = tmp_path / "pair.toml"
    pair.write_text(SPEC + '[b]\nenv = {X = "1"}\n')
    assert main(["ci", "--spec", str(pair)]) == 2
    assert "not an [a]/[b] pair" in capsys.readouterr().err
    typo = tmp_path / "typo.toml"
    typo.write_text(SPEC + "stpes = 3\n")
    assert main(["ci", "--spec", str(typo)]) == 2
    assert "stpes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["ci"])
    assert exc.value.code == 2


# --- ci/*.sh --help ------------------------------------------------------------------------------


def _listing(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.lstat().st_mtime_ns for p in root.rglob("*")}


@pytest.mark.parametrize("script", CI_SCRIPTS, ids=[p.name for p in CI_SCRIPTS])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_ci_script_answers_help_and_does_nothing_else(
    script: Path, flag: str, tmp_path: Path
) -> None:
    """In a copy of the project's ci/ (a venv or report made would land beside it), with pip,
    python and git on PATH replaced by stand-ins that log their calls: usage, exit 0, nothing."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "ci", project / "ci")
    calls = tmp_path / "calls.log"
    fakes = tmp_path / "fakes"
    fakes.mkdir()
    for tool in ("pip", "pip3", "python", "python3", "git", "apt-get", "parity"):
        (fakes / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "{calls}"\nexit 9\n')
        (fakes / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{fakes}{os.pathsep}/usr/bin{os.pathsep}/bin",
           "PYTHON": str(fakes / "python3"), "PARITY_PYTHON": str(fakes / "python3")}  # fmt: skip
    before = _listing(project)
    done = subprocess.run(["bash", str(project / "ci" / script.name), flag], cwd=project, env=env,
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"bash ci/{script.name}" in done.stdout and done.stderr == ""
    header = [line for line in script.read_text().splitlines()[1:]]
    first = header[0].removeprefix("# ")
    assert done.stdout.splitlines()[0] == first
    assert not any(line.startswith(("#", "set -")) for line in done.stdout.splitlines())
    assert _listing(project) == before
    assert not calls.exists(), calls.read_text()


def test_the_projects_parity_check_sh_runs_twice_into_fresh_folders(
    repo: Path, shell_env: dict, tmp_path: Path
) -> None:
    """ci/parity-check.sh in a repository of its own, its job the tiny one, its installs and
    pytest stood in for: the second run in the same checkout goes to a new folder in
    parity-report, says so, and leaves the first report as it was."""
    (repo / "ci").mkdir()
    shutil.copy(ROOT / "ci" / "parity-check.sh", repo / "ci")
    (repo / "ci" / "pair.toml").write_text(SPEC)
    python = tmp_path / "python"  # pip and pytest: done already; parity: this interpreter
    python.write_text(f'#!/bin/sh\ncase "$2" in pip|pytest) exit 0 ;; esac\n'
                      f'exec "{sys.executable}" "$@"\n')  # fmt: skip
    python.chmod(0o755)
    commit(repo, "the project's own CI")
    env = {**shell_env, "PYTHON": str(python)}
    first = _bash(repo / "ci" / "parity-check.sh", repo, env, "main")
    assert first.returncode == 0, first.stdout + first.stderr
    report = (repo / "parity-report" / "report.md").read_text()
    second = _bash(repo / "ci" / "parity-check.sh", repo, env, "main")
    assert second.returncode == 0, second.stdout + second.stderr
    (fresh,) = [p for p in (repo / "parity-report").iterdir() if (p / "report.md").is_file()]
    assert f"report in parity-report/{fresh.name}" in second.stdout
    assert (repo / "parity-report" / "report.md").read_text() == report
