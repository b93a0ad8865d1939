"""The run store (parity.store), `parity check`'s base and `parity bisect`'s runs reused from it.

The store alone first (no job runs): a run comes back whole or not at all, a changed, partial or
extra file makes it unused, the key moves with everything that decides a run's numbers, the
store stays within its size and refuses a folder of the user's, and commands adding and reading
one key at once leave one whole entry. Then `check` and `bisect` on the five-commit history (a
plain job without torch, under a second a launch): a second check of the same base runs only
the head, a diverging head runs the reused base again before the verdict, `--fresh` runs it
anyway; a stored run that was edited is not used; a stale one (whole, but with other numbers)
costs a run and never the verdict, in check and in bisect; two checks at once share one store.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

import parity.check
from parity.cli import main
from parity.spec import JobSpec
from parity.store import MARK, RunKey, RunStore, StoreError, run_key
from tests.orchestration.history import commit_of, make_repo

ROOT = Path(__file__).resolve().parents[2]


def _run(folder: Path, loss: float = 0.5) -> Path:
    """A small run folder: metrics with an end record, and a rank file in a subfolder."""
    (folder / "ranks").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "train/loss": loss}) + "\n" + '{"event": "end", "steps": 1}\n'
    )
    (folder / "ranks" / "rank0.jsonl").write_text('{"step": 1}\n')
    return folder


KEY = RunKey("k" * 32, {"tree": "t"})


def test_a_stored_run_comes_back_whole(tmp_path):
    store = RunStore(tmp_path / "store")
    assert store.get(KEY, tmp_path / "missing") is None and not (tmp_path / "missing").exists()
    assert store.put(KEY, _run(tmp_path / "run"), {"rev": "main", "commit": "c" * 40})
    assert not store.put(KEY, tmp_path / "run", {})  # stored already: kept as it is
    got = store.get(KEY, tmp_path / "copy")
    assert got is not None and got.dir == tmp_path / "copy"
    for name in ("metrics.jsonl", "ranks/rank0.jsonl"):
        assert (tmp_path / "copy" / name).read_bytes() == (tmp_path / "run" / name).read_bytes()
    assert got.line().startswith("reused run of main (cccccccccccc) from 20")
    assert json.loads((store.entry(KEY) / "key.json").read_text()) == {"tree": "t"}
    assert not list((store.root / "tmp").iterdir())


@pytest.mark.parametrize("damage", ["edited", "missing file", "extra file", "no stored.json"])
def test_a_stored_run_not_whole_is_never_used(tmp_path, capsys, damage):
    store = RunStore(tmp_path / "store")
    store.put(KEY, _run(tmp_path / "run"), {})
    entry = store.entry(KEY)
    if damage == "edited":
        (entry / "run" / "metrics.jsonl").write_text('{"step": 1, "train/loss": 0.25}\n')
    elif damage == "missing file":
        (entry / "run" / "ranks" / "rank0.jsonl").unlink()
    elif damage == "extra file":
        (entry / "run" / "ranks" / "rank1.jsonl").write_text("{}\n")
    else:  # a copy cut short before its last write
        (entry / "stored.json").unlink()
    (tmp_path / "dest").mkdir()  # the check's claimed, empty folder
    assert store.get(KEY, tmp_path / "dest") is None
    assert not any((tmp_path / "dest").iterdir())  # left as it was
    assert "not reusing the stored run" in capsys.readouterr().err
    assert not entry.exists()  # removed: the next run made is stored in its place


def _spec(**changes) -> JobSpec:
    data = {"task": "custom", "world_size": 1, "command": ["job.py", "--out", "{out}"]}
    return JobSpec.from_dict({**data, **changes})


def test_the_key_moves_with_what_decides_the_numbers():
    env = {"OMP_NUM_THREADS": "1", "HOME": "/root"}
    base = run_key(_spec(), "tree1", [{"path": "data.bin", "sha256": "a", "size": 1}], env)
    same = run_key(_spec(), "tree1", [{"path": "data.bin", "sha256": "a", "size": 9}], env)
    assert same.digest == base.digest
    moved = [
        run_key(_spec(), "tree2", [{"path": "data.bin", "sha256": "a"}], env),  # the code
        run_key(_spec(), "tree1", [{"path": "data.bin", "sha256": "b"}], env),  # carried input
        run_key(_spec(), "tree1", [], env),
        run_key(_spec(world_size=2), "tree1", [{"path": "data.bin", "sha256": "a"}], env),
        run_key(_spec(seed=7), "tree1", [{"path": "data.bin", "sha256": "a"}], env),
        run_key(
            _spec(), "tree1", [{"path": "data.bin", "sha256": "a"}], {**env, "OMP_NUM_THREADS": "2"}
        ),  # fmt: skip
        run_key(
            _spec(),
            "tree1",
            [{"path": "data.bin", "sha256": "a"}],
            {**env, "PYTHONPATH": "/elsewhere"},
        ),  # fmt: skip
    ]
    assert len({base.digest, *(k.digest for k in moved)}) == 1 + len(moved)
    unrelated = {**env, "HOME": "/home/u", "PARITY_STORE": "/x", "TERM": "xterm"}
    assert run_key(_spec(), "tree1", [{"path": "data.bin", "sha256": "a"}], unrelated) == base
    facts = base.facts["environment"]
    assert facts["variables"] == {"OMP_NUM_THREADS": "1"} and facts["packages"]
    assert facts["python"] == sys.version and facts["cpu_isa"] is not None


def test_the_code_no_version_pins_is_in_the_key(tmp_path):
    """A folder on PYTHONPATH (or an editable install's source) is code no distribution's
    version pins: its Python files' content moves the key (a library edited in place), their
    times alone do not (a fresh clone of the same code), and neither do its other files."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "kernel.py").write_text("def f(x):\n    return x * 2\n")
    env = {"PYTHONPATH": str(lib)}
    before = run_key(_spec(), "tree1", [], env)
    assert before.facts["environment"]["code"][str(lib)].startswith("1 files ")
    os.utime(lib / "kernel.py", (1, 1))
    (lib / "notes.txt").write_text("not code\n")
    (lib / "__pycache__").mkdir()
    (lib / "__pycache__" / "kernel.cpython-311.pyc").write_bytes(b"\0")
    assert run_key(_spec(), "tree1", [], env) == before
    (lib / "kernel.py").write_text("def f(x):\n    return x + x\n")
    assert run_key(_spec(), "tree1", [], env) != before
    # a folder inside another is read with it, unless the walk skips what lies between
    for inner in (lib / "sub", lib / ".hidden" / "src"):
        inner.mkdir(parents=True)
        nested = {"PYTHONPATH": f"{lib}{os.pathsep}{inner}"}
        code = run_key(_spec(), "tree1", [], nested).facts["environment"]["code"]
        ours = [f for f in code if f.startswith(str(tmp_path))]  # not the installs' own
        assert ours == [str(lib), *([str(inner)] if inner.parent.name == ".hidden" else [])]
    for name, value in (("LD_PRELOAD", "/opt/libfast.so"), ("DNNL_MAX_CPU_ISA", "AVX2")):
        assert run_key(_spec(), "tree1", [], {**env, name: value}) != run_key(
            _spec(), "tree1", [], env
        ), name


def test_the_checked_repository_s_own_code_and_a_folder_too_big_to_read(tmp_path, monkeypatch):
    """The project's own checkout (on PYTHONPATH, or an editable install of it) is keyed by the
    revision's tree, never by its working files: a pull request's edits must not move main's
    key. A code folder past what the key reads makes a run neither stored nor reused."""
    import parity.store

    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "mine.py").write_text("x = 1\n")
    env = {"PYTHONPATH": str(repo / "src")}
    key = run_key(_spec(), "tree1", [], env, repo=repo)
    assert str(repo / "src") not in key.facts["environment"]["code"] and key.reusable
    (repo / "src" / "mine.py").write_text("x = 2\n")
    assert run_key(_spec(), "tree1", [], env, repo=repo) == key
    monkeypatch.setattr(parity.store, "MAX_CODE_FILES", 0)
    big = run_key(_spec(), "tree1", [], env)
    assert big.facts["environment"]["code"][str(repo / "src")] is None and not big.reusable
    store = RunStore(tmp_path / "store")
    assert store.put(big, _run(tmp_path / "run"), {}) is False
    assert store.get(big, tmp_path / "dest") is None


def test_the_store_keeps_within_its_size_least_recently_used_first(tmp_path):
    keys = [RunKey(f"{n}" * 32, {}) for n in range(3)]
    RunStore(tmp_path / "store").put(keys[0], _run(tmp_path / "run0"), {})
    one = sum(p.stat().st_size for p in (tmp_path / "store" / "runs").rglob("*") if p.is_file())
    store = RunStore(tmp_path / "store", max_bytes=int(2.5 * one))  # room for two runs
    os.utime(store.entry(keys[0]) / "stored.json", (1000, 1000))
    store.put(keys[1], _run(tmp_path / "run1"), {})
    os.utime(store.entry(keys[1]) / "stored.json", (1001, 1001))
    assert store.get(keys[0], tmp_path / "read0")  # read: now the most recently used
    store.put(keys[2], _run(tmp_path / "run2"), {})
    assert [store.entry(k).exists() for k in keys] == [True, False, True]


def test_a_folder_of_the_user_s_is_refused_and_left_alone(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(StoreError, match="not a parity run store"):
        RunStore(tmp_path / "mine")
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="not a folder"):
        RunStore(tmp_path / "file")
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]
    RunStore(tmp_path / "empty")
    assert (tmp_path / "empty" / MARK).is_file() and RunStore(tmp_path / "empty")


def _put_and_get(root: str, run: str, dest: str, n: int) -> str:
    store = RunStore(Path(root))
    if n % 2:
        return "put" if store.put(KEY, Path(run), {"n": n}) else "kept"
    got = store.get(KEY, Path(dest) / str(n))
    if got is None:
        return "none"
    text = (got.dir / "metrics.jsonl").read_text()
    return "whole" if text == (Path(run) / "metrics.jsonl").read_text() else "torn"


def test_commands_adding_and_reading_one_key_at_once_leave_one_whole_run(tmp_path):
    run = _run(tmp_path / "run")
    (run / "big.bin").write_bytes(os.urandom(4 << 20))  # a copy long enough to overlap
    (tmp_path / "dest").mkdir()
    args = [(str(tmp_path / "store"), str(run), str(tmp_path / "dest"), n) for n in range(8)]
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        outcomes = pool.starmap(_put_and_get, args)
    assert "torn" not in outcomes and outcomes.count("put") == 1, outcomes
    store = RunStore(tmp_path / "store")
    assert [p.name for p in (store.root / "runs").iterdir()] == [KEY.digest]
    assert not list((store.root / "tmp").iterdir())
    assert store.get(KEY, tmp_path / "last") is not None


# --- parity check with a store -------------------------------------------------------------------


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> Path:
    """The five-commit history, its job run as one plain process (no torchrun to start: the
    launchers' own tests start that)."""
    root = make_repo(tmp_path_factory.mktemp("history"))
    spec = (root / "spec.toml").read_text()
    (root / "spec.toml").write_text(spec.replace("world_size = 1\n", "distributed = false\n"))
    assert "distributed = false" in (root / "spec.toml").read_text()
    return root


class Launches:
    """The check's launches, counted by the revision each ran in (its worktree's commit)."""

    def __init__(self, monkeypatch):
        self.runs: list[str] = []
        real = parity.check.launch_spec

        def counted(spec, run_dir, label, **kw):
            self.runs.append(Path(run_dir).name)
            return real(spec, run_dir, label, **kw)

        monkeypatch.setattr(parity.check, "launch_spec", counted)


@pytest.fixture
def launches(history, monkeypatch) -> Launches:
    """The launches counted, from the history's checkout."""
    monkeypatch.chdir(history)
    return Launches(monkeypatch)


def _check(history, out, store, capsys, base=1, head=2, *more) -> tuple[int, dict, str]:
    args = ["check", "--base", commit_of(history, base), "--head", commit_of(history, head)]
    args += ["--spec", str(history / "spec.toml"), "--out", str(out), "--store", str(store)]
    code = main([*args, "--json", "--no-trace", *more])
    captured = capsys.readouterr()
    return code, json.loads(captured.out.strip().splitlines()[-1]), captured.err


@pytest.mark.parity
def test_a_second_check_of_the_same_base_runs_only_the_head_unless_they_disagree(
    history, tmp_path, launches, capsys
):
    store = tmp_path / "store"
    code, first, _ = _check(history, tmp_path / "one", store, capsys)
    assert code == 0 and launches.runs == ["base", "head"]
    assert "reused" not in first["base"]
    code, second, err = _check(history, tmp_path / "two", store, capsys)
    assert code == 0 and second["verdict"] == "aligned"
    assert launches.runs == ["base", "head", "head"]  # the base came from the store
    reused = second["base"]["reused"]
    assert reused["line"].startswith(f"reused run of {commit_of(history, 1)}")
    assert reused["run_again"] is None and reused["stale"] is False
    assert "parity: base: reused run of" in err
    assert (tmp_path / "two" / "base" / "metrics.jsonl").read_bytes() == (
        tmp_path / "one" / "base" / "metrics.jsonl"
    ).read_bytes()
    assert "base: reused run of" in (tmp_path / "two" / "report.md").read_text()
    # a head that diverges from the reused base: the base runs again before the verdict
    code, diverging, _ = _check(history, tmp_path / "three", store, capsys, 1, 3)
    assert code == 1 and diverging["verdict"] == "diverged"
    assert diverging["metrics"]["train/loss"]["first_divergent_step"] == 4
    assert launches.runs[3:] == ["head", "base-fresh"]
    reused = diverging["base"]["reused"]
    assert reused["run_again"].startswith("the reused base and the head: diverged")
    assert reused["stale"] is False  # the stored base was right: the change is the head's
    # --fresh: the base runs again, whatever is stored
    code, fresh, _ = _check(history, tmp_path / "four", store, capsys, 1, 2, "--fresh")
    assert code == 0 and launches.runs[5:] == ["base", "head"] and "reused" not in fresh["base"]


def _commit_beside(repo: Path, parent: str, files: dict[str, str], message: str) -> str:
    """A commit of ``parent``'s tree with ``files`` in it, on no branch: the working tree, the
    index and HEAD stay as they are (the history's user is mid-bisection)."""
    env = {**os.environ, "GIT_INDEX_FILE": str(repo.parent / f"{repo.name}.index")}

    def git(*args: str, stdin: str | None = None) -> str:
        user = ["-c", "user.name=t", "-c", "user.email=t@example.com"]
        done = subprocess.run(["git", "-C", str(repo), *user, *args], input=stdin, env=env,
                              check=True, capture_output=True, text=True)  # fmt: skip
        return done.stdout.strip()

    git("read-tree", parent)
    for name, text in files.items():
        blob = git("hash-object", "-w", "--stdin", stdin=text)
        git("update-index", "--add", "--cacheinfo", f"100644,{blob},{name}")
    return git("commit-tree", git("write-tree"), "-p", parent, "-m", message)


@pytest.mark.parity
def test_a_base_that_finished_is_stored_even_where_the_head_then_fails(
    history, tmp_path, launches, capsys
):
    """The head fails (its job exits 3): the check fails, and the base that ran and finished is
    in the store all the same, so the next check of that base runs only its head."""
    crash = _commit_beside(history, commit_of(history, 2), {"job.py": "raise SystemExit(3)\n"},
                           "a head whose job fails")  # fmt: skip
    store = tmp_path / "store"
    args = ["check", "--base", commit_of(history, 1), "--head", crash, "--no-trace",
            "--spec", str(history / "spec.toml"), "--out", str(tmp_path / "one"),
            "--store", str(store)]  # fmt: skip
    assert main(args) == 3 and launches.runs == ["base", "head"]
    capsys.readouterr()
    code, second, _ = _check(history, tmp_path / "two", store, capsys)
    assert code == 0 and launches.runs[2:] == ["head"], launches.runs
    assert second["base"]["reused"]["line"].startswith(f"reused run of {commit_of(history, 1)}")


def _stored_metrics(store: Path, commit: str) -> Path:
    """The metrics file of ``commit``'s run in the store."""
    for key in os.listdir(store / "runs"):
        if json.loads((store / "runs" / key / "stored.json").read_text())["rev"] == commit:
            return store / "runs" / key / "run" / "metrics.jsonl"
    raise AssertionError(f"no stored run of {commit}")


def _nudged(metrics: Path) -> str:
    """The text of ``metrics`` with train/loss one ULP up at step 4 (where the spec's policy is
    exact)."""
    text = metrics.read_text()
    nudged = text.replace('"train/loss": 0.25,', '"train/loss": 0.25000000000000006,')
    assert nudged != text
    return nudged


def _make_stale(metrics: Path) -> None:
    """A stored run whole (its checksums agree) but with other numbers than its key gives."""
    nudged = _nudged(metrics)
    metrics.write_text(nudged)
    meta = json.loads((metrics.parents[1] / "stored.json").read_text())
    meta["files"]["metrics.jsonl"] = [len(nudged), hashlib.sha256(nudged.encode()).hexdigest()]
    (metrics.parents[1] / "stored.json").write_text(json.dumps(meta))


@pytest.mark.parity
def test_a_stale_or_edited_stored_base_never_decides_the_verdict(
    history, tmp_path, launches, capsys
):
    store = tmp_path / "store"
    _check(history, tmp_path / "one", store, capsys)
    stored = _stored_metrics(store, commit_of(history, 1))
    clean = stored.read_text()
    # edited in place: its checksum no longer matches, so it is not used at all
    stored.write_text(_nudged(stored))
    launches.runs.clear()
    code, edited, err = _check(history, tmp_path / "two", store, capsys)
    assert code == 0 and launches.runs == ["base", "head"] and "reused" not in edited["base"]
    assert "metrics.jsonl: changed since it was stored (checksum)" in err
    assert stored.read_text() == clean  # the run made in its place
    # stale: whole (its checksums agree), but not what this base gives: the base runs again,
    # the verdict is the fresh run's, and the stale run is replaced by it
    _make_stale(stored)
    launches.runs.clear()
    code, stale, err = _check(history, tmp_path / "three", store, capsys)
    assert launches.runs == ["head", "base-fresh"]
    assert code == 0 and stale["verdict"] == "aligned", stale
    assert stale["base"]["reused"]["stale"] is True and "running the base again" in err
    assert stale["a"]["dir"] == str(tmp_path / "three" / "base-fresh")
    assert stored.read_text() == clean  # the fresh run took its place
    notes = (tmp_path / "three" / "report.md").read_text()
    assert "stale, removed from the store" in notes


@pytest.mark.parity
def test_fresh_runs_replace_what_was_stored(history, tmp_path, launches, capsys):
    """A stored base that is stale where the head agrees with it cannot be told from the head
    (the key missed a cause): `--fresh` runs it again, and its run replaces the stored one, so
    the next check reuses the fresh run, not the stale one."""
    store = tmp_path / "store"
    _check(history, tmp_path / "one", store, capsys)
    stored = _stored_metrics(store, commit_of(history, 1))
    clean = stored.read_text()
    _make_stale(stored)
    launches.runs.clear()
    code, fresh, _ = _check(history, tmp_path / "two", store, capsys, 1, 2, "--fresh")
    assert code == 0 and launches.runs == ["base", "head"] and "reused" not in fresh["base"]
    stored = _stored_metrics(store, commit_of(history, 1))
    assert stored.read_text() == clean  # the fresh run took the stale one's place
    launches.runs.clear()
    code, again, _ = _check(history, tmp_path / "three", store, capsys)
    assert code == 0 and launches.runs == ["head"] and again["base"]["reused"]["stale"] is False


@pytest.mark.parity
def test_two_checks_at_once_share_one_store(history, tmp_path):
    env = {**os.environ, "PARITY_STORE": str(tmp_path / "store")}
    base, head = commit_of(history, 1), commit_of(history, 2)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "parity.cli",
                "check",
                "--base",
                base,
                "--head",
                head,
                "--spec",
                str(history / "spec.toml"),
                "--out",
                str(tmp_path / f"out{n}"),
                "--json",
                "--no-trace",
            ],
            cwd=history,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for n in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1])["verdict"] == "aligned"
    runs = sorted(os.listdir(tmp_path / "store" / "runs"))
    assert len(runs) == 2 and not os.listdir(tmp_path / "store" / "tmp")
    for key in runs:  # each whole: the next check reads it
        assert RunStore(tmp_path / "store").get(RunKey(key, {}), tmp_path / key) is not None


def _bisect(history, out, store, capsys, *more: str) -> tuple[int, dict]:
    args = ["bisect", "--good", commit_of(history, 1), "--bad", commit_of(history, 5)]
    args += ["--spec", str(history / "spec.toml"), "--out", str(out), "--store", str(store)]
    code = main([*args, "--json", *more])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parity
def test_bisect_reuses_its_runs_and_a_stale_one_costs_runs_not_the_answer(
    history, tmp_path, launches, capsys
):
    store = tmp_path / "store"
    third, second = commit_of(history, 3), commit_of(history, 2)
    code, first = _bisect(history, tmp_path / "one", store, capsys)
    assert code == 1 and first["first_bad"]["commit"] == third
    ran = len(launches.runs)  # the good run, bad, then the commits git picked
    assert ran >= 3 and not first["reference"]["reused"]
    assert not any(t["reused"] for t in first["tested"])
    # the second commit's stored run made stale: whole, but diverging where it does not
    _make_stale(_stored_metrics(store, second))
    code, again = _bisect(history, tmp_path / "two", store, capsys)
    assert code == 1 and again["first_bad"]["commit"] == third  # not the stale second
    assert again["first_bad"]["reused"] is False  # the answer rests on fresh runs
    assert again["reference"]["reused"] and again["reference"]["confirmed"]
    # run again: the good run (never confirmed by a fresh aligned run), the stale second
    # commit (named first bad by its stored run), the third (then named, from a reused run)
    fresh = launches.runs[ran:]
    assert fresh == ["good-fresh", f"{second[:12]}-fresh", f"{third[:12]}-fresh"], fresh
    assert len(fresh) < ran
    # --fresh: every commit run again, each run taking its stored one's place
    _make_stale(_stored_metrics(store, commit_of(history, 1)))
    code, fresh_all = _bisect(history, tmp_path / "three", store, capsys, "--fresh")
    assert code == 1 and fresh_all["first_bad"]["commit"] == third
    assert not fresh_all["reference"]["reused"]
    stored = _stored_metrics(store, commit_of(history, 1))
    assert stored.read_text() == (tmp_path / "three" / "good" / "metrics.jsonl").read_text()
