"""The frame contract every reader keeps, and the pieces readers build it from.

The canonical frame: index "step" (int64, ascending, unique), one float64 column per metric
(names sorted), values bit for bit what the source holds. Absent cells are NaN, so a logged NaN
and an absent value look alike in the values; ``frame.attrs["present"]`` (a boolean frame of the
same shape) says which cells the source really had, and ``present_mask`` reads it robustly.

Other attrs, set by ``finish`` for every reader:
- "source": the file or folder read; "format": the reader's name;
- "complete": True/False where the format marks a finished run (our jsonl's end record), else
  None; "incomplete" (only where complete is False): what the reader found, for the error that
  refuses the run ("no end record", MLflow's "status RUNNING");
- "precision": {metric: "float64" | "float32" | "decimals:N" | "digits:S", or float32 with a
  rounding: "float32,decimals:4"}, what the source can hold for that metric: float32 where the
  source says so (TensorBoard's simple_value), decimals:N where the format rounds (Megatron's
  goldens) or where a text log's values all look rounded (``rounded_places``, and digits:S,
  S significant digits, for `%g`: ``rounded_digits``; `finish(..., written=True)`). A float32
  source is judged in float32; a rounded one cannot be judged exact: compare's verdict
  "imprecise" unless the user accepts judging at the source's rounding or gives a tolerance;
- "skipped": [{"reason", "count", "where"}], the records the reader saw but could not use (a
  line that looks like a metric record and does not parse, a record without a step, a number a
  float64 cannot hold, a last line cut off: text.CUT_TAIL). compare refuses a side with skipped
  records unless told to allow them: no verdict from a partial read;
- "notes": what the reader did that a user should know (a restarted run's repeated steps and the
  rule that chose between them, a samples axis left out);
- "step_labels" (only where the source's steps are not integers, e.g. dllogger's
  `[epoch, iteration]`): {step: the source's own step}, so a table or an error can name it.

A number a float64 cannot hold (`1e999`, read as inf; `1e-400`, a nonzero read as 0.0; an
integer past 2**53 it would round, 9007199254740993 read as ...992) is no value: every reader
that parses numbers from text asks ``unfit`` (``fit_number`` for parsed ones) and skips it,
counted under ``UNFIT``. Spelled infinities and NaN, and subnormals (1e-310), are values.

Errors are one line, and bounded: a MetricsError's message longer than ``MAX_MESSAGE``
characters has the values it quotes elided with `...` (``clip_message``), however big they are,
and no message is longer than ``HARD_MESSAGE``.

Caveat: pandas compares attrs in ``pd.concat``, which fails on a frame-valued attr; clear
``frame.attrs`` before concatenating read frames.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd

from parity.errors import InputError

MAX_STEP = 2**63 - 1


def beyond_max_step(digits: str) -> bool:
    """Whether a string of ASCII digits is a step past MAX_STEP, told without int() of all of it
    (Python refuses int() of more than 4300 digits with a bare ValueError)."""
    digits = digits.lstrip("0")
    return len(digits) > len(str(MAX_STEP)) or int(digits or "0") > MAX_STEP


DUPLICATE_RULES = ("error", "first", "last")
Duplicates = Literal["error", "first", "last"]
FLOAT64, FLOAT32 = "float64", "float32"
MAX_MESSAGE = 300  # characters of an error message, once the values it quotes are elided
HARD_MESSAGE = 3 * MAX_MESSAGE  # never more: a longer one loses its middle
_QUOTED = re.compile(r"'(?:[^'\\\n]|\\.){57,}'|\"(?:[^\"\\\n]|\\.){57,}\"")  # a long repr
_LONG_TOKEN = re.compile(r"(?<=\s)\S{81,}")  # a long run after the leading path: a bare value?


def _elided(token: str) -> str:
    return token if "/" in token else token[:50] + "..." + token[-12:]  # a path stays whole


def clip_message(msg: str) -> str:
    """`msg` bounded: past MAX_MESSAGE characters, each long quoted value is elided in its
    middle (`'abc...'`), then each long run without spaces that is no path (a number's digits);
    past HARD_MESSAGE, the message's middle, keeping the path and line in front and the advice
    at the end. A message of paths and words alone keeps them up to HARD_MESSAGE."""
    if len(msg) <= MAX_MESSAGE:
        return msg
    msg = _QUOTED.sub(lambda m: m[0][:40] + "..." + m[0][-1], msg)
    if len(msg) > MAX_MESSAGE:
        msg = _LONG_TOKEN.sub(lambda m: _elided(m[0]), msg)
    if len(msg) <= HARD_MESSAGE:
        return msg
    tail = HARD_MESSAGE // 3
    return msg[: HARD_MESSAGE - tail - 5] + " ... " + msg[-tail:]


class MetricsError(InputError):
    """A metrics source that cannot be read exactly; the message names the file and the line or
    record, clipped (``clip_message``) so a huge value cannot make it huge."""

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (clip_message(args[0]),)
        super().__init__(*args)


class IncompleteRunError(MetricsError):
    """A run without its end record: killed or still running."""


class SkippedRecordsError(MetricsError):
    """A side whose reader skipped records: comparing it would judge from a partial read."""


def fail(path: Path | str, where: int | str | None, msg: str) -> MetricsError:
    """One-line error: `path:line: msg` (where is a line number or a text such as 'record 5')."""
    if where is None or where == "":
        return MetricsError(f"{path}: {msg}")
    return MetricsError(f"{path}:{where}: {msg}")


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlevel = 3


def shown(value: object) -> str:
    """A parsed value's repr for an error message, bounded in length and nesting (a JSON value
    nested 1000 deep has no plain repr: that would recurse past Python's limit)."""
    return _SHOWN.repr(value)


# --- numbers a float64 cannot hold --------------------------------------------------------------

UNFIT = (
    "numbers a float64 cannot hold (a finite one read as inf, a nonzero one as 0, an integer "
    "past 2**53 rounded)"
)
_EXPONENT = re.compile(r"[eE]")
_INTEGER = re.compile(r"\s*([-+]?[0-9]+)(?:\.0*)?\s*", re.ASCII)  # 9007199254740993.0 too
EXACT_INT = 2**53  # every integer up to it is a float64; past it, only some are


def inexact_int(number: int, value: float) -> bool:
    """Whether `value`, the float64 of the integer `number`, is another integer: past 2**53 a
    counter 9007199254740993 reads as ...992, and two different counts would compare equal."""
    return abs(number) > EXACT_INT and int(value) != number


def unfit(text: str | bytes, value: float) -> bool:
    """Whether `value`, what a parser made of the decimal `text`, lost the number: a finite
    literal that overflowed to +-inf (1e999), a nonzero one that underflowed to 0.0 (1e-400),
    or an integer literal past 2**53 read as another integer (``inexact_int``; written with a
    zero fraction too, 9007199254740993.0: a float64's repr of an integer is exact). Spelled
    infinities (inf, Infinity) fit, and so do subnormals (1e-310)."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    if math.isfinite(value) and abs(value) >= EXACT_INT and (m := _INTEGER.fullmatch(text)):
        return inexact_int(int(m[1]), value)
    if value != 0.0 and not math.isinf(value):
        return False
    if value == 0.0:
        mantissa = _EXPONENT.split(text, 1)[0]
        return any(c.isdecimal() and int(c) != 0 for c in mantissa)
    return "inf" not in text.lower()


class Unfit:
    """A number's text a float64 cannot hold (``unfit``), in place of the inf or 0.0 a parser
    would have made of it; readers skip it and count it under ``UNFIT``."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def json_float(text: str) -> float | Unfit:
    """json.loads' parse_float: float() as json does, or Unfit for what a float64 cannot hold."""
    value = float(text)
    return Unfit(text) if unfit(text, value) else value


def text_float(text: str) -> float | None:
    """A number's text as float64 (ValueError for what is no number), None when a float64
    cannot hold it."""
    value = float(text)
    return None if unfit(text, value) else value


def fit_number(value: object) -> float | None:
    """A parsed number (an int, a float, an Unfit) as float64; None when a float64 cannot hold
    it: an Unfit, an integer beyond 1.8e308, an integer past 2**53 it would round."""
    if isinstance(value, Unfit):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except OverflowError:
        return None
    if isinstance(value, int) and inexact_int(value, number):
        return None
    return number


def suspect(value: object) -> bool:
    """Whether a float json.loads gave may be an overflow or underflow (inf or 0.0): its line is
    read again with ``json_float`` to tell (every other float is what its text says)."""
    return isinstance(value, float) and (value == 0.0 or math.isinf(value))


def bad_key(key: str) -> bool:
    return not key or key == "step" or any(c.isspace() for c in key)


def same(a: float, b: float) -> bool:
    """Same bits, or both NaN."""
    return a != a and b != b or np.float64(a).view(np.uint64) == np.float64(b).view(np.uint64)


def decimals(n: int) -> str:
    """The precision of a source that rounds to n decimals (Megatron's golden values: 5)."""
    return f"decimals:{n}"


def digits(n: int) -> str:
    """The precision of a source that rounds to n significant digits (`f"{x:g}"`: 6)."""
    return f"digits:{n}"


def _counts(p: str, q: str, kind: str) -> list[int]:
    """The counts of one kind of rounding ("decimals", "digits") both precision texts give."""
    return [int(x.split(":")[1]) for x in (p, q) for x in x.split(",") if x.startswith(kind + ":")]


def coarser(p: str, q: str) -> str:
    """What both of two precisions hold: a pair is judged at it. Float widths, decimals and
    significant digits are independent limits (a float32 holds 0.0625 steps at a million,
    finer than 4 decimals near 1; 6 significant digits are coarser than 4 decimals at 1000,
    finer at 0.01), so float32 against 4 decimals is "float32,decimals:4": both roundings
    apply, the float width first; of two decimals or two digits, the fewer."""
    width = {FLOAT64: 0, FLOAT32: 1, "float16": 2}
    floats = [x for x in (p, q) for x in x.split(",") if x in width]
    parts = []
    if floats and max(width[f] for f in floats) > 0:
        parts.append(max(floats, key=width.__getitem__))
    if places := _counts(p, q, "decimals"):
        parts.append(decimals(min(places)))
    if sig := _counts(p, q, "digits"):
        parts.append(digits(min(sig)))
    return ",".join(parts) or FLOAT64


# --- values a writer rounded to a few decimals or significant digits ---------------------------

MAX_ROUNDED_PLACES = 5  # more decimals than this is taken as a value written in full
MIN_ROUNDED_PLACES = 3  # fewer is a mean of integers over 10 or 20 samples (123.45) as often
MEAN_EVIDENCE = 10  # distinct values that, sharing a factor 2 or 5, show a mean, not a rounding
HUGE = 1e9  # past it x * 10**5 nears 2**53: its decimals cannot be tested exactly
MIN_ROUNDED_DIGITS = 4  # fewer digits witness nothing (the decimals rule's witness has 4)
SHORT_DIGITS = 6  # `{x:g}`: up to it a column of any length reads as rounded
FLOAT32_DIGITS = 7  # a float32's shortest repr often has no more: rounded only on evidence
_DYADIC = 65536.0  # a multiple of 2**-16 is a short binary fraction: it witnesses no rounding


def _places(x: np.ndarray) -> int | None:
    """The fewest N (1..MAX_ROUNDED_PLACES) such that every value of `x` is the float64 of a
    decimal with N places (its shortest repr has at most N decimals), else None. Exact: a
    computed value one ULP off a short decimal (0.09000000000000001, 0.1 + 0.2) has no N."""
    for n in range(1, MAX_ROUNDED_PLACES + 1):
        scale = 10.0**n  # exact, and |x| * scale < 2**53: the nearest integer is found exactly
        if (np.round(x * scale) / scale == x).all():
            return n
    return None


def _finite(values: np.ndarray) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    return x[np.isfinite(x)]


def _below_huge(x: np.ndarray) -> np.ndarray:
    """The values the decimals rule can test: a spike past HUGE (a grad_norm of 2.5e9) is left
    out of it, not taken as a sign that the whole column holds its values in full."""
    return x[np.abs(x) < HUGE]


def _shows_rounding(x: np.ndarray, n: int) -> bool:
    """Whether values that are all decimals with n places (``_places``) show a rounding: a
    witness (a non-integer with 4 significant digits or more, trailing zeros not counted, that
    no short binary fraction explains), and not the digits of a mean of integers
    (``rounded_places``)."""
    frac = np.unique(np.abs(x[x != np.round(x)]))  # the distinct non-integers
    if not len(frac):
        return False
    units = np.round(frac * 10.0**n).astype(np.int64)  # each value in units of 10**-n
    stripped = units.copy()
    for _ in range(n):  # trailing zeros are no digits: 0.1 at 4 places is 1000, 1 digit
        stripped = np.where(stripped % 10 == 0, stripped // 10, stripped)
    dyadic = (frac * _DYADIC) == np.round(frac * _DYADIC)
    if not (~dyadic & (stripped >= 1000)).any():
        return False
    return not (len(units) >= MEAN_EVIDENCE and ((units % 2 == 0).all() or (units % 5 == 0).all()))


def rounded_places(values: np.ndarray) -> int | None:
    """N when a series looks written rounded to N decimals (`f"{loss:.4f}"`, `round(x, 4)`);
    None when it holds its values in full.

    A text log cannot say how it was written, so the values decide. Rounded at N when:
    - every finite value below HUGE is the float64 of a decimal with N places, N the fewest,
      3 <= N <= 5 (``_places``; Python's repr of a computed float64 or of a float32 has 15-17
      digits and never is, unless it is a short binary fraction). A value past HUGE (a spike
      of 2500000000.1235 in a `.4f` grad_norm) is left out: its decimals cannot be tested
      exactly, and it must not hide the rounding of the others;
    - a value witnesses it: a non-integer with 4 significant digits or more (trailing zeros
      not counted) that no short binary fraction explains (1.003, 2.3456; not 0.3125 = 5/16,
      not 0.1 beside 0.0001, not an lr of 0.0003);
    - and the values are not a mean of integers over 40, 80, 125, ... samples: MEAN_EVIDENCE or
      more distinct non-integers whose digits at N places are all even, or all multiples of 5
      (123.475 = 4939/40 is 123475 thousandths, a multiple of 25). Values rounded to N places
      share such a factor by chance only (2**-10 + 5**-10 for 10 values).
    No text tells a short computed value from a rounded one below that: a constant lr of
    0.06561, a mean over 40 samples logged fewer than 10 times, an accuracy over 1000 samples
    read as rounded, and an exact policy on them gives "imprecise", never a false "aligned". A
    log rounded to 1 or 2 decimals is not told from a mean over 10 or 20 samples (123.45), so
    it is read as written."""
    x = _below_huge(_finite(values))
    n = _places(x) if len(x) else None
    if n is None or n < MIN_ROUNDED_PLACES:
        return None
    return n if _shows_rounding(x, n) else None


def significant_digits(v: float) -> int:
    """Significant digits of a float64's shortest repr: 2.6 -> 2, 0.000123 -> 3, 2.5e9 -> 2,
    0.1 + 0.2 (0.30000000000000004) -> 17. Sign, exponent, point and the zeros before the first
    digit and after the last are no digits."""
    mantissa = repr(abs(v)).partition("e")[0].replace(".", "")
    return len(mantissa.strip("0"))


def _dyadic(v: float) -> bool:
    return v.is_integer() or (v * _DYADIC).is_integer()


def _halved(v: float) -> bool:
    """Whether `v` is a short decimal (3 significant digits or fewer) halved up to 16 times:
    an lr halved by a schedule (1e-4 * 0.5**6 = 1.5625e-06, ReduceLROnPlateau's factor 0.5) is
    computed in full and short, and witnesses no rounding."""
    return any(significant_digits(v * 2.0**j) < MIN_ROUNDED_DIGITS for j in range(1, 17))


def rounded_digits(values: np.ndarray) -> int | None:
    """S when a series looks written rounded to S significant digits (`f"{x:g}"` and `%g`: 6,
    `%.5g`, `%.4g`; `{x:.6e}` and `%.7g`: 7); None when it holds its values in full.

    S is the most significant digits a value's shortest repr has (``significant_digits``).
    Rounded at S when 4 <= S <= 6 and a value witnesses it: one of 4 significant digits or more
    that no short binary fraction explains (a multiple of 2**-16: 0.984375 = 63/64 is a mean
    over 64 samples, in full), nor a short decimal halved (an lr of 1e-4 * 0.5**6 =
    1.5625e-06, in full: ``_halved``).

    At S == 7 it takes MEAN_EVIDENCE distinct non-integers too: a float32 written in its own
    shortest repr (pandas' to_csv of a float32 column, `str()` of a numpy float32) has at most
    7 digits for 2 values in 10 to 6 in 10 (measured on uniform float32s: 0.44 in [0.1, 1),
    0.18 in [1, 3), 0.58 in [3, 10)), so a short float32 column must not read as rounded; 10
    such values all within 7 digits happen by chance at most 0.58**10 (0.4%), 20 at 2e-5, and
    then read as rounded: "imprecise" under an exact policy, the safe side. At 6 digits or
    fewer a float32 value falls by chance with 0.02 to 0.06 per value: a float32 column of one
    or two values can read as rounded, the same safe side. Other values short by nature read
    as rounded too: an accuracy over a million samples (0.123457).

    A value with 8 digits or more ends the check: a computed float64's repr has 15-17, so a
    log written in full costs one value or a few."""
    x = _finite(values)
    top, candidates = 0, set[float]()
    for v in _one_by_one(x):
        s = significant_digits(v)
        if s > FLOAT32_DIGITS:
            return None
        top = max(top, s)
        if s >= MIN_ROUNDED_DIGITS and not _dyadic(v):
            candidates.add(v)
    if not any(not _halved(v) for v in candidates):  # each distinct value checked once
        return None
    if top > SHORT_DIGITS and len(np.unique(x[x != np.round(x)])) < MEAN_EVIDENCE:
        return None
    return None if _fixed_point(np.unique(np.abs(x[x != 0])).tolist()) else top


def _decimal_places(v: float) -> int:
    """Decimal places of a float64's shortest repr: 0.00024576 -> 8, 4.096e-05 -> 8, 120.0 -> 0."""
    mantissa, _, exponent = repr(abs(v)).partition("e")
    fraction = mantissa.partition(".")[2].rstrip("0")
    return max(0, len(fraction) - int(exponent or 0))


def _fixed_point(values: list[float]) -> bool:
    """Whether positive values of 4 significant digits or more, spanning two decades or more,
    are as fine at the top as anywhere: a value of the top decade has the most decimal places.
    Integers scaled by a power of ten are (verl's train/total_tokens(B), a token count / 1e9:
    4.096e-05 ... 0.00024576, every one to 8 places), and hold their values in full; values
    rounded to S significant digits are not, a larger value's last digit lying further left.
    Shorter values witness nothing (a warmup's 3e-05 beside a `%g` cosine's 0.000299918)."""
    values = [v for v in values if significant_digits(v) >= MIN_ROUNDED_DIGITS]
    decades = [math.floor(math.log10(v)) for v in values]
    if not decades or min(decades) == max(decades):
        return False
    places = [_decimal_places(v) for v in values]
    return max(p for p, d in zip(places, decades, strict=True) if d == max(decades)) == max(places)


def _one_by_one(x: np.ndarray, block: int = 4096) -> Iterator[float]:
    """The values as Python floats, a block at a time: a loop that ends at its first value
    does not pay for a list of all of them."""
    for start in range(0, len(x), block):
        yield from x[start : start + block].tolist()


def written_rounding(values: np.ndarray) -> str | None:
    """The precision a text source's values show, when they look rounded: decimals:N
    (``rounded_places``) or digits:S (``rounded_digits``); None when they look written in full.
    The digits rule decides only a column whose values below HUGE are not all short decimals:
    a column of them (123.45, an accuracy over 1000 samples) is the decimals rule's, which tells
    a mean of integers from a rounding."""
    x = _finite(values)
    small = _below_huge(x)
    n = _places(small) if len(small) else None
    if n is not None:
        rounded = n >= MIN_ROUNDED_PLACES and _shows_rounding(small, n)
        return decimals(n) if rounded else None
    s = rounded_digits(x)
    return None if s is None else digits(s)


def written_in_full(head: np.ndarray) -> bool:
    """Whether a column's first values already show that ``written_rounding`` says None of the
    whole column, so a reader may skip asking it (verl's console does, for speed): a value
    below HUGE that is no decimal with 1..MAX_ROUNDED_PLACES places (no decimals rule), and a
    value with more than FLOAT32_DIGITS significant digits (no digits rule)."""
    x = _finite(head)
    small = _below_huge(x)
    if not len(small) or _places(small) is not None:
        return False
    return any(significant_digits(v) > FLOAT32_DIGITS for v in x.tolist())


def infer_decimals(values: pd.DataFrame, precision: dict[str, str]) -> dict[str, str]:
    """``precision`` with each float64 metric whose values look rounded (``written_rounding``)
    at its decimals or significant digits: a text source's rounding is part of what it holds."""
    out = dict(precision)
    for name in values.columns:
        if out.get(str(name), FLOAT64) != FLOAT64:
            continue
        rounding = written_rounding(values[name].to_numpy(dtype=np.float64))
        if rounding is not None:
            out[str(name)] = rounding
    return out


def float32_rounded_places(values: np.ndarray) -> int | None:
    """N when float32 values look rounded to N decimals before they became float32 (HF's
    Trainer logs `round(loss, 4)`, and its TensorBoardCallback writes that as a float32
    simple_value); None when they look like float32s computed in full.

    Rounded at N (3 <= N <= 5, the fewest) when every value v is float32(round(v, N)), and the
    decimals the writer rounded to show a rounding as the text rule asks (``_shows_rounding``:
    a witness, no mean of integers), counting only the values whose float32 spacing is finer
    than 10**-N / 10: where a float32 is coarser, every float32 is the float32 of some N-place
    decimal, and one finer by less than that falls on the grid by chance too often. A float32
    computed in full falls on it with a chance of its spacing times 10**N: 0.024 for a loss of
    2.6 at 5 decimals, so a lone value can read as rounded (the safe side: "imprecise"). A value
    that is no float32 (a DT_DOUBLE beside) means None: the values are not all float32."""
    x = _below_huge(_finite(values))
    if (x.astype(np.float32).astype(np.float64) != x).any():
        return None
    n = _float32_places(x) if len(x) else None
    if n is None or n < MIN_ROUNDED_PLACES:
        return None
    fine = np.spacing(np.abs(x.astype(np.float32))).astype(np.float64) < 10.0**-n / 10
    return n if _shows_rounding(_decimal_grid(x[fine], n), n) else None


def _float32_places(x: np.ndarray) -> int | None:
    """The fewest N (1..MAX_ROUNDED_PLACES) such that every float32 value of `x` is the float32
    of its nearest decimal with N places, else None."""
    x32 = x.astype(np.float32)
    for n in range(1, MAX_ROUNDED_PLACES + 1):
        if (_decimal_grid(x, n).astype(np.float32) == x32).all():
            return n
    return None


def _decimal_grid(x: np.ndarray, n: int) -> np.ndarray:
    """Each value's nearest decimal with n places, as its float64."""
    scale = 10.0**n
    return np.round(x * scale) / scale


@dataclass
class ReadLog:
    """What a reader skipped and what it did that a user should know (see the module doc)."""

    skipped: dict[str, list[str]] = field(default_factory=dict)  # reason -> where
    notes: list[str] = field(default_factory=list)

    def skip(self, reason: str, where: int | str) -> None:
        self.skipped.setdefault(reason, []).append(
            f"line {where}" if isinstance(where, int) else str(where)
        )

    def note(self, text: str) -> None:
        text = clip_message(text)  # a note may quote a line, as an error does: bounded alike
        if text not in self.notes:
            self.notes.append(text)

    def records(self) -> list[dict]:
        return [{"reason": r, "count": len(w), "where": w[:5]} for r, w in self.skipped.items()]


def skipped_count(frame: pd.DataFrame) -> int:
    return sum(int(s["count"]) for s in frame.attrs.get("skipped") or [])


def read_summary(frame: pd.DataFrame, side: str = "") -> str:
    """'read N steps from SOURCE (k records skipped: why)', the line compare prints per side."""
    source = frame.attrs.get("source", side or "?")
    fmt = frame.attrs.get("format")
    text = f"read {len(frame.index)} steps from {source}" + (f" [{fmt}]" if fmt else "")
    skipped = frame.attrs.get("skipped") or []
    if skipped:
        why = "; ".join(
            f"{s['count']} {s['reason']} ({', '.join(s['where'])}"
            + (", ..." if s["count"] > len(s["where"]) else "")
            + ")"
            for s in skipped
        )
        text += f" ({skipped_count(frame)} records skipped: {why})"
    return text


# --- assembling cells into the canonical frame ------------------------------------------------


def assemble(
    group_steps: np.ndarray,
    cell_group: np.ndarray,
    cell_col: np.ndarray,
    cell_val: np.ndarray,
    names: Sequence[str],
) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """(values, present) from cells; None when one (step, metric) got two different values."""
    group_steps = np.asarray(group_steps, dtype=np.int64)
    if len(group_steps) < 2 or (group_steps[1:] > group_steps[:-1]).all():
        ustep, row = group_steps, np.asarray(cell_group, dtype=np.int64)  # the usual log
    else:
        ustep, inv = np.unique(group_steps, return_inverse=True)
        row = inv[cell_group].astype(np.int64)
    order = sorted(range(len(names)), key=lambda i: names[i])
    rank = np.empty(len(names), dtype=np.intp)
    rank[order] = np.arange(len(names))
    ncols = len(names)
    if ncols:
        flat = row * ncols
        flat += rank[cell_col]
    else:
        flat = cell_group
    vals = np.full(len(ustep) * ncols, np.nan)
    present = np.zeros(len(ustep) * ncols, dtype=bool)
    vals[flat] = cell_val
    present[flat] = True
    if int(present.sum()) != len(flat):  # some cell given twice: every copy must agree
        kept = vals[flat]
        agree = (kept.view(np.uint64) == cell_val.view(np.uint64)) | (
            np.isnan(kept) & np.isnan(cell_val)
        )
        if not agree.all():
            return None
    index = pd.Index(ustep, dtype=np.int64, name="step")
    columns = pd.Index([names[i] for i in order])
    shape = (len(ustep), ncols)
    return (
        pd.DataFrame(vals.reshape(shape), index=index, columns=columns, copy=False),
        pd.DataFrame(present.reshape(shape), index=index, columns=columns, copy=False),
    )


class Cells:
    """Cells collected record by record: each record (a line, an event, a row) is a group with
    its step and where it came from, for errors that name it.

    ``frames(rule)`` builds the canonical frame. A (step, metric) given twice with other bits is
    a restarted or appended run: "error" names it, "first"/"last" keep one copy and say so in
    the log's notes. Copies with the same bits are one value.
    """

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.where: list[int | str] = []
        self.group: list[int] = []
        self.col: list[int] = []
        self.val: list[float] = []
        self.names: dict[str, int] = {}
        self.precision: dict[str, str] = {}

    def record(self, step: int, where: int | str) -> int:
        """Start a record; returns its group number for ``add``."""
        self.steps.append(step)
        self.where.append(where)
        return len(self.steps) - 1

    def add(self, group: int, key: str, value: float, precision: str | None = None) -> None:
        self.group.append(group)
        self.col.append(self.names.setdefault(key, len(self.names)))
        self.val.append(value)
        if precision is not None:
            self.precision[key] = coarser(self.precision.get(key, FLOAT64), precision)

    def frames(
        self, path: Path | str, rule: Duplicates = "error", log: ReadLog | None = None
    ) -> tuple[pd.DataFrame, pd.DataFrame]:
        group = np.array(self.group, dtype=np.intp)
        col = np.array(self.col, dtype=np.intp)
        val = np.array(self.val, dtype=np.float64)
        names = list(self.names)
        steps = np.array(self.steps, dtype=np.int64)
        out = assemble(steps, group, col, val, names)
        if out is not None:
            return out
        keep = self._resolve(path, rule, log, steps, group, col, val, names)
        return assemble(steps, group[keep], col[keep], val[keep], names)  # type: ignore[return-value]

    def _resolve(self, path, rule, log, steps, group, col, val, names) -> np.ndarray:
        """Which cells to keep when some (step, metric) has copies with other bits."""
        cell_step = steps[group]
        order = np.lexsort((np.arange(len(group)), col, cell_step))  # by step, metric, order
        s, c, v = cell_step[order], col[order], val[order]
        starts = np.ones(len(order), dtype=bool)
        starts[1:] = (s[1:] != s[:-1]) | (c[1:] != c[:-1])
        run = np.cumsum(starts) - 1
        head = v[np.flatnonzero(starts)][run]  # each cell's first copy
        differs = (v.view(np.uint64) != head.view(np.uint64)) & ~(np.isnan(v) & np.isnan(head))
        if rule == "error":
            second = int(order[np.argmax(differs)])
            first = int(order[np.flatnonzero(starts)[run[np.argmax(differs)]]])
            g1, g2 = int(group[first]), int(group[second])
            raise fail(
                path,
                self.where[g2],
                f"step {int(steps[g2])}: {names[int(col[second])]!r} is {float(val[second])!r} "
                f"here but {float(val[first])!r} at {_where(self.where[g1])}: logged twice (a "
                "restarted or appended run?); choose a rule: --duplicates first|last",
            )
        conflicted = np.isin(run, np.unique(run[differs]))
        ends = np.ones(len(order), dtype=bool)
        ends[:-1] = starts[1:]
        chosen = starts if rule == "first" else ends
        keep = np.zeros(len(group), dtype=bool)
        keep[order[~conflicted | chosen]] = True
        if log is not None:
            hit = np.unique(s[conflicted]).tolist()
            log.note(
                f"{len(hit)} steps logged more than once with other values (steps "
                f"{steps_text(hit)}): kept the {rule} (--duplicates {rule})"
            )
        return keep


def _where(w: int | str) -> str:
    return f"line {w}" if isinstance(w, int) else str(w)


def steps_text(steps: list[int], limit: int = 8) -> str:
    """1, 5, 10 -> "1, 5, 10"; 1..20 -> "1-20": a short list of steps for one line of a message."""
    if len(steps) > 2 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}-{steps[-1]}"
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


def finish(
    values: pd.DataFrame,
    present: pd.DataFrame,
    *,
    source: Path | str,
    fmt: str,
    precision: dict[str, str] | str = FLOAT64,
    log: ReadLog | None = None,
    complete: bool | None = None,
    step_labels: dict[int, object] | None = None,
    written: bool = False,
    incomplete: str = "no end record",
) -> pd.DataFrame:
    """The read frame with the contract's attrs (see the module doc). written: the values are
    decimal text another program wrote, so a float64 metric whose values all look rounded is
    read at its decimals or digits (``infer_decimals``). incomplete: why a run with complete
    False is not finished, as the reader found it (attrs["incomplete"])."""
    if isinstance(precision, str):
        precision = {str(c): precision for c in values.columns}
    else:
        precision = {str(c): precision.get(str(c), FLOAT64) for c in values.columns}
    if written:
        precision = infer_decimals(values, precision)
    log = log or ReadLog()
    values.attrs.update(
        source=str(source),
        format=fmt,
        complete=complete,
        present=present,
        precision=precision,
        skipped=log.records(),
        notes=list(log.notes),
    )
    if complete is False:
        values.attrs["incomplete"] = incomplete
    if step_labels is not None:
        values.attrs["step_labels"] = step_labels
    return values


def present_mask(frame: pd.DataFrame) -> pd.DataFrame:
    """Which cells the source had: attrs["present"] aligned to the frame, or'ed with notna.

    Robust to slicing and to values set after reading (a non-NaN value is always present).
    """
    present = frame.notna()
    mask = frame.attrs.get("present")
    if isinstance(mask, pd.DataFrame) and mask.index.is_unique and mask.columns.is_unique:
        aligned = mask.reindex(index=frame.index, columns=frame.columns, fill_value=False)
        present = present | aligned.astype(bool)
    return present


# --- what a format module declares --------------------------------------------------------------


@dataclass(frozen=True)
class ReadOptions:
    """What the user chose: one run of a folder holding several (--run), and the rule for a
    (step, metric) logged twice with other bits (--duplicates)."""

    run: str | None = None
    duplicates: Duplicates = "error"


@dataclass(frozen=True)
class Format:
    """A format: its name (--format), how it claims a path, how it reads it, and docs/logs.md's
    words for both.

    ``claims(path, head)``: head is the file's first bytes (``HEAD_BYTES``), None for a folder.
    ``read(path, options)`` returns the frame built by ``finish``.
    """

    name: str
    read: Callable[[Path, ReadOptions], pd.DataFrame]
    claims: Callable[[Path, bytes | None], bool]
    detected_by: str
    precision: str


HEAD_BYTES = 1 << 20
