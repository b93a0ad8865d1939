"""MLflow's stores as MLflow writes them: runs logged with the real `mlflow` (mlflow-skinny, with
sqlalchemy and alembic for the SQLite store) into a file store and an SQLite store, then read
back without MLflow, bit for bit, with NaN and +-inf as each store keeps them."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.readers import MetricsError, detect, read_metrics, read_summary, skipped_count
from parity.readers.frame import ReadLog
from parity.readers.mlflow import (
    BAD_ROW,
    CUT_OFF,
    NEGATIVE,
    UNPARSED,
    metric_file,
    parse_metric_lines,
)

HAS_MLFLOW = all(importlib.util.find_spec(m) for m in ("mlflow", "sqlalchemy", "alembic"))
needs_mlflow = pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow-skinny, sqlalchemy, alembic")
DBL_MAX = 1.7976931348623157e308
SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 5e-324, DBL_MAX, 2.0**-1074 * 3]

# Runs two stores of each kind: "one" (a single live run, beside a deleted run and a deleted
# experiment) and "many" (several runs: two named alike, one logging a step twice, one failed).
WRITER = r"""
import json, os, shutil, sys
import mlflow
from mlflow import MlflowClient

out, plan, cached = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
loss = [float.fromhex(h) for h in plan["loss"]]
special = [float.fromhex(h) for h in plan["special"]]
ids = {}

def one(uri, kind):
    mlflow.set_tracking_uri(uri)
    exp = mlflow.create_experiment("exp1")
    with mlflow.start_run(experiment_id=exp, run_name="alpha") as run:
        for step, v in enumerate(loss):
            mlflow.log_metric("loss", v, step=step)
            if step % 2 == 0:
                mlflow.log_metric("train/grad_norm", 1.0 / (step + 3), step=step)
        for step, v in enumerate(special):
            mlflow.log_metric("special", v, step=step)
        mlflow.log_metric("big_step", 7, step=2**40)
    ids[kind + "/alpha"] = run.info.run_id
    with mlflow.start_run(experiment_id=exp, run_name="gone") as run:
        mlflow.log_metric("loss", 1.0, step=0)
    MlflowClient().delete_run(run.info.run_id)
    ids[kind + "/gone"] = run.info.run_id
    dropped = mlflow.create_experiment("dropped")
    with mlflow.start_run(experiment_id=dropped, run_name="lost"):
        mlflow.log_metric("loss", 2.0, step=0)
    MlflowClient().delete_experiment(dropped)

def many(uri, kind):
    mlflow.set_tracking_uri(uri)
    for name in ("first", "twin", "twin"):
        with mlflow.start_run(run_name=name) as run:
            mlflow.log_metric("loss", 0.5, step=0)
        ids.setdefault(kind + "/" + name, []).append(run.info.run_id)
    with mlflow.start_run(run_name="restart") as run:
        client = MlflowClient()
        for step in range(3):
            client.log_metric(run.info.run_id, "loss", 1.0 + step, timestamp=1000 + step, step=step)
            client.log_metric(run.info.run_id, "lr", 0.1, timestamp=1000 + step, step=step)
        # restarted from step 1: loss differs, lr is logged again with the same value
        client.log_metric(run.info.run_id, "loss", 9.0, timestamp=2000, step=1)
        client.log_metric(run.info.run_id, "lr", 0.1, timestamp=2001, step=1)
    ids[kind + "/restart"] = run.info.run_id
    with mlflow.start_run(run_name="crashed") as run:
        mlflow.log_metric("loss", 3.0, step=0)
        mlflow.end_run(status="FAILED")
    ids[kind + "/crashed"] = run.info.run_id

one(f"file:{out}/fs_one/mlruns", "fs")
many(f"file:{out}/fs_many/mlruns", "fs")
# MLflow builds a new database by running its ~100 migrations (seconds): build one (or take the
# one an earlier run of these tests built with this MLflow), copy it
if cached and os.path.isfile(cached):
    shutil.copy(cached, f"{out}/sql_one/mlflow.db")
mlflow.set_tracking_uri(f"sqlite:///{out}/sql_one/mlflow.db")
MlflowClient().search_experiments()
shutil.copy(f"{out}/sql_one/mlflow.db", f"{out}/sql_many/mlflow.db")
if cached and not os.path.isfile(cached):
    shutil.copy(f"{out}/sql_one/mlflow.db", cached + ".tmp")
    os.replace(cached + ".tmp", cached)
one(f"sqlite:///{out}/sql_one/mlflow.db", "sql")
many(f"sqlite:///{out}/sql_many/mlflow.db", "sql")
print(json.dumps(ids))
"""


def _bits(values) -> list[int]:
    return [struct.unpack("<q", struct.pack("<d", v))[0] for v in values]


def _empty_db_cache(config: pytest.Config) -> str:
    """Where pytest's cache keeps the empty database this MLflow and SQLAlchemy build ("" when
    the cache is off)."""
    cache = getattr(config, "cache", None)
    if cache is None:
        return ""
    from importlib.metadata import PackageNotFoundError, version

    try:
        mlflow = version("mlflow")
    except PackageNotFoundError:
        mlflow = version("mlflow-skinny")
    name = f"mlflow-{mlflow}-sqlalchemy-{version('sqlalchemy')}-alembic-{version('alembic')}.db"
    return str(cache.mkdir("mlflow-empty-db") / name)


@pytest.fixture(scope="module")
def stores(tmp_path_factory, pytestconfig):
    """The four stores (written once, in a subprocess) and what was logged into them."""
    if not HAS_MLFLOW:
        pytest.skip("mlflow-skinny, sqlalchemy and alembic are not installed")
    out = tmp_path_factory.mktemp("mlflow")
    for sub in ("fs_one", "fs_many", "sql_one", "sql_many"):
        (out / sub).mkdir()
    rng = np.random.default_rng(7)
    loss = rng.integers(-(2**63), 2**63 - 1, 40, dtype=np.int64).view(np.float64)  # any bits
    loss = np.where(np.isfinite(loss), loss, 0.5)
    loss[:4] = [0.1, 1 / 3, float(np.float32(0.1)), 2.5e-310]
    plan = {"loss": [float(v).hex() for v in loss], "special": [v.hex() for v in SPECIAL]}
    env = dict(os.environ, MLFLOW_ALLOW_FILE_STORE="true", MLFLOW_DISABLE_TELEMETRY="true")
    env.update(DO_NOT_TRACK="true", GIT_PYTHON_REFRESH="quiet")
    done = subprocess.run(
        [sys.executable, "-c", WRITER, str(out), json.dumps(plan), _empty_db_cache(pytestconfig)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=out,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ids = json.loads(done.stdout.strip().splitlines()[-1])
    return {"root": out, "ids": ids, "loss": [float(v) for v in loss]}


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@needs_mlflow
def test_file_store_bit_exact(stores):
    root, ids = stores["root"], stores["ids"]
    frame = read_metrics(root / "fs_one" / "mlruns")  # the deleted run and experiment: no runs
    assert list(frame.columns) == ["big_step", "loss", "special", "train/grad_norm"]
    assert _bits(frame["loss"].iloc[:40]) == _bits(stores["loss"])
    assert _bits(frame["special"].iloc[: len(SPECIAL)]) == _bits(SPECIAL)  # NaN: canonical
    assert frame.loc[2**40, "big_step"] == 7.0
    present = frame.attrs["present"]
    assert present["train/grad_norm"].iloc[:40].tolist() == [i % 2 == 0 for i in range(40)]
    assert present.loc[0, "special"] and math.isnan(frame.loc[0, "special"])  # logged NaN
    assert frame.attrs["format"] == "mlflow" and frame.attrs["complete"] is True
    assert set(frame.attrs["precision"].values()) == {"float64"}
    assert frame.attrs["source"].endswith(ids["fs/alpha"]) and skipped_count(frame) == 0
    assert any("'alpha'" in n and ids["fs/alpha"] in n for n in frame.attrs["notes"])


@needs_mlflow
def test_sqlite_store_nan_inf_and_read_only(stores):
    root = stores["root"]
    db = root / "sql_one" / "mlflow.db"
    before = _files(root / "sql_one")
    frame = read_metrics(db)
    assert _files(root / "sql_one") == before  # no -wal/-shm/-journal, nothing touched
    assert _bits(frame["loss"].iloc[:40]) == _bits(stores["loss"])
    # MLflow's SQL store: NaN via is_nan, +-inf clamped to +-DBL_MAX, -0.0 stored as 0
    want = [math.nan, DBL_MAX, -DBL_MAX, 0.0, 5e-324, DBL_MAX, SPECIAL[-1]]
    assert _bits(frame["special"].iloc[: len(SPECIAL)]) == _bits(want)
    assert any("1.7976931348623157e308" in n for n in frame.attrs["notes"])
    assert frame.attrs["complete"] is True and frame.attrs["source"] == str(db)
    # the stores agree wherever SQLite can hold the value
    files = read_metrics(root / "fs_one")
    assert _bits(files["loss"]) == _bits(frame["loss"])
    assert _bits(files["train/grad_norm"].dropna()) == _bits(frame["train/grad_norm"].dropna())


@needs_mlflow
def test_sqlite_wal_mode_read_creates_nothing(stores, tmp_path):
    db = tmp_path / "mlflow.db"
    shutil.copy(stores["root"] / "sql_one" / "mlflow.db", db)
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA journal_mode=wal").fetchone()[0] == "wal"
    con.close()
    before = _files(tmp_path)
    assert _bits(read_metrics(tmp_path)["loss"].iloc[:40]) == _bits(stores["loss"])
    assert _files(tmp_path) == before


@needs_mlflow
def test_detection(stores, tmp_path):
    root, ids = stores["root"], stores["ids"]
    run_dir = next((root / "fs_one" / "mlruns").glob(f"*/{ids['fs/alpha']}"))
    renamed = tmp_path / "tracking.sqlite"
    shutil.copy(root / "sql_one" / "mlflow.db", renamed)
    for path in [
        root / "fs_one",  # holds mlruns/
        root / "fs_one" / "mlruns",
        run_dir.parent,  # the experiment
        run_dir,
        root / "sql_one",  # holds mlflow.db
        root / "sql_one" / "mlflow.db",
        renamed,  # by the schema in its first pages
    ]:
        assert detect(path).name == "mlflow", path
        assert read_metrics(path).loc[0, "loss"] == stores["loss"][0]
    tracking = tmp_path / "tracking"  # a root not named mlruns: its .trash and experiments
    shutil.copytree(root / "fs_one" / "mlruns", tracking)
    assert detect(tracking).name == "mlflow"
    both = tmp_path / "both"  # mlruns/ and mlflow.db side by side: every run, named by store
    shutil.copytree(root / "fs_one", both)
    shutil.copy(root / "sql_one" / "mlflow.db", both / "mlflow.db")
    with pytest.raises(MetricsError, match="holds 2 MLflow runs") as err:
        read_metrics(both)
    assert "in mlruns)" in str(err.value) and "in mlflow.db)" in str(err.value)
    assert read_metrics(both, run=ids["sql/alpha"]).attrs["source"] == str(both / "mlflow.db")
    not_mlflow = tmp_path / "other.db"
    sqlite3.connect(not_mlflow).execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(MetricsError, match="unknown format"):
        read_metrics(not_mlflow)
    named = tmp_path / "x" / "mlflow.db"
    named.parent.mkdir()
    shutil.copy(not_mlflow, named)
    with pytest.raises(MetricsError, match=r"mlflow\.db: an SQLite database but no MLflow store"):
        read_metrics(named)


@needs_mlflow
@pytest.mark.parametrize("store", ["fs_many", "sql_many"])
def test_several_runs_named_and_chosen(stores, store):
    path, kind = stores["root"] / store, store.split("_")[0]
    ids = {k.split("/")[1]: v for k, v in stores["ids"].items() if k.startswith(kind + "/")}
    with pytest.raises(MetricsError) as err:
        read_metrics(path)
    msg = str(err.value)
    assert "\n" not in msg and "holds 5 MLflow runs" in msg and "--run" in msg
    for name in ("first", "restart", "crashed"):
        run_id = ids[name][0] if isinstance(ids[name], list) else ids[name]
        assert f"'{name}' (id {run_id}, experiment 'Default')" in msg
    first = ids["first"][0]
    for want in (first, first[:10], "first"):
        frame = read_metrics(path, run=want)
        assert frame.loc[0, "loss"] == 0.5 and first in frame.attrs["notes"][0]
    with pytest.raises(MetricsError, match="matches 2 runs") as err:
        read_metrics(path, run="twin")
    assert all(i in str(err.value) for i in ids["twin"])
    assert read_metrics(path, run=ids["twin"][1]).loc[0, "loss"] == 0.5
    with pytest.raises(MetricsError, match="no MLflow run matches --run 'nope'"):
        read_metrics(path, run="nope")
    crashed = read_metrics(path, run="crashed")
    assert crashed.attrs["complete"] is False
    assert any("status FAILED" in n for n in crashed.attrs["notes"])


@needs_mlflow
@pytest.mark.parametrize("store", ["fs_many", "sql_many"])
def test_step_logged_twice(stores, store):
    path = stores["root"] / store
    with pytest.raises(MetricsError, match=r":metrics[/ ].*step 1: 'loss' ") as err:
        read_metrics(path, run="restart")
    msg = str(err.value)
    assert "\n" not in msg and "--duplicates" in msg and "9.0" in msg
    first = read_metrics(path, run="restart", duplicates="first")
    last = read_metrics(path, run="restart", duplicates="last")
    assert first["loss"].tolist() == [1.0, 2.0, 3.0] and last["loss"].tolist() == [1.0, 9.0, 3.0]
    assert first["lr"].tolist() == [0.1] * 3  # the same value twice is one value
    assert any("steps 1" in n and "kept the last" in n for n in last.attrs["notes"])


@needs_mlflow
def test_deleted_runs(stores):
    root, ids = stores["root"], stores["ids"]
    gone = next((root / "fs_one" / "mlruns").glob(f"*/{ids['fs/gone']}"))
    frame = read_metrics(gone)  # its own folder: read, and said so
    assert "the run is marked deleted" in frame.attrs["notes"]
    for path in (root / "fs_one", root / "sql_one"):
        with pytest.raises(MetricsError, match="no MLflow run matches --run 'gone'"):
            read_metrics(path, run="gone")
        with pytest.raises(MetricsError, match="no MLflow run matches --run 'lost'"):
            read_metrics(path, run="lost")


@needs_mlflow
def test_bad_lines_are_counted(stores, tmp_path):
    src = stores["root"] / "fs_one" / "mlruns"
    shutil.copytree(src, tmp_path / "mlruns")
    run_dir = next((tmp_path / "mlruns").glob(f"*/{stores['ids']['fs/alpha']}"))
    with (run_dir / "metrics" / "loss").open("ab") as f:
        f.write(b"1700000000000 0.25 x\n1700000000000 0.5 -3\n1700000000000 0.7")
    frame = read_metrics(tmp_path / "mlruns")
    assert skipped_count(frame) == 3
    reasons = {s["reason"]: s["where"] for s in frame.attrs["skipped"]}
    assert reasons == {
        UNPARSED: ["metrics/loss:41"],
        NEGATIVE: ["metrics/loss:42"],
        CUT_OFF: ["metrics/loss:43"],
    }
    assert "3 records skipped" in read_summary(frame)
    assert _bits(frame["loss"].iloc[:40]) == _bits(stores["loss"])


@needs_mlflow
def test_sqlite_bad_rows_are_counted(stores, tmp_path):
    db = tmp_path / "mlflow.db"
    shutil.copy(stores["root"] / "sql_one" / "mlflow.db", db)
    con = sqlite3.connect(db)
    rid = stores["ids"]["sql/alpha"]
    insert = "INSERT INTO metrics (key, value, timestamp, run_uuid, step, is_nan) VALUES "
    con.execute(insert + "('loss', 'abc', 1, ?, 5, 0)", (rid,))  # no writer of MLflow's does
    con.execute(insert + "('loss', 1.0, 2, ?, -1, 0)", (rid,))
    con.commit()
    rowids = [r[0] for r in con.execute("SELECT rowid FROM metrics ORDER BY rowid DESC LIMIT 2")]
    con.close()
    frame = read_metrics(db)
    reasons = {s["reason"]: s["where"] for s in frame.attrs["skipped"]}
    assert reasons == {
        BAD_ROW: [f"metrics rowid {rowids[1]}"],
        NEGATIVE: [f"metrics rowid {rowids[0]}"],
    }
    assert _bits(frame["loss"].iloc[:40]) == _bits(stores["loss"])


def _hand_run(tmp_path: Path, lines: bytes) -> Path:
    """A run folder with one metric file; only for bytes no writer would write."""
    run = tmp_path / "mlruns" / "0" / ("a" * 32)
    (run / "metrics").mkdir(parents=True, exist_ok=True)
    (run.parent / "meta.yaml").write_text("name: Default\nexperiment_id: '0'\n")
    (run / "meta.yaml").write_text(f"run_id: {'a' * 32}\nrun_name: hand\nstatus: 3\n")
    (run / "metrics" / "loss").write_bytes(lines)
    return run


def test_old_and_dataset_lines(tmp_path):
    run = _hand_run(tmp_path, b"1 0.5\n2 0.25 3 train abc123\n")
    frame = read_metrics(run)
    assert frame["loss"].to_dict() == {0: 0.5, 3: 0.25}
    assert any("without a step" in n for n in frame.attrs["notes"])
    assert any("dataset" in n for n in frame.attrs["notes"])


def test_old_run_named_by_its_tag(tmp_path):
    run = _hand_run(tmp_path, b"1 0.5 0\n")
    (run / "meta.yaml").write_text("run_uuid: x\nstatus: 1\n")  # MLflow < 1.29: name in a tag
    (run / "tags").mkdir()
    (run / "tags" / "mlflow.runName").write_text("old-name")
    frame = read_metrics(tmp_path / "mlruns", run="old-name")
    assert frame.attrs["complete"] is False and "status RUNNING" in frame.attrs["notes"][0]


@pytest.mark.parametrize(("status", "word"), [(1, "RUNNING"), (4, "FAILED"), (5, "KILLED")])
def test_an_unfinished_run_is_refused_with_its_status(tmp_path, status, word):
    """compare names what the reader found (MLflow keeps no end record: its status says it),
    on one line with the file and the CLI's flag."""
    from parity.judge.compare import IncompleteRunError, compare_frames

    run = _hand_run(tmp_path, b"1 0.5 0\n")
    (run / "meta.yaml").write_text(f"run_id: {'a' * 32}\nrun_name: hand\nstatus: {status}\n")
    frame = read_metrics(run)
    assert frame.attrs["incomplete"] == f"status {word}"
    with pytest.raises(IncompleteRunError) as err:
        compare_frames(frame, frame)
    assert str(err.value) == (
        f"{run}: run is incomplete (status {word}); --allow-incomplete to compare anyway"
    )
    (run / "meta.yaml").write_text(f"run_id: {'a' * 32}\nrun_name: hand\nstatus: 3\n")
    assert "incomplete" not in read_metrics(run).attrs  # FINISHED


def test_broken_meta_and_empty(tmp_path):
    run = _hand_run(tmp_path, b"")
    with pytest.raises(MetricsError, match="has no metrics that read"):
        read_metrics(run)
    (run / "meta.yaml").write_text("run_name: [unclosed\n")
    with pytest.raises(MetricsError, match=r"meta\.yaml: does not read as YAML"):
        read_metrics(run)
    with pytest.raises(MetricsError, match="no MLflow runs"):
        read_metrics(tmp_path / "mlruns")


HOT_JOURNAL = """
import os, sqlite3
con = sqlite3.connect("mlflow.db", isolation_level=None)
con.execute("PRAGMA cache_size=1")
con.execute("BEGIN")
con.execute("UPDATE metrics SET value = value + 1")
con.execute("UPDATE runs SET name = name || 'x'")
os._exit(0)  # killed mid-write: the journal stays, hot
"""


@needs_mlflow
def test_sqlite_hot_journal_is_named(stores, tmp_path):
    shutil.copy(stores["root"] / "sql_one" / "mlflow.db", tmp_path / "mlflow.db")
    subprocess.run([sys.executable, "-c", HOT_JOURNAL], cwd=tmp_path, check=True)
    before = _files(tmp_path)
    assert "mlflow.db-journal" in {Path(p).name for p in before}
    with pytest.raises(MetricsError, match="mlflow.db-journal: a write was cut short"):
        read_metrics(tmp_path / "mlflow.db")
    assert _files(tmp_path) == before  # not rolled back by us


def test_corrupt_sqlite_is_one_line(tmp_path):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 40)
    with pytest.raises(MetricsError) as err:
        read_metrics(db)
    assert str(err.value).startswith(f"{db}: ") and "\n" not in str(err.value)


line = st.builds(
    lambda ts, v, step: f"{ts} {v} {step}\n".encode(),
    st.integers(0, 2**62),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.integers(0, 2**63 - 1),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(line, max_size=8))
def test_fuzz_written_lines_read_back_exact(lines):
    """Lines as the file store writes them (str of a Python float) read back bit for bit."""
    got = parse_metric_lines(b"".join(lines), "metrics/loss", log := ReadLog())
    assert not log.skipped and len(got) == len(lines)
    for (_, value, step), raw in zip(got, lines, strict=True):
        want = float(raw.split()[1])
        assert _bits([value]) == _bits([want]) and step == int(raw.split()[2])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        line | st.binary(max_size=40) | st.sampled_from([b"\n", b" ", b"1 2 -3\n"]), max_size=10
    )
)
def test_fuzz_corrupt_lines(pieces):
    """Any bytes: every non-blank line is read or counted as skipped, never lost or a crash; the
    vectorised path reads what the line-by-line one reads."""
    raw = b"".join(pieces)
    log = ReadLog()
    got = parse_metric_lines(raw, "metrics/loss", log)
    nonblank = sum(1 for ln in raw.split(b"\n") if ln.strip())
    assert len(got) + sum(len(w) for w in log.skipped.values()) == nonblank
    lines, steps, values = metric_file(raw, "metrics/loss", fast_log := ReadLog())
    assert fast_log.skipped == log.skipped
    assert lines.tolist() == [g[0] for g in got] and steps.tolist() == [g[2] for g in got]
    assert _bits(values.tolist()) == _bits([g[1] for g in got])


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_whole_read(tmp_path_factory, raw):
    """A run whose metric file holds any bytes: a frame or a one-line error naming the run."""
    run = _hand_run(tmp_path_factory.mktemp("fuzz"), raw)
    try:
        frame = read_metrics(run)
    except MetricsError as e:
        assert str(e).startswith(str(run)) and "\n" not in str(e)
    else:
        assert frame.index.is_monotonic_increasing and frame.index.is_unique
