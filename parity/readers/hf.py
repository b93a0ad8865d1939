"""HF Trainer's `trainer_state.json` (and TRL's trainers, which inherit it): its `log_history`.

What transformers writes (read from 4.20, 4.30-4.57 and 5.0-5.24): `Trainer.log` appends
`{**logs, "step": global_step}` to `state.log_history`, and `TrainerState.save_to_json` dumps it
(`json.dumps(indent=2, sort_keys=True)`, so NaN is `NaN`). The rows are a training log
(`loss`, `grad_norm`, `learning_rate`, `epoch`), an evaluation (`eval_loss`, `eval_runtime`,
... and `epoch`, at the same step as the training row) and, once training ends, the summary row
(`train_runtime`, `train_samples_per_second`, `train_steps_per_second`, `total_flos`,
`train_loss`, `epoch`) at the last step. TRL adds its own keys (`mean_token_accuracy`,
`rewards/...`) and may log `null` where nothing was averaged.

Names are what HF's own TensorBoard and W&B callbacks write (`rewrite_logs`): `eval_x` is
`eval/x`, `test_x` is `test/x`, anything else `train/x`, so one run read from its
`trainer_state.json` and from its TensorBoard events compares key for key. The summary row thus
lands under `train/train_loss`, `train/train_runtime`, ... (as TensorBoardCallback names them),
beside, not over, the last step's `train/loss`. The step is the row's `step` (global step);
`epoch` is a metric like the others. A value that is not a number (a string, `null`, a list) is
not a metric: the TensorBoard callback drops it too; it is left out and counted in a note. A
bool is a number to that callback (`isinstance(v, (int, float))`) and here: 1.0 or 0.0. A
number a float64 cannot hold (`1e999`, `1e-400`: not what json.dumps writes) is skipped and
counted (frame.UNFIT).

Precision: HF rounds some values before logging them, and the file does not say which
transformers wrote it:
- `loss` is `round(x, 4)` in transformers 4.x (up to 4.57), unrounded from 5.0;
- `epoch` is `round(x, 2)` up to 4.39, unrounded from 4.40;
- `speed_metrics` rounds `*_runtime` to 4 decimals and `*_per_second` to 3 in every version,
  `*_model_preparation_time` and `*_jit_compilation_time` to 4.
So each of these metrics is `decimals:N` when every value it has in the file is already rounded
to N decimals (what a rounding version writes), and float64 when one value has more (only a
version that does not round writes that). A value can only prove the writer did NOT round;
an unrounded metric whose values all happen to be short (0.5, 2.0) is judged at N decimals,
coarser than it could be: the safe side. Everything else is float64 (the JSON holds Python's
repr of a float), unless its values all look rounded, as in any text log (frame.rounded_places:
a log_history that a callback or script rounded, `round(x, 4)`; a Trainer's computed values,
float32 grad norms, scheduled learning rates, do not look so). A sibling `config.json`'s
`transformers_version` could tell the version, but only for a PreTrainedModel and only for the
run's last writer; the values are always there.

With `include_num_input_tokens_seen`, transformers 5.24 also puts `train_runtime` on every
step's row; the summary row's repeat of a key its step already has is left out (noted).
The run is complete (attrs) when the summary row (`train_loss`) is there; else unknown (None):
a checkpoint's state never has it. A folder is an output_dir: its `trainer_state.json`
(`trainer.save_state()`), else the highest `checkpoint-N/trainer_state.json` (noted);
`--run checkpoint-N` picks one.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pandas as pd

from parity.readers.frame import (
    MAX_STEP,
    UNFIT,
    Cells,
    Format,
    ReadLog,
    ReadOptions,
    Unfit,
    decimals,
    fail,
    finish,
    fit_number,
    json_float,
)
from parity.readers.text import decode, read_bytes
from parity.record.names import HF_SUMMARY_KEY, hf_metric_name

STATE_FILE = "trainer_state.json"
_CHECKPOINT = re.compile(r"checkpoint-([0-9]+)")
_ROUNDED = (  # (key pattern, decimals some transformers version rounds it to), see module doc
    (re.compile(r"loss"), 4),
    (re.compile(r"epoch"), 2),
    (re.compile(r".+_(runtime|model_preparation_time|jit_compilation_time)"), 4),
    (re.compile(r".+_(samples|steps|tokens)_per_second"), 3),
)
_HISTORY_KEY = re.compile(rb'\n\s*"log_history"\s*:\s*\[')
NO_STEP = "log_history rows without a step"
BAD_STEP = "log_history rows whose step is not a non-negative integer"
NOT_ROW = "log_history entries that are not objects"


def _rounding(key: str) -> int | None:
    for pattern, n in _ROUNDED:
        if pattern.fullmatch(key):
            return n
    return None


def _is_rounded(value: float, n: int) -> bool:
    """Whether `value` is what `round(x, n)` gives for some x (round is idempotent there)."""
    return not math.isfinite(value) or round(value, n) == value


def _state_file(path: Path, run: str | None, log: ReadLog) -> Path:
    """The trainer_state.json of a file or an HF output_dir (see `_claims`)."""
    if not path.is_dir():
        if run is not None:
            raise fail(
                path, None, f"--run {run!r} picks a checkpoint of a folder; this is one file"
            )
        return path
    try:
        checkpoints = sorted(
            (int(m[1]), d.name)
            for d in path.iterdir()
            if (m := _CHECKPOINT.fullmatch(d.name)) and (d / STATE_FILE).is_file()
        )
    except OSError as e:
        raise fail(path, None, f"cannot list: {e.strerror or e}") from None
    if run is not None:
        names = [name for _, name in checkpoints]
        if run not in names:
            have = ", ".join(names) or "none"
            raise fail(path, None, f"no checkpoint {run!r} with a {STATE_FILE} (have: {have})")
        return path / run / STATE_FILE
    if (path / STATE_FILE).is_file():
        return path / STATE_FILE
    if not checkpoints:
        raise fail(path, None, f"no {STATE_FILE}, nor checkpoint-N/{STATE_FILE}")
    latest = checkpoints[-1][1]
    log.note(
        f"{path} has no top-level {STATE_FILE}: read the latest checkpoint's, "
        f"{latest}/{STATE_FILE} (of {len(checkpoints)}; --run picks another)"
    )
    return path / latest / STATE_FILE


def _load(file: Path) -> list[Any]:
    text = decode(read_bytes(file), file, lines=False)  # JSON
    try:
        state = json.loads(text, parse_float=json_float)
    except json.JSONDecodeError as e:
        where = e.lineno if text.strip() else None
        why = "file is truncated" if e.pos >= len(text.rstrip()) else e.msg
        raise fail(file, where, f"not valid JSON: {why}") from None
    except RecursionError:
        raise fail(file, None, "not valid JSON: nested too deeply") from None
    except ValueError as e:  # an integer too long
        raise fail(file, None, f"not valid JSON: {str(e).splitlines()[0][:80]}") from None
    if not isinstance(state, dict):
        raise fail(file, None, "not a trainer state: the JSON is not an object")
    history = state.get("log_history")
    if not isinstance(history, list):
        raise fail(file, None, "not a trainer state: no 'log_history' list")
    return history


def _step(row: dict[str, Any]) -> int | str:
    """The row's global step, or the reason it has none."""
    step = row.get("step")
    if step is None:
        return NO_STEP
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        return BAD_STEP
    return step


def _read(path: Path, options: ReadOptions) -> pd.DataFrame:
    log = ReadLog()
    file = _state_file(path, options.run, log)
    history = _load(file)
    cells = Cells()
    ignored: dict[str, int] = {}
    candidates: dict[str, int] = {}  # metric -> decimals, while every value is so rounded
    unrounded: set[str] = set()
    complete = False
    last_step: int | None = None
    logged: dict[int, dict[str, Any]] = {}  # what each step's rows have given so far
    for i, row in enumerate(history):
        where = f"log_history[{i}]"
        if not isinstance(row, dict):
            log.skip(NOT_ROW, where)
            continue
        step = _step(row)
        if isinstance(step, str):
            log.skip(step, where)
            continue
        if last_step is not None and step < last_step:
            log.note(
                f"steps go back at {where} (step {step} after {last_step}): "
                "a resumed or appended run?"
            )
        last_step = step
        summary = HF_SUMMARY_KEY in row
        complete = complete or summary
        group = cells.record(step, where)
        given = logged.setdefault(step, {})
        for key, raw in row.items():
            if key == "step":
                continue
            if summary and key in given:  # e.g. train_runtime, on every row with tokens seen
                if given[key] != raw:
                    log.note(
                        f"the summary row ({where}) repeats {key!r} of step {step}'s own row "
                        "with another value: kept the step's"
                    )
                continue
            given[key] = raw
            if not isinstance(raw, (int, float, Unfit)):  # bool is an int, as to the callback
                ignored[key] = ignored.get(key, 0) + 1
                continue
            value = fit_number(raw)
            if value is None:
                log.skip(UNFIT, f"{where} ({key!r})")
                continue
            name = hf_metric_name(key)
            n = _rounding(key)
            if n is not None and name not in unrounded:
                if _is_rounded(value, n):
                    candidates.setdefault(name, n)
                else:
                    candidates.pop(name, None)
                    unrounded.add(name)
            cells.add(group, name, value)
    if not cells.steps:
        raise fail(file, None, "no metrics records (log_history has no row with a step)")
    if ignored:
        keys = ", ".join(f"{k} ({n})" for k, n in sorted(ignored.items()))
        log.note(f"values that are not numbers left out, as HF's TensorBoard callback does: {keys}")
    values, present = cells.frames(file, options.duplicates, log)
    precision = {name: decimals(n) for name, n in candidates.items()}
    return finish(
        values,
        present,
        source=file,
        fmt="hf-trainer-state",
        precision=precision,
        log=log,
        complete=True if complete else None,
        written=True,
    )


def _claims(path: Path, head: bytes | None) -> bool:
    if head is None:
        if (path / STATE_FILE).is_file():
            return True
        try:
            return any(
                _CHECKPOINT.fullmatch(d.name) and (d / STATE_FILE).is_file() for d in path.iterdir()
            )
        except OSError:
            return False
    if path.name == STATE_FILE:
        return True
    body = head.lstrip()
    if not body.startswith(b"{"):
        return False
    try:  # one line holding a whole object (a state dumped without indent, or JSON lines)
        first = json.loads(body.split(b"\n", 1)[0])
    except (ValueError, RecursionError):  # the usual indented state: `"log_history": [` below
        return _HISTORY_KEY.search(head) is not None
    return isinstance(first, dict) and isinstance(first.get("log_history"), list)


FORMATS = [
    Format(
        "hf-trainer-state",
        _read,
        _claims,
        "HF Trainer's or TRL's `trainer_state.json` (its `log_history`), or an output_dir "
        "holding one (else the latest `checkpoint-N/trainer_state.json`)",
        "float64; `loss`, `epoch`, `*_runtime` and `*_per_second` at the decimals HF rounds "
        "them to, unless a value proves the writer did not",
    )
]
