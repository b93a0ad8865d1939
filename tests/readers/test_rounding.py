"""When a text log's values look rounded (frame.rounded_places, frame.rounded_digits): a log
written in full is never read as rounded, so an exact policy on it never gives a false
"imprecise"; a rounded one is, so it never gives a false "aligned".

A training loop logs Python's repr of its floats: computed float64 values (15-17 digits), a
float32 loss's `.item()`, learning rates from a schedule, means over a batch, token counts.
None of them may read as `decimals:N` or `digits:S`; values written with `f"{x:.4f}"` must
read as decimals, with `f"{x:g}"`, `%.5g` or `{x:.6e}` as significant digits.
"""

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.readers import read_metrics
from parity.readers.contract import precision_problem
from parity.readers.frame import (
    MEAN_EVIDENCE,
    rounded_digits,
    rounded_places,
    significant_digits,
    written_in_full,
    written_rounding,
)

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True)


def _float64_bits(sign: bool, exponent: int, mantissa: int) -> float:
    """A float64 from its fields: what a computation gives, no decimal chose it."""
    bits = (int(sign) << 63) | ((exponent + 1023) << 52) | mantissa
    return float(np.array(bits, dtype=np.uint64).view(np.float64))


float64_values = st.builds(
    _float64_bits, st.booleans(), st.integers(-30, 30), st.integers(0, 2**52 - 1)
)
float32_values = st.floats(width=32, allow_nan=False, allow_infinity=False).map(
    lambda x: float(np.float32(x))
)


@PROPERTY
@given(st.lists(float32_values, min_size=1, max_size=40))
def test_float32_values_are_never_read_as_rounded(values):
    """A float32 (a loss's `.item()`) is the float64 of a short decimal only when it is a short
    binary fraction (0.5, 0.3125), and those witness nothing: never rounded."""
    assert rounded_places(np.array(values)) is None


@PROPERTY
@given(st.lists(float64_values, min_size=1, max_size=40))
def test_computed_float64_values_are_never_read_as_rounded(values):
    """Python's repr of a computed float64 has 15-17 digits: never rounded."""
    assert rounded_places(np.array([float(repr(x)) for x in values])) is None


@PROPERTY
@given(
    places=st.integers(3, 5),
    units=st.lists(st.integers(0, 10**9), max_size=40),
    whole=st.integers(0, 999),
)
def test_values_written_with_few_decimals_are_read_as_rounded(places, units, whole):
    """A series at N places holding one value that ends in 1, 3, 7 or 9 there (no mean over
    40 or 80 samples gives that) and has 4 significant digits (a witness) reads decimals N."""
    scale = 10**places
    witness = (whole * scale + scale + 1) / scale  # e.g. 1.001 at 3 places
    values = [witness] + [u / scale for u in units]
    assert rounded_places(np.array(values)) == places


def _steplr(lr: float, gamma: float, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(lr)
        lr *= gamma  # torch's StepLR multiplies: 0.09000000000000001, ...
    return out


FULL_LOGS = {
    "warmup lr 3e-4 * step / 10": [3e-4 * s / 10 for s in range(1, 11)],
    "warmup then constant": [3e-4 * min(1.0, s / 10) for s in range(1, 40)],
    "StepLR 0.1 * 0.9 per step": _steplr(0.1, 0.9, 6),
    "0.1 * 0.9**k, k < 5 (0.0729, 0.06561 are short)": [0.1 * 0.9**k for k in range(5)],
    "linear decay": [3e-4 * (1 - s / 100) for s in range(100)],
    "cosine": [1.5e-4 * (1 + math.cos(math.pi * s / 50)) for s in range(50)],
    "a constant lr": [0.0003] * 20,
    "lr set from a list": [0.1, 0.01, 0.001, 0.0001],
    "mean over 40 samples": [100 + k / 40 for k in range(0, 1000, 37)],
    "mean over 80 samples": [k / 80 for k in range(1, 400, 13)],
    "0/1 rewards over a batch of 40": [k / 40 for k in (3, 17, 22, 25, 31, 9, 14, 38, 27, 11)],
    "epoch over 125 steps": [s / 125 for s in range(1, 400, 7)],
    "mean over 64 samples": [k / 64 for k in range(1, 640, 11)],
    "token counts": [float(1000 * s + 7 * s * s) for s in range(1, 30)],
    "tokens past 1e9": [1e9 + 12345.5 * s for s in range(10)],
    "grad norms (float32)": [float(np.float32(1.0 / (s + 0.37))) for s in range(1, 30)],
    "losses (float64)": [math.log(50000) - s / 7.3 for s in range(30)],
    "ReduceLROnPlateau factor 0.5 from 1e-3": [1e-3 * 0.5**k for k in range(12)],
    "StepLR gamma 0.5 from 1e-4, 9 steps (all short)": _steplr(1e-4, 0.5, 9),
    "verl total_tokens(B), 40960 a step": [s * 40960 / 1e9 for s in range(1, 7)],
    "verl total_tokens(B), 262144 a step": [s * 262144 / 1e9 for s in range(1, 60)],
    "tokens(B) of unpadded batches": [
        sum(40000 + 37 * k for k in range(s)) / 1e9 for s in range(1, 30)
    ],  # fmt: skip
}


@pytest.mark.parametrize("values", list(FULL_LOGS.values()), ids=list(FULL_LOGS))
def test_real_full_precision_logs_are_not_read_as_rounded(values):
    assert rounded_places(np.array(values)) is None, [repr(v) for v in values]
    assert written_rounding(np.array(values)) is None, [repr(v) for v in values]


def test_a_mean_logged_too_few_times_cannot_be_told_from_a_rounding():
    """Below MEAN_EVIDENCE distinct values a mean over 40 samples is read as rounded: the safe
    side (imprecise, never a false aligned); so is a lone 4-digit constant."""
    means = [100 + k / 40 for k in range(1, 40, 7)]
    assert len(set(means)) < MEAN_EVIDENCE and rounded_places(np.array(means)) == 3
    assert rounded_places(np.array([0.06561] * 5)) == 5


def test_a_csv_log_reads_full_or_rounded_as_written(tmp_path):
    """Through a reader: the same losses written in full (repr) and with `%.4f`."""
    losses = [2.0 + math.sin(s) / 3 for s in range(1, 20)]
    means = [s * 7 / 40 for s in range(1, 20)]  # a mean over 40 samples, in full
    full, short = tmp_path / "full.csv", tmp_path / "short.csv"
    rows = zip(range(1, 20), losses, means, strict=True)
    full.write_text("step,loss,acc\n" + "".join(f"{s},{x!r},{m!r}\n" for s, x, m in rows))
    short.write_text("step,loss\n" + "".join(f"{s},{x:.4f}\n" for s, x in enumerate(losses, 1)))
    assert read_metrics(full).attrs["precision"] == {"acc": "float64", "loss": "float64"}
    assert read_metrics(short).attrs["precision"] == {"loss": "decimals:4"}


# --- a spike past 1e9 -----------------------------------------------------------------------------


def test_a_spike_past_1e9_does_not_hide_the_rounding(tmp_path):
    """One grad_norm of 2.5e9 among `.4f` values: the spike is left out of the decimals test,
    not a reason to give it up (it read as float64, and an exact policy said "aligned")."""
    norms = [1.1003 + 0.1314 * s for s in range(12)]
    norms[6] = 2500000000.1235
    values = np.array([float(f"{x:.4f}") for x in norms])
    assert rounded_places(values) == 4
    path = tmp_path / "spike.csv"
    path.write_text("step,grad_norm\n" + "".join(f"{s},{x:.4f}\n" for s, x in enumerate(norms)))
    assert read_metrics(path).attrs["precision"] == {"grad_norm": "decimals:4"}
    assert rounded_places(np.array([2500000000.1235, 3e9])) is None  # nothing below: as written


# --- significant digits: %g, %.5g, {:.6e} ---------------------------------------------------------


def _metric(s: int) -> float:
    """A value from 2.6 down to about 0.5, over three decades (an lr, a grad norm, a KL): its
    repr has 15-17 digits, and at 4 significant digits 0.001928 has 6 decimals."""
    return (2.6 * math.exp(-0.15 * s) + s / 997) * 10.0 ** -(s % 3)


@pytest.mark.parametrize(
    ("spec", "digits"), [("g", 6), (".6g", 6), (".5g", 5), (".4g", 4), (".6e", 7), (".7g", 7)]
)
def test_values_written_with_significant_digits_are_read_as_rounded(tmp_path, spec, digits):
    """`f"{x:g}"` keeps 6 significant digits: 0.916859 has 6 decimals, past the decimals rule,
    and read as float64 it let an exact policy say "aligned" of two runs 1 ULP apart. (Values
    that all have 5 decimals or fewer are the decimals rule's: 2.23884 reads decimals:5.)"""
    values = [_metric(s) for s in range(12)]
    written = [float(f"{x:{spec}}") for x in values]
    assert written_rounding(np.array(written)) == f"digits:{digits}"
    path = tmp_path / "loss.csv"
    path.write_text("step,loss\n" + "".join(f"{s},{x:{spec}}\n" for s, x in enumerate(values)))
    assert read_metrics(path).attrs["precision"] == {"loss": f"digits:{digits}"}
    assert precision_problem(f"digits:{digits}") is None


def test_a_g_schedule_whose_warmup_values_are_short_is_read_as_rounded():
    """An lr warmed up to 3e-4 over 10 steps, then a cosine to 1e-4, written with `%g`: the
    warmup's 3e-05, 6e-05 lie a decade below the cosine's 0.000299918 and have fewer places,
    but they are short: no sign of a count scaled by a power of ten, and the column is read at
    its 6 significant digits (it read in full: two schedules 3e-8 apart were "aligned")."""
    warmup = [3e-4 * s / 10 for s in range(1, 11)]
    cosine = [1e-4 + 1e-4 * (1 + math.cos(math.pi * s / 40)) for s in range(40)]
    written = [float(f"{x:g}") for x in warmup + cosine]
    assert written_rounding(np.array(written)) == "digits:6"


def test_significant_digits_of_a_repr():
    values = (2.6, 0.000123, 2.5e9, 0.1 + 0.2, 0.0, -1.5e-7)
    assert [significant_digits(x) for x in values] == [2, 3, 2, 17, 0, 2]


def test_a_column_of_short_decimals_stays_the_decimals_rule():
    """123.45 (a mean over 20 samples) is no rounding by the decimals rule, and the digits rule
    does not get to call it one: it has 5 significant digits, but 2 decimals."""
    means = [100 + k / 20 for k in range(1, 400, 7)]
    assert written_rounding(np.array(means)) is None
    assert written_rounding(np.array([2.6, 2.23884, 1.92813])) == "decimals:5"  # `{x:g}` in [1, 10)


@PROPERTY
@given(st.lists(float64_values, min_size=1, max_size=40))
def test_computed_float64_values_are_never_read_as_rounded_to_digits(values):
    assert written_rounding(np.array([float(repr(x)) for x in values])) is None


@PROPERTY
@given(st.lists(float32_values, min_size=1, max_size=40))
def test_float32_item_values_are_never_read_as_rounded_to_digits(values):
    """A float32's `.item()` is a float64 whose repr has 8 digits or more, unless it is a short
    binary fraction: never a witness."""
    assert written_rounding(np.array(values)) is None


FLOAT32_RANGES = ((0.1, 1.0), (1.0, 3.0), (3.0, 10.0), (10.0, 100.0))


@pytest.mark.parametrize(("low", "high"), FLOAT32_RANGES)
def test_float32_columns_in_their_own_shortest_repr_are_not_read_as_rounded(tmp_path, low, high):
    """pandas' to_csv writes a float32 column in float32's shortest repr (0.5118216): at most
    7 significant digits for 2 to 6 values in 10. 200 columns of 20 values each (fixed seed)
    read as written: float64, not digits:7 (nor 6)."""
    rng = np.random.default_rng(7)
    table = pd.DataFrame(
        {f"m{j:03d}": rng.uniform(low, high, 20).astype(np.float32) for j in range(200)},
        index=pd.RangeIndex(1, 21, name="step"),
    )
    path = tmp_path / "f32.csv"
    table.to_csv(path)
    assert path.read_text().splitlines()[1].split(",")[1] == str(table.iloc[0, 0])  # shortest
    precision = read_metrics(path).attrs["precision"]
    assert set(precision.values()) == {"float64"}, {
        k: p for k, p in precision.items() if p != "float64"
    }


def test_seven_digits_take_mean_evidence():
    """At 7 digits a short column may be float32s in their shortest repr: rounded only with
    MEAN_EVIDENCE distinct non-integers; at 6 digits or fewer, with any number."""
    seven = [1.234567 + k / 1000 for k in range(MEAN_EVIDENCE)]
    seven = [float(f"{x:.7g}") for x in seven]
    assert max(significant_digits(x) for x in seven) == 7
    assert rounded_digits(np.array(seven[:-1])) is None
    assert rounded_digits(np.array(seven)) == 7
    assert rounded_digits(np.array([0.916859])) == 6
    assert rounded_digits(np.array([0.984375, 0.015625])) is None  # means over 64: no witness


@pytest.mark.parametrize("spec", ["g", ".4f"])
def test_two_rounded_runs_one_ulp_apart_are_imprecise_through_the_cli(tmp_path, spec, capsys):
    """The probe's pair: a loss 1 ULP apart at step 3, written with `{x:g}` (or `.4f`, beside
    a grad_norm spike past 1e9): exit 5 under the default exact policy, never 0."""
    from parity.cli import main

    for side in ("a", "b"):
        losses = [_metric(s) for s in range(12)]
        if side == "b":
            losses[2] = math.nextafter(losses[2], math.inf)
        norms = [1.1003 + 0.1314 * s for s in range(12)]
        norms[6] = 2500000000.1235
        pairs = enumerate(zip(losses, norms, strict=True))
        rows = "".join(f"{s},{x:{spec}},{g:.4f}\n" for s, (x, g) in pairs)
        (tmp_path / f"{side}.csv").write_text("step,loss,grad_norm\n" + rows)
    assert main(["compare", str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]) == 5
    out = capsys.readouterr().out
    assert "verdict: imprecise (2 imprecise)" in out


MIXED = (
    st.decimals(-100, 100, places=4, allow_nan=False, allow_infinity=False).map(float)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0.916859, 2.23884, 1.5e-7, 2500000000.1235, 0.1, 0.3125])
    | float32_values
)


@PROPERTY
@given(st.lists(MIXED, min_size=1, max_size=40), st.integers(1, 40))
def test_a_head_written_in_full_rules_out_every_rounding(values, k):
    """frame.written_in_full: what a reader may skip asking written_rounding on, from a
    column's first k values; then the whole column reads as written, whatever follows."""
    x = np.array(values)
    if written_in_full(x[:k]):
        assert written_rounding(x) is None
