"""Baseline files projects keep in their repos: Megatron-LM's golden values, torchtitan's losses.

Megatron-LM (tests/functional_tests/test_cases/**/golden_values_*.json), as its generator
writes it (tests/functional_tests/python_test_utils/common.py, read_tb_logs_as_list, and
get_test_results_from_tensorboard_logs.py): one entry per TensorBoard tag (`lm loss`,
`num-zeros`, `mem-allocated-bytes`, `iteration-time`, ...), each
`{"start_step", "end_step", "step_interval", "values"}`. Every value is `round(v, 5)` of the
TensorBoard scalar, so its precision is decimals(5) (float64, with a note, for a metric written
with more decimals: not the generator's rounding). Two layouts:
- values an object `{"1": 10.84009, "5": ...}`: the keys are the Megatron iterations (the
  generator keeps iteration 1 and every multiple of step_interval). A `"nan"` string is its
  mark for an iteration the run did not log: read as absent (said in the notes);
- values a list (before mid 2024): Megatron's old test compared it with
  `tb_values[start_step:end_step:step_interval]`, so value i is at step
  start_step + i * step_interval, counting the TensorBoard scalars from 0: with a scalar logged
  every iteration from 1, Megatron's iteration is that step + 1 (said in the notes). A number
  beside the entries (`"iteration_timing_avg": 0.119`) has no step: left out, said in the notes.

torchtitan (tests/assets/losses/*.txt, scripts/loss_compare.py --export-result): one line
`STEP LOSS` per step, the loss as Python prints a float (the TensorBoard value, so float64 repr;
files cut from the console log carry a fixed number of decimals, read as decimals(N)). Where no
fixed number decides (one row, or a repr of `round(loss, 4)`: 2.3456, 2.12), the values do, by
the rule every text log's are read by (frame.infer_decimals: decimals:N or digits:S). Newer
files start with `# key: value` comments and a `# step loss grad_norm` line naming the columns.
The loss is named `loss_metrics/global_avg_loss`, the tag torchtitan's TensorBoard and W&B
loggers use, so a baseline compares with a torchtitan run read from TensorBoard; other columns
keep their header's name (`grad_norm` is torchtitan's tag too). RL references
(`rl_grpo_cuda.txt`) hold `loss/mean` values under the same name: rename the run's column.
A row that does not parse is skipped and counted, and so is a last row without its newline
(cut off: a loss cut mid-number still parses).

In both, a number a float64 cannot hold (`1e999`, `1e-400`) is skipped and counted
(frame.UNFIT), never read as inf or 0.0.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import pandas as pd

from parity.readers.frame import (
    FLOAT64,
    MAX_STEP,
    UNFIT,
    Cells,
    Format,
    ReadLog,
    ReadOptions,
    decimals,
    fail,
    finish,
    fit_number,
    shown,
    text_float,
)
from parity.readers.text import CUT_TAIL, cut_tail, decode, read_bytes

MEGATRON_DECIMALS = 5
_STEP = re.compile("[0-9]+", re.ASCII)
LOSS_TAG = "loss_metrics/global_avg_loss"
NOT_NUMBER = "golden values that are not numbers"
BAD_STEP = "golden values whose step is not an integer"
UNPARSED = "rows that do not parse"


class _Literal(str):
    """A JSON number's text as written, to count its decimals."""


class _Object(dict):
    """A JSON object that keeps its pairs in order, repeated keys included."""

    pairs: list[tuple[str, Any]]


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    obj.pairs = pairs
    return obj


def _places(text: str) -> int:
    """Decimal places of a number as written: '10.84009' -> 5, '1e-05' -> 5, '2206.0' -> 1."""
    try:
        exponent = Decimal(text).as_tuple().exponent
    except InvalidOperation:
        return 0
    return -exponent if isinstance(exponent, int) and exponent < 0 else 0


# --- Megatron-LM golden values ------------------------------------------------------------------


def _int_field(path: Path, name: str, entry: dict[str, Any], key: str, low: int) -> int:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_STEP:
        raise fail(
            path, f"metric {name!r}", f"{key} must be an integer >= {low}, got {shown(value)}"
        )
    return value


def _megatron_value(value: Any) -> tuple[float, int] | str | None:
    """(float, decimal places), "absent" for Megatron's "nan" mark, UNFIT for a number a
    float64 cannot hold, None when unusable."""
    if isinstance(value, _Literal):
        number = text_float(value)  # a JSON number's text: float() reads it
        return UNFIT if number is None else (number, _places(value))
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        number = fit_number(value)
        return UNFIT if number is None else (number, 0)
    if isinstance(value, float):  # NaN, Infinity, -Infinity as json.dumps writes them
        return value, 0
    return "absent" if value == "nan" else None


def _read_megatron(path: Path, options: ReadOptions) -> pd.DataFrame:
    text = decode(read_bytes(path), path, lines=False)  # JSON
    try:
        top = json.loads(text, object_pairs_hook=_object, parse_float=_Literal)
    except RecursionError:
        raise fail(path, None, "not valid JSON: nested too deeply") from None
    except ValueError as e:
        raise fail(path, None, f"not valid JSON: {e}") from None
    if not isinstance(top, _Object):
        raise fail(path, None, "golden values must be a JSON object of metrics")
    cells, log = Cells(), ReadLog()
    absent: dict[str, int] = {}
    places: dict[str, int] = {}
    seen: set[str] = set()
    for name, entry in top.pairs:
        if name in seen:
            raise fail(path, f"metric {name!r}", "given twice")
        seen.add(name)
        if isinstance(entry, (_Literal, int, float)) and not isinstance(entry, bool):
            log.note(f"left out {name!r}: one number without steps")
            continue
        if not isinstance(entry, _Object) or "values" not in entry:
            raise fail(
                path, f"metric {name!r}", "not an object with start_step/step_interval/values"
            )
        start = _int_field(path, name, entry, "start_step", 0)
        end = _int_field(path, name, entry, "end_step", 0)
        interval = _int_field(path, name, entry, "step_interval", 1)
        values = entry["values"]
        if isinstance(values, list):
            if len(values) != len(range(start, end, interval)):
                log.note(
                    f"{name!r}: {len(values)} values, but start_step {start}, end_step {end} "
                    f"and step_interval {interval} make {len(range(start, end, interval))}"
                )
            log.note(
                "list layout: step = start_step + i * step_interval counts the TensorBoard "
                "scalars from 0 (Megatron's old test sliced them so); Megatron's iteration is "
                "usually step + 1"
            )
            items = [(str(start + i * interval), v) for i, v in enumerate(values)]
        elif isinstance(values, _Object):
            items = values.pairs
        else:
            raise fail(path, f"metric {name!r}", "values must be a list or an object")
        places.setdefault(name, 0)
        if not items:
            log.note(f"{name!r} has no values")
        for key, raw in items:
            where = f"{name!r} step {key}"
            if not _STEP.fullmatch(key) or len(key) > 19 or int(key) > MAX_STEP:
                log.skip(BAD_STEP, where)
                continue
            got = _megatron_value(raw)
            if got == "absent":
                absent[name] = absent.get(name, 0) + 1
                continue
            if got is None or got == UNFIT:
                log.skip(NOT_NUMBER if got is None else UNFIT, where)
                continue
            value, n = got  # type: ignore[misc]
            places[name] = max(places[name], n)
            cells.add(cells.record(int(key), where), name, value)
    for name, n in absent.items():
        log.note(f'{name!r}: {n} values written as "nan" (steps the run did not log): absent')
    precision = {}
    for name, n in places.items():
        precision[name] = decimals(MEGATRON_DECIMALS) if n <= MEGATRON_DECIMALS else FLOAT64
        if n > MEGATRON_DECIMALS:
            log.note(f"{name!r} is written with {n} decimals, not rounded to 5: read as float64")
    if not cells.steps:
        raise fail(path, None, "no golden values with a step")
    values, present = cells.frames(path, options.duplicates, log)
    return finish(values, present, source=path, fmt="megatron-golden", precision=precision, log=log)


_GOLDEN_HEAD = re.compile(rb'\A\s*\{\s*"[^"\n]*"\s*:\s*\{')


def _claims_megatron(path: Path, head: bytes | None) -> bool:
    if head is None or path.suffix.lower() != ".json":
        return False
    head = head.removeprefix(b"\xef\xbb\xbf")
    if not _GOLDEN_HEAD.match(head):
        return False
    first = head[:2048]
    return all(k in first for k in (b'"start_step"', b'"end_step"', b'"step_interval"'))


# --- torchtitan loss reference ------------------------------------------------------------------

_NUMBER = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?(?:nan|inf)")
_ROW = re.compile(rb"[0-9]+(?:[ \t]+[-+]?(?:[0-9.]+(?:[eE][-+]?[0-9]+)?|nan|inf))+[ \t]*")
_HEADER = re.compile(r"#\s*step(?:\s+\S+)+\s*")


def _fixed_places(texts: list[str]) -> int | None:
    """N when every value is written with N decimals in plain notation (a console log's fixed
    format, e.g. `{loss:8.5f}`), two rows or more; None for Python's repr, whose digits vary, or
    a single row: then the values decide (finish's written rule)."""
    counts = {len(t.partition(".")[2]) if "." in t and "e" not in t.lower() else -1 for t in texts}
    if len(texts) < 2 or len(counts) != 1:
        return None
    n = counts.pop()
    return n if 0 < n <= 8 else None


def _read_torchtitan(path: Path, options: ReadOptions) -> pd.DataFrame:
    text, cut = cut_tail(decode(read_bytes(path), path))
    cells, log = Cells(), ReadLog()
    if cut is not None:
        log.skip(CUT_TAIL, cut)
    columns: list[str] | None = None
    header: list[str] = []
    written: dict[str, list[str]] = {}
    first_why: tuple[int, str] | None = None
    for lineno, line in enumerate(text.split("\n"), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            if _HEADER.fullmatch(line):
                names = line[1:].split()[1:]
                names = [LOSS_TAG if n == "loss" else n for n in names]
                if len(set(names)) != len(names) or "step" in names:
                    raise fail(path, lineno, "the '# step ...' line names a column twice")
                if columns is not None and names != columns:
                    raise fail(path, lineno, "a second '# step ...' line with other columns")
                columns = names
            elif len(header) < 4:
                header.append(line.lstrip("# "))
            continue
        tokens = line.split()
        want = columns or [LOSS_TAG]
        why = ""
        if len(tokens) != len(want) + 1:
            why = f"{len(tokens)} fields, want step and {', '.join(want)}"
        elif not _STEP.fullmatch(tokens[0]) or len(tokens[0]) > 19 or int(tokens[0]) > MAX_STEP:
            why = f"step must be a non-negative integer, got {tokens[0]!r}"
        else:
            bad = [t for t in tokens[1:] if not _NUMBER.fullmatch(t.lower())]
            why = f"not a number: {bad[0]!r}" if bad else ""
        if why:
            log.skip(UNPARSED, lineno)
            first_why = first_why or (lineno, why)
            continue
        group = cells.record(int(tokens[0]), lineno)
        for name, token in zip(want, tokens[1:], strict=True):
            value = text_float(token)
            if value is None:
                log.skip(UNFIT, f"line {lineno} ({name!r})")
                continue
            cells.add(group, name, value)
            written.setdefault(name, []).append(token)
    if not cells.steps:
        why = f" (line {first_why[0]}: {first_why[1]})" if first_why else ""
        if cut is not None and not first_why:
            why = f" (line {cut}, the last, has no newline: cut off)"
        raise fail(path, None, f"no loss rows ('STEP LOSS' lines){why}")
    if first_why:
        log.note(f"first row skipped: {path}:{first_why[0]}: {first_why[1]}")
    if header:
        log.note("reference header: " + "; ".join(header))
    precision = {}
    for name, texts in written.items():
        n = _fixed_places(texts)
        precision[name] = decimals(n) if n is not None else FLOAT64
    values, present = cells.frames(path, options.duplicates, log)
    return finish(
        values,
        present,
        source=path,
        fmt="torchtitan-loss",
        precision=precision,
        log=log,
        written=True,  # where no fixed number of decimals decides, the values' look does
    )


def _claims_torchtitan(path: Path, head: bytes | None) -> bool:
    """A `.txt` whose data lines are exactly `STEP NUMBER...`, named like torchtitan's (`loss`
    in its name, or under a `losses` folder: tests/assets/losses/...) or with torchtitan's
    `# step loss` header."""
    if head is None or path.suffix.lower() != ".txt":
        return False
    lines = [x.strip() for x in head.removeprefix(b"\xef\xbb\xbf").split(b"\n")[:40]]
    if len(head) == 1 << 20:  # a full head: its last line may be cut
        lines = lines[:-1]
    lines = [x for x in lines if x]
    comments = [x for x in lines if x.startswith(b"#")]
    rows = [x for x in lines if not x.startswith(b"#")]
    if not rows or not all(_ROW.fullmatch(x) for x in rows[:20]):
        return False
    named = "loss" in path.name.lower() or "losses" in (p.lower() for p in path.parent.parts)
    return named or any(re.fullmatch(rb"#\s*step\s+loss\b.*", c) for c in comments)


FORMATS = [
    Format(
        "megatron-golden",
        _read_megatron,
        _claims_megatron,
        "a `.json` object whose entries have `start_step`/`end_step`/`step_interval`/`values` "
        "(Megatron-LM's golden values)",
        "decimals(5)",
    ),
    Format(
        "torchtitan-loss",
        _read_torchtitan,
        _claims_torchtitan,
        "a `.txt` of `STEP LOSS` lines named `*loss*` or under a `losses/` folder, or headed "
        "`# step loss ...` (torchtitan's loss reference)",
        "float64, or decimals(N) when every value has N decimals or every value looks rounded",
    ),
]
