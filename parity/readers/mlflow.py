"""MLflow runs, read from the store on disk without MLflow: the file store (`mlruns/`) and the
SQLite store (`mlflow.db`, MLflow's default tracking URI since 3.7).

File store (mlflow/store/tracking/file_store.py, 1.x to 3.18): `<root>/<experiment_id>/<run_id>/
metrics/<key>`, a key with `/` in nested folders, one line per logged value:
`f"{timestamp} {value} {step}\\n"` (2 fields before steps existed, 5 with a dataset's name and
digest). MLflow turns every value into a Python float first and writes it with str(), which is
repr: the shortest text that reads back to the same float64, or `nan`, `inf`, `-inf`. So the
file store holds float64 exactly (a NaN's sign and payload are lost); a number no float64 holds
(`1e999`, `1e-400`: not MLflow's writing) is skipped and counted (frame.UNFIT). A run's
`meta.yaml` has its run_name, status and lifecycle_stage, an experiment's its name. A deleted
run keeps its folder with `lifecycle_stage: deleted`; a deleted experiment moves to
`<root>/.trash/`. Neither is read.

SQLite store (sqlalchemy_store.py, dbmodels/models.py): `metrics` (key, value REAL, timestamp,
step, is_nan, run_uuid), `runs` (run_uuid, name, status, lifecycle_stage, experiment_id),
`experiments` (experiment_id, name, lifecycle_stage). MLflow stores a NaN as value 0 with is_nan
1, and +-inf as +-DBL_MAX (1.7976931348623157e308), which is what it reads back: they stay so
here, with a note. SQLite keeps a whole-number REAL as an integer, so a logged -0.0 reads 0.0.
The database is opened read-only, and `immutable` when it is in WAL mode without a WAL file, so
reading it creates no -wal/-shm/-journal file.

A (step, key) logged twice is kept in logging order (file order; in SQLite by timestamp, then
row) and follows --duplicates; the dataset of a metric line is not part of its name (the SQLite
store drops it too). A run's status FINISHED is a complete run; RUNNING, FAILED, KILLED are not.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from parity.readers.frame import (
    MAX_STEP,
    UNFIT,
    Cells,
    Duplicates,
    Format,
    MetricsError,
    ReadLog,
    ReadOptions,
    assemble,
    fail,
    finish,
    text_float,
    unfit,
)
from parity.readers.text import read_bytes

SQLITE_HEADER = b"SQLite format 3\x00"
DB_NAME = "mlflow.db"
TRASH = ".trash"
NOT_RUNS = {"tags", "datasets", "traces", "models", TRASH}  # experiment folders that are no run
DBL_MAX = 1.7976931348623157e308
STATUS = {1: "RUNNING", 2: "SCHEDULED", 3: "FINISHED", 4: "FAILED", 5: "KILLED"}
UNPARSED = "metric lines that do not parse"
CUT_OFF = "metric lines cut off (no newline at the end: a run still writing?)"
NEGATIVE = "metrics at a negative step (the frame's steps are >= 0)"
BAD_ROW = "metric rows that do not hold a number at a step"
# words of MLflow's schema, in the first pages of a store that is not named mlflow.db
_SCHEMA_MARKS = (b"run_uuid", b"is_nan", b"lifecycle_stage", b"latest_metrics")

_NUM = rb"[+-]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|(?i:inf|infinity|nan))"
_LINE = re.compile(rb"(\d+) (" + _NUM + rb")(?: (-?\d+)(?: ([^ ]+) ([^ ]+))?)?")
_CLEAN_FILE = re.compile(rb"(?:\d+ " + _NUM + rb" \d+\n)*")  # only `ts value step` lines


@dataclass(frozen=True)
class Series:
    """One metric of a run in logging order, and where each value came from (errors name it):
    `where` + a line number (file store) or a rowid (SQLite) from `tags`."""

    key: str
    steps: np.ndarray
    values: np.ndarray
    tags: np.ndarray
    where: str


@dataclass(frozen=True)
class Run:
    """A run in a store: what names it (errors, --run) and where it lives."""

    id: str
    name: str
    experiment: str
    status: str | None
    deleted: bool
    where: Path  # the run's folder (file store) or the database (SQLite store)
    sqlite: bool

    def label(self, store: bool = False) -> str:
        where = f", in {DB_NAME if self.sqlite else 'mlruns'}" if store else ""
        return f"{self.name!r} (id {self.id}, experiment {self.experiment!r}{where})"


# --- the file store ---------------------------------------------------------------------------


def parse_metric_lines(raw: bytes, name: str, log: ReadLog) -> list[tuple[int, float, int]]:
    """(line number, value, step) of each line of a metric file, as MLflow reads it; a line that
    does not parse is skipped and counted as `name:line`, never dropped in silence."""
    out: list[tuple[int, float, int]] = []
    lines = raw.split(b"\n")
    for lineno, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        if lineno == len(lines):  # a write cut short could read as a shorter, valid line
            log.skip(CUT_OFF, f"{name}:{lineno}")
            continue
        m = _LINE.fullmatch(text)
        if m is None:
            if UNPARSED not in log.skipped:
                log.note(f"first line skipped: {name}:{lineno}: {text[:60]!r}")
            log.skip(UNPARSED, f"{name}:{lineno}")
            continue
        step = 0 if m[3] is None else int(m[3])
        if m[3] is None:
            log.note(f"{name}: lines without a step (MLflow before 1.0): read at step 0")
        if m[4] is not None:
            log.note(f"{name}: lines carry a dataset; it is not part of the metric's name")
        value = text_float(m[2].decode("ascii"))
        if value is None:
            log.skip(UNFIT, f"{name}:{lineno}")
        elif 0 <= step <= MAX_STEP:
            out.append((lineno, value, step))
        else:
            log.skip(NEGATIVE if step < 0 else UNPARSED, f"{name}:{lineno}")
    return out


def metric_file(raw: bytes, name: str, log: ReadLog) -> tuple[np.ndarray, ...]:
    """(line numbers, steps, values) of a metric file. The usual file, only `ts value step`
    lines as MLflow writes them, in one C-level match and no Python per line; anything else
    line by line (`parse_metric_lines`), which names what it skips."""
    if _CLEAN_FILE.fullmatch(raw) is not None:
        tokens = raw.split()
        n = len(tokens) // 3
        try:
            steps = np.fromiter(map(int, tokens[2::3]), dtype=np.int64, count=n)
        except OverflowError:  # a step past int64: the slow path names it
            pass
        else:
            texts = tokens[1::3]
            values = np.fromiter(map(float, texts), dtype=np.float64, count=n)
            odd = np.flatnonzero((values == 0.0) | np.isinf(values)).tolist()
            if not any(unfit(texts[i], values[i]) for i in odd):  # else named line by line
                return np.arange(1, n + 1), steps, values
    parsed = parse_metric_lines(raw, name, log)
    lines = np.array([p[0] for p in parsed], dtype=np.int64)
    values = np.array([p[1] for p in parsed], dtype=np.float64)
    return lines, np.array([p[2] for p in parsed], dtype=np.int64), values


def _read_file_run(run: Run, log: ReadLog) -> list[Series]:
    metrics, out = run.where / "metrics", []
    for file in sorted(p for p in metrics.rglob("*") if p.is_file()):
        key = file.relative_to(metrics).as_posix()
        lines, steps, values = metric_file(read_bytes(file), f"metrics/{key}", log)
        out.append(Series(key, steps, values, lines, f"metrics/{key}:"))
    return out


def _meta(path: Path) -> dict[str, Any] | None:
    """A meta.yaml as a dict; None if it does not read as one."""
    import yaml

    try:
        data = yaml.safe_load(path.read_bytes())
    except (OSError, yaml.YAMLError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _is_run_dir(p: Path) -> bool:
    return (p / "metrics").is_dir() and (p / "meta.yaml").is_file()


def _subdirs(p: Path) -> list[Path]:
    try:
        return sorted(c for c in p.iterdir() if c.is_dir())
    except OSError as e:
        raise MetricsError(f"{p}: cannot list: {e.strerror or e}") from None


def _status(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return STATUS.get(value)
    return value if isinstance(value, str) and value in STATUS.values() else None


def _file_run(run_dir: Path, experiment: str, log: ReadLog) -> Run | None:
    meta = _meta(run_dir / "meta.yaml")
    if meta is None:
        log.note(f"{run_dir}: meta.yaml does not read as YAML: run not considered")
        return None
    name = meta.get("run_name")
    if not isinstance(name, str):  # MLflow before 1.29: only the tag
        tag = run_dir / "tags" / "mlflow.runName"
        name = tag.read_text(errors="replace").strip() if tag.is_file() else ""
    deleted = meta.get("lifecycle_stage") == "deleted"
    return Run(run_dir.name, name, experiment, _status(meta.get("status")), deleted, run_dir, False)


def _file_runs(root: Path, log: ReadLog, experiments: list[Path] | None = None) -> list[Run]:
    """The runs of a file store's root (a deleted experiment is in .trash), or of some of its
    experiments."""
    runs = []
    for exp in experiments or [e for e in _subdirs(root) if (e / "meta.yaml").is_file()]:
        meta = _meta(exp / "meta.yaml") or {}
        if exp.name == TRASH or meta.get("lifecycle_stage") == "deleted":
            continue
        name = meta.get("name") if isinstance(meta.get("name"), str) else exp.name
        for child in _subdirs(exp):
            if child.name not in NOT_RUNS and _is_run_dir(child):
                runs.append(_file_run(child, name, log))
    return [r for r in runs if r is not None]


# --- the SQLite store -------------------------------------------------------------------------


@contextmanager
def _open(db: Path) -> Iterator[sqlite3.Connection]:
    """The database, read-only: nothing written beside it (see the module doc); sqlite3's
    errors become one-line MetricsErrors."""
    try:
        with db.open("rb") as f:
            header = f.read(100)
    except OSError as e:
        raise MetricsError(f"{db}: cannot read: {e.strerror or e}") from None
    if not header.startswith(SQLITE_HEADER) or len(header) < 100:
        raise fail(db, None, "not an SQLite database")
    wal = Path(f"{db}-wal")
    live_wal = wal.is_file() and wal.stat().st_size > 0
    mode = "immutable=1" if header[18] == 2 and not live_wal else "mode=ro"
    try:
        con = sqlite3.connect(f"{db.resolve().as_uri()}?{mode}", uri=True, timeout=5)
    except sqlite3.Error as e:
        raise fail(db, None, f"cannot open the SQLite store: {e}") from None
    try:
        yield con
    except sqlite3.Error as e:
        hot = Path(f"{db}-journal").is_file()  # a writer killed mid-write: only it may roll back
        why = f" ({db.name}-journal: a write was cut short; open it with MLflow)" if hot else ""
        raise fail(db, None, f"cannot read the SQLite store: {e}{why}") from None
    finally:
        con.close()


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in con.execute(f'PRAGMA table_info("{table}")')}


def _sqlite_runs(db: Path) -> list[Run]:
    with _open(db) as con:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not {"metrics", "runs"} <= tables:
            raise fail(db, None, "an SQLite database but no MLflow store (no metrics, runs tables)")
        name = "r.name" if "name" in _columns(con, "runs") else "NULL"
        exp, exp_stage, join = "r.experiment_id", "NULL", ""
        if "experiments" in tables:
            exp, exp_stage = "COALESCE(e.name, r.experiment_id)", "e.lifecycle_stage"
            join = "LEFT JOIN experiments e ON e.experiment_id = r.experiment_id"
        if "tags" in tables:  # an old run's name is only its tag
            name = f"COALESCE(NULLIF({name}, ''), t.value)"
            join += " LEFT JOIN tags t ON t.run_uuid = r.run_uuid AND t.key = 'mlflow.runName'"
        rows = con.execute(
            f"SELECT r.run_uuid, {name}, {exp}, r.status, r.lifecycle_stage, {exp_stage} "
            f"FROM runs r {join} ORDER BY r.experiment_id, r.start_time, r.run_uuid"
        ).fetchall()
    runs = []
    for rid, name, exp, status, stage, exp_stage in rows:
        name, dead = name if isinstance(name, str) else "", "deleted" in (stage, exp_stage)
        runs.append(Run(str(rid), name, str(exp), _status(status), dead, db, True))
    return runs


def _read_sqlite_run(run: Run, log: ReadLog) -> list[Series]:
    out = []
    with _open(run.where) as con:
        is_nan = "is_nan" if "is_nan" in _columns(con, "metrics") else "0"
        good = (
            "typeof(key) = 'text' AND typeof(value) IN ('real', 'integer') AND typeof(step) = "
            f"'integer' AND step >= 0 AND typeof({is_nan}) = 'integer' AND {is_nan} IN (0, 1)"
        )
        keys = "SELECT DISTINCT key FROM metrics WHERE run_uuid = ? AND typeof(key) = 'text'"
        for (key,) in con.execute(keys, (run.id,)).fetchall():
            rows = con.execute(
                f"SELECT value, step, {is_nan}, rowid FROM metrics WHERE run_uuid = ? AND key = ? "
                f"AND {good} ORDER BY timestamp, rowid",
                (run.id, key),
            ).fetchall()
            if not rows:
                continue
            value, step, nan, rowid = zip(*rows, strict=True)
            values = np.array(value, dtype=np.float64)
            values[np.array(nan, dtype=bool)] = np.nan
            if clamped := int((np.abs(values) == DBL_MAX).sum()):
                log.note(
                    f"{key!r}: {clamped} values are +-1.7976931348623157e308, as MLflow's SQL "
                    "store keeps a logged +-inf (read as stored)"
                )
            steps = np.array(step, dtype=np.int64)
            out.append(Series(key, steps, values, np.array(rowid), "metrics rowid "))
        total = con.execute("SELECT count(*) FROM metrics WHERE run_uuid = ?", (run.id,))
        if total.fetchone()[0] != sum(len(s.steps) for s in out):  # name the rows left out
            for rowid, negative in con.execute(
                "SELECT rowid, typeof(step) = 'integer' AND step < 0 FROM metrics "
                f"WHERE run_uuid = ? AND NOT ({good}) ORDER BY rowid",
                (run.id,),
            ):
                log.skip(NEGATIVE if negative else BAD_ROW, f"metrics rowid {rowid}")
    return out


# --- one run into the frame -------------------------------------------------------------------


def frames(
    path: Path, series: list[Series], rule: Duplicates, log: ReadLog
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The frame of a run's series; cell by cell (`Cells`) only when a (step, key) was logged
    twice with other bits, to name it or keep one copy by the rule."""
    names = [s.key for s in series]
    steps = np.concatenate([s.steps for s in series])
    col = np.concatenate([np.full(len(s.steps), i, dtype=np.intp) for i, s in enumerate(series)])
    values = np.concatenate([s.values for s in series])
    out = assemble(steps, np.arange(len(steps)), col, values, names)
    if out is not None:
        return out
    cells = Cells()
    for s in series:
        for st, v, t in zip(s.steps.tolist(), s.values.tolist(), s.tags.tolist(), strict=True):
            cells.add(cells.record(st, f"{s.where}{t}"), s.key, v)
    return cells.frames(path, rule, log)


def _listing(runs: list[Run], limit: int = 8) -> str:
    both = len({r.sqlite for r in runs}) > 1  # a folder with mlruns/ and mlflow.db
    shown = ", ".join(r.label(both) for r in runs[:limit])
    return shown + (f", ... ({len(runs)} in all)" if len(runs) > limit else "")


def choose(path: Path, runs: list[Run], want: str | None, direct: bool = False) -> Run:
    """The run to read: the only one, or the one --run names (run id, id prefix or run name).
    Deleted runs are no candidates, unless the path is the run's own folder (``direct``)."""
    live = runs if direct else [r for r in runs if not r.deleted]
    gone = f" ({len(runs) - len(live)} deleted)" if len(runs) > len(live) else ""
    if not want and len(live) == 1:
        return live[0]
    if not want:
        how = "choose one with --run (a run id, id prefix or run name)"
        msg = (
            f"holds {len(live)} MLflow runs: {_listing(live)}; {how}" if live else "no MLflow runs"
        )
        raise fail(path, None, msg + gone)
    for hits in (
        [r for r in live if r.id == want],
        [r for r in live if r.name == want],
        [r for r in live if r.id.startswith(want)],
    ):
        if len(hits) == 1:
            return hits[0]
        if hits:
            why = "give a run id, or the store itself where both mlruns/ and mlflow.db hold it"
            raise fail(
                path, None, f"--run {want!r} matches {len(hits)} runs: {_listing(hits)}; {why}"
            )
    raise fail(path, None, f"no MLflow run matches --run {want!r}; runs: {_listing(live)}{gone}")


def _is_db(p: Path) -> bool:
    try:
        with p.open("rb") as f:
            return f.read(len(SQLITE_HEADER)) == SQLITE_HEADER
    except OSError:
        return False


def _folder_kind(p: Path) -> str | None:
    """run, experiment, root (of a file store) or parent (holds mlruns/ or mlflow.db)."""
    if _is_run_dir(p):
        return "run"
    if (p / "mlruns").is_dir() or _is_db(p / DB_NAME):
        return "parent"
    try:
        children = [c for c in p.iterdir() if c.is_dir()]
    except OSError:
        return None
    if p.name == "mlruns" or (
        (p / TRASH).is_dir() and any((c / "meta.yaml").is_file() for c in children)
    ):
        return "root"
    if (p / "meta.yaml").is_file() and any(_is_run_dir(c) for c in children):
        return "experiment"
    return None


def _candidates(path: Path, log: ReadLog) -> tuple[list[Run], bool]:
    """Every run the path holds, and whether the path is one run's own folder."""
    if path.is_file():
        return _sqlite_runs(path), False
    kind = _folder_kind(path)
    if kind == "run":
        exp = _meta(path.parent / "meta.yaml") or {}
        run = _file_run(path, str(exp.get("name", path.parent.name)), log)
        if run is None:
            raise fail(path / "meta.yaml", None, "does not read as YAML")
        return [run], True
    if kind in ("experiment", "root"):
        return _file_runs(path, log, [path] if kind == "experiment" else None), False
    if kind == "parent":
        runs = _file_runs(path / "mlruns", log) if (path / "mlruns").is_dir() else []
        return runs + (_sqlite_runs(path / DB_NAME) if _is_db(path / DB_NAME) else []), False
    raise fail(path, None, "no MLflow store here (mlruns/, mlflow.db, or a run's folder)")


def _read(path: Path, options: ReadOptions) -> pd.DataFrame:
    log = ReadLog()
    runs, direct = _candidates(path, log)
    run = choose(path, runs, options.run, direct)
    log.note(f"run {run.label()}, status {run.status or 'unknown'}")
    if run.deleted:
        log.note("the run is marked deleted")
    series = _read_sqlite_run(run, log) if run.sqlite else _read_file_run(run, log)
    if not any(len(s.steps) for s in series):
        raise fail(run.where, None, f"run {run.label()} has no metrics that read")
    values, present = frames(run.where, series, options.duplicates, log)
    done = None if run.status is None else run.status == "FINISHED"
    return finish(
        values,
        present,
        source=run.where,
        fmt="mlflow",
        log=log,
        complete=done,
        written=True,
        incomplete=f"status {run.status}",
    )


def _claims(path: Path, head: bytes | None) -> bool:
    if head is None:
        return _folder_kind(path) is not None
    if not head.startswith(SQLITE_HEADER):
        return False
    return path.name == DB_NAME or all(mark in head for mark in _SCHEMA_MARKS)


FORMATS = [
    Format(
        "mlflow",
        _read,
        _claims,
        "an MLflow store: a folder `mlruns` or one holding `mlruns/` or `mlflow.db`, an "
        "experiment's or a run's folder (`meta.yaml` and `metrics/`), or an SQLite `mlflow.db`",
        "float64 (the SQLite store: +-inf as +-DBL_MAX, -0.0 as 0.0)",
    )
]
