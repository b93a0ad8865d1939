"""The world a job really ran in (parity.run.world, parity/rank/sitehook): a side whose ranks did
not form
one process group of the requested size, or formed one and never used it, is failed, never
judged; with the spec's [env] the same script forms its world and a 2-rank-only bug is caught."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.files import launch_dir
from parity.pair import run_pair
from parity.run.job import expect_world, run_job
from parity.run.launch import LaunchError, LaunchRequest, launch
from parity.run.world import HOOK_DIR, WORLD_DIR_ENV, judge, read_records
from parity.spec import JobSpec, PairSpec, SpecError, load_spec

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE_LOOP = str(ROOT / "tests" / "jobs" / "accelerate_loop.py")
PLAIN_RANKS = str(ROOT / "tests" / "jobs" / "plain_ranks.py")


def _records(folder: Path, *groups: dict | None) -> Path:
    """One record per rank process, as the hook writes them; None: never joined a group."""
    folder.mkdir(parents=True, exist_ok=True)
    for pid, group in enumerate(groups, 100):
        record = {"host": "h", "pid": pid, "env": {"RANK": str(pid - 100)}}
        record["joined"] = [] if group is None else [group]
        (folder / f"h-{pid}.json").write_text(json.dumps(record))
    return folder


def _group(rank: int, size: int = 2, collectives: int | None = 7) -> dict:
    group = {"backend": "gloo", "world_size": size, "rank": rank}
    return group if collectives is None else {**group, "collectives": collectives}


@pytest.mark.parametrize(
    "groups, expected",
    [
        ([_group(0), _group(1)], ""),
        ([_group(0), _group(1, collectives=None)], ""),  # one count above 0 shows the use
        ([_group(0, collectives=None), _group(1, collectives=None)], "none left a record of using"),
        ([_group(0, collectives=0), _group(1, collectives=None)], "1 rank(s) ended before their"),
        ([None, None], "2 processes launched, none joined a process group (each ran alone)"),
        ([_group(0), None], "2 processes launched, 1 never joined a process group"),
        ([_group(0, 1), _group(0, 1)], "joined process groups of size 1, not one group of 2"),
        ([_group(0), _group(0)], "ranks claimed twice: rank 0 claimed by 2 processes"),
        ([_group(0, collectives=0), _group(1, collectives=0)], "none sent anything through it"),
        ([_group(0, 4), _group(1, 4)], "joined process groups of size 4, not one group of 2"),
        ([], "no rank recorded the world it joined (expected 2)"),
    ],
)
def test_judge_names_what_formed_instead(tmp_path: Path, groups: list, expected: str) -> None:
    line = judge(_records(tmp_path / "world", *groups), 2)
    assert (expected in line) if expected else line == "", line
    assert "\n" not in line


def test_a_lone_process_group_of_one_claiming_rank_zero_twice(tmp_path: Path) -> None:
    line = judge(_records(tmp_path / "world", _group(0, 1), _group(0, 1)), 2)
    assert "rank 0 claimed by 2 processes" in line, line


def _python_with_hook(tmp_path: Path, code: str, extra: dict | None = None) -> dict:
    """Run ``code`` as a rank torchrun would start (LOCAL_RANK set), with the hook on the path;
    return the record it left."""
    world = tmp_path / "world"
    world.mkdir()
    env = {**os.environ, "LOCAL_RANK": "0", "RANK": "0", WORLD_DIR_ENV: str(world)}
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK_DIR), *(extra or {}).get("path", [])])
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    (record,) = [json.loads(p.read_text()) for p in world.glob("*.json")]
    return record


def _ranks_with_hook(tmp_path: Path, code: str, n: int = 2) -> list[subprocess.Popen]:
    """``code`` in ``n`` processes started as torchrun starts ranks, with the hook on the path;
    RANK is in their environment and ``STORE`` a file:// rendezvous for them."""
    world = tmp_path / "world"
    world.mkdir(exist_ok=True)
    head = f"STORE = 'file://{tmp_path}/store'\n"
    return [
        subprocess.Popen(
            [sys.executable, "-c", head + code],
            env={
                **os.environ,
                "LOCAL_RANK": str(r),
                "RANK": str(r),
                "WORLD_SIZE": str(n),
                WORLD_DIR_ENV: str(world),
                "PYTHONPATH": str(HOOK_DIR),
            },
        )  # fmt: skip
        for r in range(n)
    ]


def _joined(tmp_path: Path) -> list[list[dict]]:
    """Each rank record's groups, by rank."""
    records = [json.loads(p.read_text()) for p in (tmp_path / "world").glob("*.json")]
    return [r["joined"] for r in sorted(records, key=lambda r: r["env"]["RANK"])]


def test_the_hook_records_the_group_and_its_collectives(tmp_path: Path) -> None:
    """Every group of more than one rank counts (new_group's too), and a rank that ends with
    os._exit, skipping its exit handlers, still leaves its count."""
    pytest.importorskip("torch")  # its ranks form a gloo group
    code = (
        "import os, torch, torch.distributed as dist\n"
        "from torch.distributed import init_process_group\n"  # a name bound before the call
        "init_process_group('gloo', init_method=STORE, rank=int(os.environ['RANK']), "
        "world_size=2)\n"
        "g = dist.new_group([0, 1]); t = torch.ones(1)\n"
        "dist.all_reduce(t, group=g); dist.all_reduce(t, group=g); dist.barrier()\n"
        "os._exit(0)\n"
    )
    for proc in _ranks_with_hook(tmp_path, code):
        assert proc.wait(timeout=120) == 0
    group = {"backend": "gloo", "world_size": 2, "collectives": 3}
    assert _joined(tmp_path) == [[{**group, "rank": 0}], [{**group, "rank": 1}]]
    assert judge(tmp_path / "world", 2) == ""


def test_the_count_is_written_while_the_job_runs(tmp_path: Path) -> None:
    """The count is on file before the ranks end: ranks SIGKILLed after their collective (no
    exit handler, no os._exit) still read as a used group."""
    pytest.importorskip("torch")  # its ranks form a gloo group
    code = (
        "import os, time, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method=STORE, rank=int(os.environ['RANK']), "
        "world_size=2)\n"
        "dist.all_reduce(torch.ones(1)); time.sleep(120)\n"
    )
    procs = _ranks_with_hook(tmp_path, code)
    try:
        deadline = time.monotonic() + 60
        while [g[-1].get("collectives") if g else None for g in _joined(tmp_path)] != [1, 1]:
            assert time.monotonic() < deadline, _joined(tmp_path)
            assert all(p.poll() is None for p in procs)
            time.sleep(0.2)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert judge(tmp_path / "world", 2) == ""


def test_the_hook_runs_the_sitecustomize_it_shadows(tmp_path: Path) -> None:
    """A distribution's or a virtualenv's own sitecustomize still runs after ours."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = 'yes'\n")
    code = "import os, sys\nassert os.environ.get('THEIRS_RAN') == 'yes', 'not chained'\n"
    record = _python_with_hook(tmp_path, code, {"path": [str(theirs)]})
    assert record["joined"] == []  # no group: recorded as having run alone


def test_a_child_of_a_rank_is_not_a_rank(tmp_path: Path) -> None:
    """A process a rank starts (a DataLoader worker by spawn) inherits LOCAL_RANK; it must not
    count as one more rank."""
    code = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
    _python_with_hook(tmp_path, code)  # exactly one record, checked there


def _hooked(tmp_path: Path, env: dict[str, str]) -> list[dict]:
    """The records a bare Python process with ``env`` (on top of the launch's variables) left."""
    world = tmp_path / "world"
    world.mkdir(parents=True)
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    full = {**base, WORLD_DIR_ENV: str(world), "PYTHONPATH": str(HOOK_DIR), **env}
    subprocess.run([sys.executable, "-c", "pass"], env=full, check=True, timeout=60)
    return [json.loads(p.read_text()) for p in world.glob("*.json")]


def test_rank_and_world_size_set_before_start_make_a_rank_below_the_launch(
    tmp_path: Path,
) -> None:
    """What a Ray worker group's actor looks like (RANK and WORLD_SIZE from its runtime_env, no
    LOCAL_RANK, started below the plain job): a rank. The launch's first process (no launcher
    pid yet) with the same variables is not, nor is a process without WORLD_SIZE."""
    below = {"PARITY_LAUNCHER_PID": "1"}
    (record,) = _hooked(tmp_path / "ray", {**below, "RANK": "1", "WORLD_SIZE": "2"})
    assert record["env"] == {"RANK": "1", "LOCAL_RANK": None, "WORLD_SIZE": "2", "GROUP_RANK": None}
    assert _hooked(tmp_path / "first", {"RANK": "1", "WORLD_SIZE": "2"}) == []
    assert _hooked(tmp_path / "no-size", {**below, "RANK": "1"}) == []


def test_distributed_false_is_one_plain_process_of_its_own_ranks() -> None:
    """world_size N > 1 with distributed = false: one process that starts N ranks itself; the
    launcher starts one process per node, one node, and never through Slurm's torchrun."""
    spec = JobSpec(task="custom", command=["t.py"], distributed=False, world_size=2)
    assert (spec.world_size, spec.nproc_per_node, expect_world(spec)) == (2, 1, 2)
    assert expect_world(JobSpec(task="custom", command=["t.py"], distributed=False)) is None
    with pytest.raises(SpecError, match="distributed = false runs one plain process on one node"):
        JobSpec(task="custom", command=["t.py"], distributed=False, world_size=2, nnodes=2)
    with pytest.raises(SpecError, match="world_size 2 .* runs only with the local launcher"):
        JobSpec(command=["t.py"], distributed=False, world_size=2, launcher="slurm")


# --- a plain job's own ranks (distributed = false, world_size 2) -----------------------------


def _plain_ranks(*flags: str) -> JobSpec:
    command = [PLAIN_RANKS, "--out", "{out}", *flags]
    return JobSpec(command=command, distributed=False, world_size=2, timeout_s=120)


@pytest.mark.parity
def test_the_ranks_a_plain_job_starts_are_its_world(tmp_path: Path) -> None:
    """Two processes the job starts with RANK and WORLD_SIZE (as Ray starts verl's workers):
    recorded, one group of 2, used; the plain process itself is no rank."""
    run = run_job(_plain_ranks(), tmp_path / "run")
    assert run.launch.ok, run.launch.describe()
    records = read_records(launch_dir(tmp_path / "run") / "world")
    assert sorted(r.group["rank"] for r in records) == [0, 1]
    assert {(r.group["world_size"], r.group["collectives"] > 0) for r in records} == {(2, True)}
    assert {r.env["LOCAL_RANK"] for r in records} == {None}


@pytest.mark.parity
@pytest.mark.parametrize(
    "flag, fault",
    [
        ("--broken", "2 processes joined process groups of size 1, not one group of 2 "
                     "(rank 0 claimed by 2 processes)"),
        ("--replace-pythonpath", "no rank recorded the world it joined (expected 2)"),
    ],
)  # fmt: skip
def test_a_plain_job_whose_ranks_formed_no_group_of_2_is_failed(
    tmp_path: Path, flag: str, fault: str
) -> None:
    """Ranks given a world of one each, or started with PYTHONPATH replaced (the hook gone):
    the pair fails at side a with the judge's line, exit 3, its metrics never compared."""
    spec = tmp_path / "pair.toml"
    command = json.dumps([PLAIN_RANKS, "--out", "{out}", flag])
    spec.write_text(
        f'task = "custom"\ndistributed = false\nworld_size = 2\ntimeout_s = 120\n'
        f"command = {command}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "parity.cli", "pair", "--spec", str(spec), "--out",
         str(tmp_path / "pair")], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-3000:]
    assert f"parity: run failed: side a: {fault}" in done.stderr, done.stderr[-3000:]


# --- with torchrun ---------------------------------------------------------------------------


@pytest.mark.parity
def test_a_script_that_never_forms_its_group_is_failed(tmp_path: Path) -> None:
    """Two ranks of a script that never calls init_process_group: failed, with the line."""
    script = tmp_path / "alone.py"
    script.write_text("import sys; print('training alone', flush=True)\n")
    result = launch(LaunchRequest([str(script)], 2, tmp_path / "launch", expect_world=2))
    assert not result.ok and result.reason == "world"
    assert result.fault.startswith("2 processes launched, none joined a process group")
    assert result.describe().splitlines()[0].startswith(result.fault)


@pytest.mark.parity
def test_a_job_of_lone_rank_zeros_is_failed(tmp_path: Path) -> None:
    """Both processes form a group of their own and claim rank 0 there."""
    script = tmp_path / "zeros.py"
    script.write_text(
        "import os, torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/s' + "
        "os.environ['LOCAL_RANK'], rank=0, world_size=1)\n"
        "dist.barrier(); dist.destroy_process_group()\n"
    )
    result = launch(LaunchRequest([str(script)], 2, tmp_path / "launch", expect_world=2))
    assert result.reason == "world"
    assert "size 1, not one group of 2" in result.fault and "rank 0 claimed by 2" in result.fault


@pytest.mark.parity
@pytest.mark.parametrize(
    "body, fault",
    [
        # a group formed, nothing sent, and os._exit skipping the exit handlers: failed
        ("pass", "none sent anything through it"),
        # every collective through a sub-group of both ranks: that is a world
        ("dist.all_reduce(torch.ones(1), group=dist.new_group([0, 1]))\n"
         "dist.destroy_process_group()", ""),
    ],
)  # fmt: skip
def test_the_group_is_judged_by_what_went_through_any_of_its_groups(
    tmp_path: Path, body: str, fault: str
) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        f"{body}\n"
        "os._exit(0)\n"
    )
    result = launch(LaunchRequest([str(script)], 2, tmp_path / "launch", expect_world=2))
    assert result.returncode == 0, result.describe()
    assert (fault in result.fault) if fault else result.ok, result.describe()


SPEC = f"""\
task = "custom"
command = ["{ACCELERATE_LOOP}", "--out", "{{out}}"]
world_size = 2
timeout_s = 300

[b]
command = ["{ACCELERATE_LOOP}", "--out", "{{out}}", "--stretch-lr"]
"""


@pytest.mark.parity
def test_accelerate_without_its_cpu_switch_is_failed_and_with_it_the_bug_is_caught(
    tmp_path: Path,
) -> None:
    """HF accelerate on CPU without ACCELERATE_USE_CPU forms a group, then trains each process
    alone: the lr bug that needs 2 processes is invisible and the pair would read aligned. It is
    failed instead, naming side a; with the variable from the spec's [env], the same pair runs
    (the script refuses a non-empty output folder: the job's {out} is empty at start) and the
    bug is caught on train/lr."""
    spec_file = tmp_path / "pair.toml"
    spec_file.write_text(SPEC)
    pair = load_spec(spec_file)
    with pytest.raises(LaunchError) as info:
        run_pair(pair, tmp_path / "no-env")
    line = str(info.value).splitlines()[0]
    assert line.startswith("side a: 2 processes joined a process group of 2, but none sent")
    assert "ACCELERATE_USE_CPU=true" in line

    spec_file.write_text(SPEC.replace("[b]", '[env]\nACCELERATE_USE_CPU = "true"\n\n[b]'))
    pair = load_spec(spec_file)
    assert isinstance(pair, PairSpec) and pair.sides()[1].env == {"ACCELERATE_USE_CPU": "true"}
    result = run_pair(pair, tmp_path / "env")
    assert result.verdict == "diverged"
    lr = result.comparison.metrics["train/lr"]
    assert (lr.status, lr.first_divergent_step) == ("diverged", 1)
    head = (tmp_path / "env" / "a.launch" / "launcher.log").read_text().splitlines()[0]
    assert head.startswith("# ACCELERATE_USE_CPU=true ")


def test_a_world_of_one_needs_no_group(tmp_path: Path) -> None:
    assert judge(_records(tmp_path / "one", None), 1) == ""
    assert judge(_records(tmp_path / "one-group", _group(0, 1, collectives=0)), 1) == ""
    two = judge(_records(tmp_path / "two", None, None), 1)
    assert "2 processes started for a world of 1" in two
