"""compare: ULP distance, policies, and the verdict on two runs' metrics."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from parity.judge.compare import (
    ULP_MAX,
    IncompleteRunError,
    NothingComparedError,
    Policy,
    compare_frames,
    default_policy,
    ulp_distance,
)
from parity.readers import read_metrics
from tests.judge.frames import frame

finite = st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=True)
anyfloat = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True)


edgy = st.sampled_from([0.0, -0.0, 1.0, -1.0, 5e-324, math.nan, math.inf, -math.inf]) | anyfloat


def bits(x: float) -> int:
    return int(np.float64(x).view(np.uint64))


@settings(max_examples=300, deadline=None)
@given(a=anyfloat, b=anyfloat)
def test_ulp_symmetric_and_zero_iff_same_bits(a, b):
    d = int(ulp_distance(a, b))
    assert d == int(ulp_distance(b, a))
    if math.isnan(a) or math.isnan(b):
        assert d == (0 if math.isnan(a) and math.isnan(b) else ULP_MAX)
    else:
        # ±0 are one point on the ULP line; otherwise 0 exactly when the bits are equal
        assert (d == 0) == (bits(a) == bits(b) or a == b == 0)


@settings(max_examples=300, deadline=None)
@given(x=finite, direction=st.sampled_from([math.inf, -math.inf]))
def test_ulp_neighbour_is_one(x, direction):
    with np.errstate(over="ignore"):
        y = float(np.nextafter(x, direction))
    if math.isinf(y):
        assert ulp_distance(x, y) == ULP_MAX  # an infinity is not a neighbour of anything
    elif x == y == 0:  # nextafter(-0.0, +inf) is 5e-324, never +0.0
        raise AssertionError("unreachable")
    else:
        assert ulp_distance(x, y) == 1


@settings(max_examples=200, deadline=None)
@given(xs=st.lists(finite, min_size=3, max_size=3))
def test_ulp_adds_up_along_the_line(xs):
    a, b, c = sorted(xs)
    assert int(ulp_distance(a, c)) == int(ulp_distance(a, b)) + int(ulp_distance(b, c))


def test_ulp_across_zero_and_specials():
    assert ulp_distance(-5e-324, 5e-324) == 2
    assert ulp_distance(-0.0, 0.0) == 0
    assert ulp_distance(0.0, 5e-324) == 1 and ulp_distance(-0.0, 5e-324) == 1
    assert ulp_distance(np.inf, np.inf) == 0 and ulp_distance(-np.inf, np.inf) == ULP_MAX
    assert ulp_distance(np.inf, 1.7976931348623157e308) == ULP_MAX
    got = ulp_distance(np.array([1.0, np.nan, np.nan]), np.array([1.0, np.nan, 2.0]))
    assert got.dtype == np.uint64 and list(got) == [0, 0, ULP_MAX]


policies = st.one_of(
    st.just(Policy("exact")),
    st.just(Policy("ignore")),
    st.builds(Policy, st.just("ulp"), ulp=st.integers(0, 10**6)),
    st.builds(
        Policy,
        st.just("close"),
        rtol=st.floats(0, 1e3, allow_subnormal=True),
        atol=st.floats(0, 1e3, allow_subnormal=True),
    ),
)


@given(policies)
def test_policy_text_round_trips(policy):
    assert Policy.parse(str(policy)) == policy


def test_policy_parse():
    assert Policy.parse("ulp:4") == Policy("ulp", ulp=4)
    assert Policy.parse(" close:1e-5,1e-8 ") == Policy("close", rtol=1e-5, atol=1e-8)
    assert Policy.parse("close:1e-5") == Policy("close", rtol=1e-5)
    assert str(Policy.parse("close:1e-5,1e-8")) == "close:1e-05,1e-08"
    bad_texts = ["", "exactly", "ulp", "ulp:", "ulp:-1", "ulp:1.5", "close", "close:a,b"]
    for bad in [*bad_texts, "close:1,2,3", "close:-1", "close:nan", "ignore:3", "exact:0"]:
        with pytest.raises(ValueError, match=f"bad policy {bad!r}"):
            Policy.parse(bad)


def test_default_policy():
    for name in ["train/mfu", "timing_s/gen", "perf/throughput", "train/step_time", "x/tps"]:
        assert default_policy(name).kind == "ignore"
    for name in ["train/loss", "train/grad_norm", "train/lr", "val/loss", "train/global_tokens"]:
        assert default_policy(name).kind == "exact"


def test_exact_nan_and_signed_zero():
    a = frame({"x": [np.nan, 1.0, 0.0], "y": [1.0, 2.0, 3.0]})
    b = frame({"x": [np.nan, 1.0, -0.0], "y": [1.0, np.nan, 3.0]})
    c = compare_frames(a, b)
    assert c.verdict == "diverged" and not c.ok
    x, y = c.metrics["x"], c.metrics["y"]
    assert x.status == "diverged" and x.first_divergent_step == 3 and x.exact_matches == 2
    assert "sign of zero differs at step 3" in x.note and x.max_ulp == 0
    assert y.status == "diverged" and y.first_divergent_step == 2 and y.max_ulp == ULP_MAX
    assert math.isnan(y.b_value) and y.max_abs_diff == math.inf
    assert compare_frames(a, b, {"x": "ulp:0", "y": "ignore"}).ok  # ±0 is 0 ULP apart


def test_ulp_and_close_policies():
    a = frame({"x": [1.0, 2.0], "y": [100.0, 1.0]})
    b = frame({"x": [float(np.nextafter(1.0, 2.0)), 2.0], "y": [100.001, 1.0]})
    assert not compare_frames(a, b, {"x": "exact", "y": "ignore"}).ok
    assert compare_frames(a, b, {"x": "ulp:1", "y": "close:1e-5,0"}).ok
    c = compare_frames(a, b, {"x": "ulp:1", "y": "close:1e-6,0"})
    assert c.metrics["y"].status == "diverged" and c.metrics["y"].first_divergent_step == 1
    assert c.metrics["y"].max_rel_diff == pytest.approx(1e-5, rel=1e-3)


def test_glob_policies_and_precedence():
    a = frame({"val/loss": [1.0], "val/acc": [0.5], "train/mfu": [0.3]})
    b = frame({"val/loss": [2.0], "val/acc": [0.6], "train/mfu": [0.4]})
    with pytest.raises(NothingComparedError, match="every metric is ignored"):
        compare_frames(a, b, {"val/*": "ignore"})  # train/mfu is noise: nothing left to judge
    c = compare_frames(a, b, {"val/*": "ignore"}, allow_nothing_compared=True)
    assert c.ok and c.metrics["val/acc"].status == "ignored"
    c = compare_frames(a, b, {"val/*": "ignore", "val/loss": "exact"})  # name beats glob
    assert [m.name for m in c.failures] == ["val/loss"]
    c = compare_frames(a, b, {"val/*": "ignore", "*mfu*": "close:0,0.2"})  # glob beats default
    assert c.ok and c.metrics["train/mfu"].status == "match"
    with pytest.raises(ValueError, match="bad policy 'ulp:x'"):
        compare_frames(a, b, {"nothing/*": "ulp:x"})


def test_missing_metric_and_step():
    a = frame({"x": [1.0, 2.0, 3.0], "y": [1.0, 1.0, 1.0]})
    b = frame({"x": [1.0, 2.0]})
    c = compare_frames(a, b)
    assert c.verdict == "diverged" and c.steps_only_in_a == [3]
    assert c.metrics["y"].status == "missing" and c.metrics["y"].missing_in_b == [1, 2, 3]
    assert c.metrics["x"].status == "missing" and c.metrics["x"].missing_in_b == [3]
    assert c.metrics["x"].steps_compared == 2
    assert compare_frames(a, b, allow_missing=True).verdict == "aligned"
    b2 = frame({"x": [1.0, 2.5]})
    assert compare_frames(a, b2, allow_missing=True).metrics["x"].status == "diverged"


def test_present_nan_versus_absent(tmp_path):
    """A logged NaN is a value; an absent cell is missing, though both read as NaN."""
    pa, pb = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    pa.write_text('{"step": 1, "x": NaN}\n{"event": "end", "steps": 1}\n')
    pb.write_text('{"step": 1, "y": 1.0}\n{"event": "end", "steps": 1}\n')
    c = compare_frames(read_metrics(pa), read_metrics(pb))
    assert c.metrics["x"].status == "missing" and c.metrics["x"].missing_in_b == [1]
    assert compare_frames(read_metrics(pa), read_metrics(pa)).ok


def test_incomplete_run(tmp_path):
    """The error names the file, what the reader found and the CLI's flag, on one line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n')
    f = read_metrics(tmp_path)
    with pytest.raises(IncompleteRunError) as e:
        compare_frames(f, f)
    assert str(e.value) == (
        f"{path}: run is incomplete (no end record); --allow-incomplete to compare anyway"
    )
    assert compare_frames(f, f, allow_incomplete=True).ok
    f.attrs["incomplete"] = "status RUNNING"  # what MLflow's reader found
    with pytest.raises(IncompleteRunError, match=r"incomplete \(status RUNNING\); --allow-"):
        compare_frames(f, f)


KEYS = ["train/loss", "train/grad_norm", "train/lr", "train/global_tokens",
        "train/total_tokens(B)", "train/mfu"]  # fmt: skip


def console_log(rows: list[dict[str, float]], reverse: bool) -> str:
    lines = ["(TaskRunner pid=4242) INFO: starting training", "Training Progress: 0%|"]
    for step, row in enumerate(rows, 1):
        keys = [k for k in KEYS if k in row]
        keys = keys[::-1] if reverse else keys
        line = " - ".join(f"{k}:{row[k]!r}" for k in keys)
        lines.append(f"(TaskRunner pid=4242) step:{step} - {line}")
        if "val/loss" in row:
            lines.append(f"(TaskRunner pid=4242) step:{step} - val/loss:{row['val/loss']!r}")
    lines.append("(TaskRunner pid=4242) Training finished")
    return "\n".join(lines) + "\n"


def runs(n: int = 6) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    rng = np.random.default_rng(0)
    a = []
    for step in range(1, n + 1):
        a.append(
            {
                "train/loss": float(rng.uniform(1, 3)),
                "train/grad_norm": float(rng.uniform(0.1, 5)),
                "train/lr": 1e-05 * step / n,
                "train/global_tokens": float(step * 40960),
                "train/total_tokens(B)": step * 40960 / 1e9,
                "train/mfu": float(rng.uniform(0.2, 0.5)),
            }
        )
    a[-1]["val/loss"] = 1.2345678901234567
    b = [dict(row, **{"train/mfu": row["train/mfu"] * 1.1}) for row in a]
    return a, b


def test_headline_verl_console_logs(tmp_path):
    rows_a, rows_b = runs()
    pa, pb = tmp_path / "a.log", tmp_path / "b.log"
    pa.write_text(console_log(rows_a, reverse=False))
    pb.write_text(console_log(rows_b, reverse=True))
    c = compare_frames(read_metrics(pa), read_metrics(pb))
    assert c.verdict == "aligned", c.table()
    assert c.metrics["train/mfu"].status == "ignored"
    assert c.metrics["val/loss"].steps_compared == 1
    assert all(m.status == "match" for n, m in c.metrics.items() if n != "train/mfu")

    k = 4
    rows_b[k - 1]["train/grad_norm"] = float(np.nextafter(rows_b[k - 1]["train/grad_norm"], 9.0))
    pb.write_text(console_log(rows_b, reverse=True))
    c = compare_frames(read_metrics(pa), read_metrics(pb))
    assert c.verdict == "diverged"
    assert [m.name for m in c.failures] == ["train/grad_norm"]
    g = c.metrics["train/grad_norm"]
    assert g.first_divergent_step == k and g.max_ulp == 1 and g.max_ulp_step == k
    assert g.a_value == rows_a[k - 1]["train/grad_norm"]
    assert g.b_value == rows_b[k - 1]["train/grad_norm"] and g.divergent_steps == 1

    table = c.table()
    first_row = table.splitlines()[2]
    assert first_row.startswith("train/grad_norm") and f" {k} " in first_row
    assert repr(g.a_value) in first_row and repr(g.b_value) in first_row
    assert "diverged" in table.splitlines()[0]

    text = json.dumps(c.to_dict(), allow_nan=False)
    back = json.loads(text)
    assert back["verdict"] == "diverged"
    assert back["metrics"]["train/grad_norm"]["first_divergent_step"] == k
    assert back["metrics"]["train/grad_norm"]["max_ulp"] == 1


def test_to_dict_with_non_finite_values_is_strict_json():
    a = frame({"x": [np.nan, np.inf, 1.0]})
    b = frame({"x": [1.0, -np.inf, 1.0]})
    d = compare_frames(a, b).to_dict()
    text = json.dumps(d, allow_nan=False)
    assert '"a_value": "nan"' in text and '"max_abs_diff": "inf"' in text
    assert d["metrics"]["x"]["max_ulp"] == ULP_MAX


def test_table_truncates_and_puts_failures_first():
    data = {f"m{i:02d}": [1.0] for i in range(30)}
    a, b = frame(data), frame(dict(data, m29=[2.0]))
    table = compare_frames(a, b).table(max_rows=5)
    lines = table.splitlines()
    assert lines[2].startswith("m29") and "diverged" in lines[2]
    assert lines[-1].startswith("... 25 more metrics")


# --- policies that change with the step ----------------------------------------------------------


def _up(x: float, n: int) -> float:
    for _ in range(n):
        x = math.nextafter(x, math.inf)
    return x


def test_step_policy_parse_and_text():
    p = Policy.parse("exact@-3,ulp:4@4-")
    assert p.kind == "steps" and str(p) == "exact@-3,ulp:4@4-"
    assert [p.piece_at(s) for s in (0, 3, 4, 10**9)] == ["exact@-3"] * 2 + ["ulp:4@4-"] * 2
    for text in ["close:1e-5,1e-8@1-5,ulp:4", "ignore@0,exact", "ulp:3@7", "ulp:1@2-4, exact@5"]:
        assert Policy.parse(str(Policy.parse(text))) == Policy.parse(text)
    assert str(Policy.parse("close:1e-5,1e-8@1-5,ulp:4")) == "close:1e-05,1e-08@1-5,ulp:4"
    assert Policy.parse("ulp:3@7").piece_at(6) == "exact (no range holds the step)"
    bad = {
        "exact@1-5,ulp:4@5-": "overlap",
        "exact@x": "is not N, A-B, A- or -B",
        "exact@-": "is not N",
        "exact,ulp:3": "more than one piece without a step range",
        "exact@5-3": "empty step range",
        "ulp@3": "expected exact",
        "exact@1-5,ulp:4@6-@7": "is not N",
        "exact@-2,ulp@3-": "expected exact",
    }
    for text, why in bad.items():
        with pytest.raises(ValueError, match=f"^bad policy {text!r}: .*{why}"):
            Policy.parse(text)


def test_step_policy_judges_each_step_by_its_piece():
    a = frame({"x": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]})
    two_late = frame({"x": [1.0, 2.0, 3.0, _up(4.0, 2), 5.0, _up(6.0, 4)]})
    assert compare_frames(a, two_late, {"x": "exact@-3,ulp:4@4-"}).ok
    early = frame({"x": [1.0, _up(2.0, 1), 3.0, 4.0, 5.0, 6.0]})
    c = compare_frames(a, early, {"x": "exact@-3,ulp:4@4-"})
    x = c.metrics["x"]
    assert x.status == "diverged" and x.first_divergent_step == 2
    assert x.first_divergent_policy == "exact@-3" and x.policy == "exact@-3,ulp:4@4-"
    assert (
        "step 2 judged exact@-3" in c.table()
        and c.to_dict()["metrics"]["x"]["first_divergent_policy"] == "exact@-3"
    )
    late = frame({"x": [1.0, 2.0, 3.0, 4.0, _up(5.0, 5), 6.0]})
    x = compare_frames(a, late, {"x": "exact@-3,ulp:4@4-"}).metrics["x"]
    assert x.first_divergent_step == 5 and x.first_divergent_policy == "ulp:4@4-"
    assert x.divergent_steps == 1 and x.max_ulp == 5
    # steps no range holds are exact; a fallback piece judges them instead; ignore pieces skip
    assert not compare_frames(a, early, {"x": "ulp:9@4-"}).ok
    assert compare_frames(a, early, {"x": "ulp:9@4-,ulp:1"}).ok
    assert compare_frames(a, early, {"x": "ignore@2,exact"}).ok
    assert (
        compare_frames(a, a, {"x": "exact@1-5,ulp:4@6-"}).metrics["x"].first_divergent_policy
        is None
    )
    assert compare_frames(a, early).metrics["x"].first_divergent_policy == "exact"


def test_step_policy_is_vectorised_over_many_steps():
    n = 200_000
    x = np.linspace(1.0, 2.0, n)
    y = x.copy()
    y[n // 2 :] = np.nextafter(y[n // 2 :], np.inf)  # one ULP from the middle on
    index = pd.RangeIndex(1, n + 1, name="step")
    fa, fb = (pd.DataFrame({"m": v}, index=index) for v in (x, y))
    for f in (fa, fb):
        f.attrs["present"] = f.notna()
    pieces = ",".join(f"exact@{i * 1000 + 1}-{(i + 1) * 1000}" for i in range(n // 2000))
    policy = f"{pieces},ulp:1@{n // 2 + 1}-,ulp:0"
    c = compare_frames(fa, fb, {"m": policy})
    assert c.ok, c.table()
    c = compare_frames(fa, fb, {"m": f"{pieces},exact@{n // 2 + 1}-,ulp:0"})
    assert c.metrics["m"].first_divergent_step == n // 2 + 1


def test_step_policies_on_the_command_line_and_in_a_spec(tmp_path, capsys):
    from parity.cli import main
    from parity.spec import SpecError, load_policies, load_spec

    rows = [{"step": s, "train/loss": 1.0 / s} for s in (1, 2, 3)]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    end = '{"event": "end", "steps": 3}\n'
    a.write_text("".join(json.dumps(r) + "\n" for r in rows) + end)
    rows[2]["train/loss"] = math.nextafter(1.0 / 3, 1.0)
    b.write_text("".join(json.dumps(r) + "\n" for r in rows) + end)
    assert main(["compare", str(a), str(b), "--policy", "train/loss=exact@-2,ulp:1@3-"]) == 0
    capsys.readouterr()
    assert main(["compare", str(a), str(b), "--policy", "train/loss=ulp:1@-2,exact@3-"]) == 1
    assert "step 3 judged exact@3-" in capsys.readouterr().out
    assert main(["compare", str(a), str(b), "--policy", "train/loss=exact@-2,ulp:1@2-"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "overlap" in err

    spec = tmp_path / "job.toml"
    spec.write_text(
        'task = "custom"\ncommand = ["x.py"]\n[policies]\n"train/*" = "exact@-5,ulp:4@6-"\n'
    )
    assert load_policies(spec) == {"train/*": Policy.parse("exact@-5,ulp:4@6-")}
    assert load_spec(spec).command == ["x.py"]  # the policies table is not a job key
    spec.write_text('task = "custom"\ncommand = ["x.py"]\n[policies]\n"train/loss" = "ulp:x"\n')
    with pytest.raises(SpecError, match=r"job\.toml: policies\.'train/loss': bad policy 'ulp:x'"):
        load_policies(spec)


@settings(max_examples=300, deadline=None)
@given(pairs=st.lists(st.tuples(edgy, edgy | st.just(None)), max_size=8))  # None: b = a
@example(pairs=[(1.0, None), (0.0, -0.0)])  # differs only in the sign of zero: 0 at step 1
@example(pairs=[(1.0, 2.0), (0.0, -0.0), (3.0, 4.0)])  # the first of two largest
def test_largest_differences_are_the_full_arrays(pairs):
    """The distances, computed only where the bits differ, give what the whole arrays give:
    the first largest |a-b|, relative difference and ULP distance, and their steps."""
    a = np.array([x for x, _ in pairs], dtype=np.float64)
    b = np.array([x if y is None else y for x, y in pairs], dtype=np.float64)
    steps = pd.Index(np.arange(1, len(a) + 1), name="step")
    frames = [pd.DataFrame({"x": v}, index=steps) for v in (a, b)]
    for f in frames:  # a NaN is a value here, not a missing step
        f.attrs["present"] = pd.DataFrame({"x": True}, index=steps)
    if not len(a):
        return
    m = compare_frames(*frames).metrics["x"]
    same = (a.view(np.uint64) == b.view(np.uint64)) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore", over="ignore"):
        absd = np.where(same, 0.0, np.abs(a - b))
        absd = np.where(np.isnan(absd), np.inf, absd)
        reld = np.where(absd == 0, 0.0, absd / np.maximum(np.abs(a), np.abs(b)))
        reld = np.where(np.isnan(reld), np.inf, reld)
    ulp = ulp_distance(a, b, np.dtype(m.ulp_dtype).type)  # float32 when every value is one
    for got, step, want in (
        (m.max_abs_diff, m.max_abs_diff_step, absd),
        (m.max_rel_diff, m.max_rel_diff_step, reld),
        (m.max_ulp, m.max_ulp_step, ulp),
    ):
        assert got == want.max() and step == int(np.argmax(want)) + 1


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("perf/max_memory_allocated_gb", "ignore"),  # verl
        ("mem-allocated-bytes", "ignore"),  # Megatron
        ("iteration-time", "ignore"),
        ("train/train_samples_per_second", "ignore"),  # HF
        ("train_runtime", "ignore"),
        ("tps", "ignore"),  # torchtitan
        ("wps", "ignore"),
        ("tflops", "ignore"),
        ("mfu(%)", "ignore"),
        ("memory/max_reserved(GiB)", "ignore"),
        ("perf/throughput", "ignore"),
        ("timing_s/step", "ignore"),
        ("tokens/s", "ignore"),
        ("train/loss", "exact"),
        ("train/grad_norm", "exact"),
        ("response_length/outputs", "exact"),  # holds "tps", but is not a rate
        ("lm loss", "exact"),
        ("num-zeros", "exact"),
        ("train/global_tokens", "exact"),
        ("train/total_flos", "exact"),
        ("train/samples_per_sec", "ignore"),  # Lightning's ThroughputMonitor
        ("device/batches_per_sec", "ignore"),
        ("allocated_bytes.all.current", "ignore"),  # Lightning's DeviceStatsMonitor
        ("perf/total_num_tokens", "exact"),  # verl: a counter among the perf/ noise
        ("perf/tokens_per_s", "ignore"),
    ],
)
def test_default_policy_ignores_the_stacks_noise_keys(name, kind):
    assert default_policy(name).kind == kind


def test_precision_judges_at_the_coarser_source():
    """A float32 log is judged in float32 bits and ULPs; a rounded one after rounding."""
    x = 0.1 + 2**-40  # float64 that rounds to float32(0.1)
    a, b = frame({"m": [x, 0.25]}), frame({"m": [float(np.float32(0.1)), 0.25]})
    strict = compare_frames(a, b)
    assert not strict.ok and strict.metrics["m"].precision == "float64"
    b.attrs["precision"] = {"m": "float32"}
    c = compare_frames(a, b)
    assert c.ok and c.metrics["m"].precision == "float32" and "judged at float32" in c.table()
    b.loc[2, "m"] = float(np.nextafter(np.float32(0.25), np.float32(1)))
    one = compare_frames(a, b).metrics["m"]
    assert one.first_divergent_step == 2 and one.max_ulp == 1  # one float32 ULP
    r = frame({"m": [10.123456, 2.0]})
    r.attrs["precision"] = {"m": "decimals:5"}
    assert compare_frames(frame({"m": [10.1234649, 2.0]}), r).verdict == "imprecise"
    assert compare_frames(frame({"m": [10.1234649, 2.0]}), r, at_source_precision=True).ok
    d = compare_frames(frame({"m": [10.1234651, 2.0]}), r).metrics["m"]
    assert d.first_divergent_step == 1 and "judged at 5 decimals" in d.note


def test_significant_digits_are_a_rounding():
    """A `%g` log (digits:6) is rounded like a `.4f` one: exact gives imprecise, the user's
    --at-source-precision "aligned at 6 significant digits", and a difference at the 6th digit
    is still one."""
    from parity.readers.frame import coarser

    assert coarser("digits:6", "float64") == "digits:6"
    assert coarser("digits:6", "digits:5") == "digits:5"
    assert coarser("float32", "decimals:4,digits:6") == "float32,decimals:4,digits:6"
    assert coarser("digits:7", "float32,decimals:3") == "float32,decimals:3,digits:7"
    full = frame({"m": [0.9168594128, 2.23884, 1.5e-7]})
    g = frame({"m": [0.916859, 2.23884, 1.5e-7]})
    g.attrs["precision"] = {"m": "digits:6"}
    c = compare_frames(full, g)
    assert c.verdict == "imprecise" and c.metrics["m"].precision == "digits:6"
    assert "source holds 6 significant digits" in c.table()
    accepted = compare_frames(full, g, at_source_precision=True)
    assert accepted.ok and accepted.verdict_text() == "aligned at 6 significant digits"
    other = frame({"m": [0.916858, 2.23884, 1.5e-7]})
    d = compare_frames(other, g, at_source_precision=True).metrics["m"]
    assert d.first_divergent_step == 1 and "judged at 6 significant digits" in d.note


@pytest.mark.parametrize("policy", ["ulp:0", "close:0,0", "close:0", "ulp:3@9-,ulp:0"])
def test_a_zero_tolerance_is_exact_on_a_rounded_log(policy):
    """ulp:0 and close:0,0 tolerate nothing: on a rounded log they need the full value as
    exact does (imprecise), not "aligned at 4 decimals"; a real tolerance is the user's
    choice."""
    a, b = frame({"m": [2.3456, 1.0]}), frame({"m": [2.3456, 1.0]})
    b.attrs["precision"] = {"m": "decimals:4"}
    assert compare_frames(a, b, {"m": "exact"}).verdict == "imprecise"
    assert compare_frames(a, b, {"m": policy}).verdict == "imprecise"
    assert compare_frames(a, b, {"m": policy}, at_source_precision=True).ok
    assert compare_frames(a, b, {"m": "ulp:1"}).verdict_text() == "aligned at 4 decimals"
    assert compare_frames(a, b, {"m": "close:0,1e-9"}).ok


def test_float32_against_decimals_applies_both():
    """At a million, float32 is coarser than 3 decimals; near 1, 3 decimals are coarser."""
    from parity.readers.frame import coarser

    assert coarser("float32", "decimals:3") == "float32,decimals:3"
    assert coarser("float64", "decimals:5") == "decimals:5"
    assert coarser("float32,decimals:4", "decimals:2") == "float32,decimals:2"
    assert coarser("float64", "float64") == "float64"
    state = frame({"m": [1234567.123, 0.1234]})  # trainer_state.json: rounded to 3 decimals
    state.attrs["precision"] = {"m": "decimals:3"}
    tb = frame({"m": [float(np.float32(1234567.123)), float(np.float32(0.1234))]})
    tb.attrs["precision"] = {"m": "float32"}
    c = compare_frames(state, tb, at_source_precision=True)
    assert c.ok and c.metrics["m"].precision == "float32,decimals:3"
    assert "judged at float32 and 3 decimals" in c.table()


# --- default noise policies: exact name segments, not substrings ---------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "perf/mfu/actor",  # verl
        "perf/max_memory_reserved_gb",
        "perf/cpu_memory_used_gb",
        "perf/time_per_step",
        "perf.mfu",  # W&B joins nested keys with "."
        "timing_s/rollout",
        "timing_per_token_ms/gen",
        "train/device/mfu",  # Lightning's ThroughputMonitor
        "train/device/flops_per_sec",
        "train/time",
        "DeviceStatsMonitor.on_train_batch_start/allocated_bytes.all.current",  # Lightning
        "active_bytes.all.peak",
        "eval/runtime",  # HF
        "eval/samples_per_second",
        "train/train_tokens_per_second",
        "train_step_timing in s",  # NeMo
        "TFLOPS_per_GPU",
        "time_metrics/end_to_end(s)",  # torchtitan
        "memory/max_active(GiB)",
        "throughput(tps)",
        "mem-max-allocated-bytes",  # Megatron
        "system/gpu_0_memory_usage_megabytes",  # MLflow
        "_runtime",  # W&B's own keys
        "_timestamp",
        "samples/s",
        "train/elapsed",
    ],
)
def test_default_policy_ignores_more_of_the_stacks_noise_keys(name):
    assert default_policy(name).kind == "ignore"


LOOK_ALIKES = [
    "eval/memorization",
    "rl/timestep_reward",
    "train/sometimes_nan_loss",
    "train/runtime_error_count",
    "train/timesteps",
    "train/times_clipped",
    "train/optimizer_steps",
    "eval/perfect_match",
    "perfect/score",
    "train/systematic_error",
    "train/memoryless_rate",
    "train/temperature",
    "train/mfu_loss",
    "train/flopsy",
    "response_length/outputs",
    "train/batches",  # Lightning's ThroughputMonitor counts: exact
    "train/samples",
    "train/total_tokens(B)",
    "perf.total_num_tokens",
]


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_names_that_only_look_like_noise_are_judged(name):
    assert default_policy(name).kind == "exact"


def test_look_alike_names_that_differ_diverge():
    """0.1 against 0.9 in a metric whose name merely holds "time", "mem", "perf"... fails."""
    a, b = frame(dict.fromkeys(LOOK_ALIKES, [0.1])), frame(dict.fromkeys(LOOK_ALIKES, [0.9]))
    c = compare_frames(a, b)
    assert c.verdict == "diverged"
    assert sorted(m.name for m in c.failures) == sorted(LOOK_ALIKES)


def test_every_noise_pattern_holds_a_search_keyword():
    """noise_mask only matches names that hold one of NOISE_KEYWORDS: every pattern must hold
    one in a literal piece, with either separator, "\\n" marking the end of the name."""
    import itertools
    import re as regex

    from parity.judge.policy import NOISE_KEYWORDS, NOISE_PATTERNS

    for pattern in NOISE_PATTERNS:
        group = pattern.endswith("/**")
        body = pattern[:-3] + "/" if group else pattern + "\n"
        seps = [i for i, c in enumerate(body) if c in "/."]
        for choice in itertools.product("/.", repeat=len(seps)):
            text = list(body)
            for i, c in zip(seps, choice, strict=True):
                text[i] = c
            pieces = regex.split(r"\*", "".join(text))
            assert any(k in p for k in NOISE_KEYWORDS for p in pieces), (pattern, choice)


def test_noise_of_many_names_at_once_is_noise_of_each():
    from parity.judge.policy import noise_mask

    names = [*LOOK_ALIKES, "perf/mfu", "x/tokens/s", "x.tokens.s", "a/tps", "A/TPS", "tps_x",
             "İ/time", "İtime", "ß/mfu", "new\nline/time", "train/loss", "perf/", ""]  # fmt: skip
    want = [default_policy(n).kind == "ignore" for n in names]
    assert noise_mask(names).tolist() == want
    assert noise_mask([n for n in names if "\n" not in n]).tolist() == [
        w for n, w in zip(names, want, strict=True) if "\n" not in n
    ]


# --- many metrics: arrays once, the same results -------------------------------------------------


def reference(a, b, policies=None, allow_missing=False):
    """The metric-by-metric comparison compare_frames made before it worked on whole arrays:
    each column read through pandas, each metric judged by _compare_metric."""
    from parity.judge.compare import _compare_metric, needs_full_value, resolve_policy
    from parity.judge.policy import parse_policies
    from parity.readers import present_mask
    from parity.readers.frame import FLOAT64, coarser

    steps_index = a.index.union(b.index).sort_values()
    steps = np.asarray(steps_index, dtype=np.int64)
    present = {
        side: present_mask(f).reindex(index=steps_index, fill_value=False).astype(bool)
        for side, f in (("a", a), ("b", b))
    }
    out = {}
    for name in sorted(set(map(str, a.columns)) | set(map(str, b.columns))):
        cols = {}
        for side, f in (("a", a), ("b", b)):
            if name in f.columns:
                values = f[name].reindex(steps_index).to_numpy(dtype=np.float64)
                cols[side] = (values, present[side][name].to_numpy())
            else:
                cols[side] = (None, np.zeros(len(steps), dtype=bool))
        precision = coarser(
            (a.attrs.get("precision") or {}).get(name, FLOAT64),
            (b.attrs.get("precision") or {}).get(name, FLOAT64),
        )
        policy = resolve_policy(name, parse_policies(policies))
        imprecise = "decimals:" in precision and needs_full_value(policy)
        args = (*cols["a"], *cols["b"], allow_missing, precision, imprecise)
        out[name] = _compare_metric(name, policy, steps, *args)
    return out


VALUES = [0.0, -0.0, 1.0, 1.0000000000000002, 0.1, np.nan, np.inf, -np.inf, 2.5, 1e300]


@st.composite
def frame_pairs(draw):
    """Two frames of a few metrics: shared and one-sided names and steps, NaN, ±0, inf, values
    1 ULP apart, absent cells, precisions and policies."""
    names = draw(st.lists(st.sampled_from(["m0", "m1", "m2", "t/time", "m3"]), unique=True))
    out = []
    for _ in "ab":
        steps = draw(st.lists(st.integers(0, 6), min_size=0, max_size=5, unique=True))
        cols = [n for n in names if draw(st.booleans()) or n == "m0"]
        shape = (len(steps), len(cols))
        cells = draw(st.lists(st.sampled_from(VALUES), min_size=shape[0] * shape[1],
                              max_size=shape[0] * shape[1]))  # fmt: skip
        f = pd.DataFrame(
            np.array(cells, dtype=np.float64).reshape(shape),
            index=pd.Index(sorted(steps), dtype=np.int64, name="step"),
            columns=cols,
        )
        has = draw(st.lists(st.booleans(), min_size=f.size, max_size=f.size))
        f.attrs["present"] = pd.DataFrame(
            np.array(has, dtype=bool).reshape(shape), index=f.index, columns=f.columns
        )
        f.attrs["precision"] = {
            c: draw(st.sampled_from(["float64", "float32", "decimals:3"])) for c in cols
        }
        out.append(f)
    if draw(st.booleans()):  # the same steps and metrics on both sides: the bulk path's case
        b = out[0].copy()
        b.attrs = dict(out[0].attrs)
        out[1] = b
    policies = draw(
        st.dictionaries(
            st.sampled_from(["m1", "m*", "t/*", "m3"]),
            st.sampled_from(["exact", "ulp:1", "close:1e-3,0", "ignore", "exact@-2,ulp:1@3-"]),
            max_size=2,
        )
    )
    return out[0], out[1], policies, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(frame_pairs())
def test_bulk_comparison_is_the_metric_by_metric_one(case):
    """Bit for bit the results of judging each metric on its own, whatever the frames hold."""
    from dataclasses import replace

    a, b, policies, allow_missing = case
    got = compare_frames(a, b, policies, allow_missing=allow_missing, allow_nothing_compared=True)
    want = replace(got, metrics=reference(a, b, policies, allow_missing))
    assert got.to_dict()["metrics"] == want.to_dict()["metrics"]
    assert list(got.metrics) == list(want.metrics)
    assert got.table() == want.table()
    assert [m.name for m in got.failures] == [m.name for m in want.failures]
    failed = any(not m.ok for m in want.metrics.values())  # imprecise is not ok either
    assert got.ok == (not failed and (allow_missing or not (got.steps_only_in_a or
                                                            got.steps_only_in_b)))  # fmt: skip


def test_results_read_like_a_dict():
    a = frame({"x": [1.0, 2.0], "y": [1.0, 1.0], "train/mfu": [0.1, 0.2]})
    b = frame({"x": [1.0, 2.5], "y": [1.0, 1.0], "train/mfu": [0.3, 0.4]})
    c = compare_frames(a, b)
    m = c.metrics
    assert len(m) == 3 and list(m) == ["train/mfu", "x", "y"] and "x" in m and "z" not in m
    assert m.get("z") is None and m["y"] is m["y"] and m["y"].status == "match"
    assert [r.name for r in m.values()] == list(m) and [k for k, _ in m.items()] == list(m)
    assert dict(m.items()) == reference(a, b) and m == reference(a, b)
    assert [r.name for r in c.failures] == ["x"] and m["train/mfu"].status == "ignored"
    with pytest.raises(KeyError):
        m["z"]
    import copy

    assert copy.deepcopy(c).to_dict() == c.to_dict()  # pickle's protocol: a pool can send it


class _CountCopies:
    """An attrs value that counts how often pandas deep-copies it."""

    copies = 0

    def __deepcopy__(self, memo):
        type(self).copies += 1
        return self


def test_compare_reads_the_frames_once_not_once_per_metric():
    """Selecting a column of a frame deep-copies its attrs (pandas' __finalize__), and read
    frames carry a present mask of their own size: per metric, that made compare quadratic."""
    data = {f"m{i:03d}": [1.0, 2.0] for i in range(200)}
    a, b = frame(data), frame(data)
    for f in (a, b):
        f.attrs["counter"] = _CountCopies()
    _CountCopies.copies = 0
    assert compare_frames(a, b).ok
    assert _CountCopies.copies <= 4  # not one per metric


# --- names from logs are data: one metric, one line ---------------------------------------------

EVIL = [
    "x\nverdict: aligned",
    "y\x1b[2K\x1b[1A",  # ANSI: erase the line, cursor up
    "z\r# parity: aligned",
    "w\x7f\x85\u2028\u202e",
]


def test_printable_escapes_control_characters():
    from parity.judge.compare import printable

    assert printable("train/loss") == "train/loss"
    assert printable("a\nb\rc\td") == "a\\nb\\rc\\td"
    assert printable("\x1b[2K\x00\x7f\x85\x9f") == "\\x1b[2K\\x00\\x7f\\x85\\x9f"
    assert printable("\u2028\u2029\u202e\u2066") == "\\u2028\\u2029\\u202e\\u2066"
    assert printable("héllo ü 損失") == "héllo ü 損失"


def test_table_shows_names_and_sources_with_control_characters_escaped():
    a, b = frame(dict.fromkeys(EVIL, [0.1])), frame(dict.fromkeys(EVIL, [0.9]))
    a.attrs.update(source="a.log\nverdict: aligned", format="jsonl", notes=["n\x1b[1A"])
    table = compare_frames(a, b).table()
    lines = table.splitlines()
    assert lines[0].startswith("verdict: diverged (4 diverged)")
    assert "a=a.log\\nverdict: aligned" in lines[0]
    assert sum(line.startswith("verdict:") for line in lines) == 1
    assert len(lines) == 2 + len(EVIL) + 2  # verdict, header, a row per metric, a's read lines
    assert not any(c in table for c in "\r\x1b\x7f\x85\u2028\u202e")
    for name in ("x\\nverdict: aligned", "y\\x1b[2K\\x1b[1A", "z\\r# parity: aligned"):
        assert any(line.startswith(name) for line in lines), name
    assert "a: note: n\\x1b[1A" in lines


def test_noise_floor_shows_names_printable():
    from parity.judge.noise import floor_from_frames

    a, again = frame(dict.fromkeys(EVIL, [1.0, 2.0])), frame(dict.fromkeys(EVIL, [1.0, 2.5]))
    floor = floor_from_frames(a, again)
    text = floor.table()
    assert "x\\nverdict: aligned" in floor.headline() and "\n" not in floor.headline()
    assert len(text.splitlines()) == 2 + len(EVIL) + 1  # headline, header, rows, the advice
    assert not any(c in text for c in "\r\x1b\x7f\x85\u2028\u202e")


def test_a_step_policy_that_ignores_every_step_compares_nothing():
    """`ignore@0-` (or `ignore@1,ignore`) on steps 1..N ignores the metric: nothing compared
    is no verdict, never "aligned" of runs that differ at every step; the steps a piece
    ignores are not counted as compared."""
    a, b = frame({"loss": [1.0, 2.0, 3.0]}), frame({"loss": [9.0, 8.0, 7.0]})
    for policy in ("ignore@0-", "ignore@1,ignore", "ignore@1-3"):
        with pytest.raises(NothingComparedError):
            compare_frames(a, b, {"loss": policy})
    partly = compare_frames(a, frame({"loss": [9.0, 8.0, 3.0]}), {"loss": "ignore@1-2"})
    assert partly.ok and partly.metrics["loss"].steps_compared == 1
    clean = compare_frames(a, a, {"loss": "ignore@-2"})  # equal everywhere: counted alike
    assert clean.ok and clean.metrics["loss"].steps_compared == 1


def test_no_ulp_tolerance_passes_nan_or_inf_against_a_number():
    """NaN and inf are ULP_MAX from any number: a tolerance of that many ULPs would pass them,
    so it is refused; one below it tells them apart."""
    with pytest.raises(ValueError, match="below"):
        Policy.parse(f"ulp:{ULP_MAX}")
    for other in (math.nan, math.inf):
        c = compare_frames(frame({"x": [0.4]}), frame({"x": [other]}), {"x": f"ulp:{ULP_MAX - 1}"})
        assert c.verdict == "diverged", other
