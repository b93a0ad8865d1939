"""W&B reader: runs written by the real wandb (offline) read bit for bit from their `.wandb` log;
hand-framed streams for the decoder; every damaged file a one-line MetricsError or a counted skip.
"""

import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.readers import MetricsError, detect, present_mask, read_metrics
from parity.readers.frame import ReadLog, ReadOptions
from parity.readers.wandb import CUT, MAGIC, read_log, records

ROOT = Path(__file__).resolve().parents[2]
EDGES = [0.0, -0.0, 5e-324, -5e-324, 1.7976931348623157e308, 0.1, 1 / 3, 1e21, 1e-7, 2.0**53]

# --- a test-side encoder: protobuf Records and wandb's LevelDB-log framing ---------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _ld(field: int, data: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def history_record(items: dict[str, str], step: int | None = None, num: int = 1) -> bytes:
    """Record{num, history{item{nested_key, value_json}..., step{num}}} as wandb 0.31 writes."""
    body = b"".join(_ld(1, _ld(2, k.encode()) + _ld(16, v.encode())) for k, v in items.items())
    if step is not None:
        body += _ld(2, _varint(1 << 3) + _varint(step) if step else b"")
    return _varint(1 << 3) + _varint(num) + _ld(2, body)


EXIT = _ld(18, b"")  # Record{exit{exit_code: 0}}


def frame_log(payloads: list[bytes]) -> bytes:
    """The LevelDB log wandb writes: 32 KiB blocks, chunks `crc len type data`, CRC-32 (IEEE)
    of type byte and data, a block's last < 7 bytes zero."""
    out = bytearray(MAGIC)
    for data in payloads:
        first = True
        while True:
            left = 32768 - len(out) % 32768
            if left < 7:
                out += bytes(left)
                continue
            room = left - 7
            part, data = data[:room], data[room:]
            last = not data
            kind = (1 if last else 2) if first else (4 if last else 3)
            crc = zlib.crc32(bytes([kind]) + part)
            out += struct.pack("<IHB", crc, len(part), kind) + part
            first = False
            if last:
                break
    return bytes(out)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    nan = np.isnan(a)
    return bool(
        (nan == np.isnan(b)).all() and (a[~nan].view(np.uint64) == b[~nan].view(np.uint64)).all()
    )


def one_line_naming(err: Exception, name: str) -> None:
    assert "\n" not in str(err) and name in str(err), str(err)


# --- runs written by the real wandb, all in one process ----------------------------------------

WRITER = r"""
import json, sys, wandb
spec = json.load(open(sys.argv[1]))
h = lambda x: float.fromhex(x)

def explicit(d):
    run = wandb.init(project="p", mode="offline", dir=d, id="explicit1")
    for i, (step, a, b) in enumerate(spec["explicit"]):
        row = {"m/a": h(a), "m/b": h(b), "nan": float("nan"), "inf": float("inf"),
               "ninf": float("-inf"), "neg0": -0.0, "txt": "hello", "flag": True, "count": 7,
               "nested": {"x": h(a)}, "lst": [1.0, 2.0]}
        if i == 0:
            row["hist"] = wandb.Histogram([1, 2, 3])
        run.log(row, step=step)
    run.finish()

def hf(d):  # as transformers' WandbCallback logs: no step, train/global_step, define_metric
    run = wandb.init(project="p", mode="offline", dir=d, id="hfstyle1")
    run.define_metric("train/global_step")
    run.define_metric("*", step_metric="train/global_step", step_sync=True)
    for gs, loss in enumerate(spec["hf"], 1):
        run.log({"train/loss": h(loss), "train/epoch": gs / 4, "train/global_step": gs})
        if gs % 2 == 0:
            run.log({"eval/loss": h(loss) * 2, "train/global_step": gs})
    run.log({"test/loss": 0.5})  # on_predict: no global step; step_sync adds the last one
    run.finish()

def dup(d):  # a restart logging step 2 again, a record with no global step, a huge int
    run = wandb.init(project="p", mode="offline", dir=d, id="dup1")
    run.log({"setup/x": 1.0})
    run.log({"train/loss": 1.0, "train/global_step": 1, "train/tokens": 2**60 + 1})
    run.log({"train/loss": 2.0, "train/global_step": 2})
    run.log({"train/loss": 2.5, "train/global_step": 2})
    run.finish(exit_code=3)

def big(d):  # a record over 32 KiB (first/middle/last chunks), then many small ones
    run = wandb.init(project="p", mode="offline", dir=d, id="big1")
    run.log({f"wide/{k:04d}": k + 0.5 for k in range(3000)}, step=0)
    for step, vals in enumerate(spec["big"], 1):
        run.log({f"v{k}": h(x) for k, x in enumerate(vals)}, step=step)
    run.finish()

explicit(spec["a"]); hf(spec["a"]); dup(spec["b"]); big(spec["c"])
"""


def _hex(rng: random.Random) -> str:
    if rng.random() < 0.2:
        return rng.choice(EDGES).hex()
    while True:
        x = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]
        if math.isfinite(x):
            return x.hex()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four real offline runs: a/ holds explicit1 and hfstyle1, b/ dup1, c/ big1."""
    pytest.importorskip("wandb")
    root = tmp_path_factory.mktemp("wandb_runs")
    rng = random.Random(7)
    spec = {
        "explicit": [(5 * i, _hex(rng), _hex(rng)) for i in range(40)],
        "hf": [_hex(rng) for _ in range(4)],
        "big": [[_hex(rng) for _ in range(5)] for _ in range(300)],
    }
    for d in "abc":
        (root / d).mkdir()
        spec[d] = str(root / d)
    (root / "spec.json").write_text(json.dumps(spec))
    (root / "writer.py").write_text(WRITER)
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(root),
        "WANDB_DISABLE_GIT": "true",
        "WANDB_API_KEY": "",
    }
    subprocess.run(
        [sys.executable, str(root / "writer.py"), str(root / "spec.json")],
        env=env,
        check=True,
        timeout=180,
        cwd=root,
    )
    return root, spec


def run_dir(root: Path, d: str, run_id: str) -> Path:
    (found,) = (root / d / "wandb").glob(f"offline-run-*-{run_id}")
    return found


def test_explicit_steps_values_bit_equal(runs):
    root, spec = runs
    frame = read_metrics(run_dir(root, "a", "explicit1"), "wandb")
    assert frame.attrs["format"] == "wandb" and frame.attrs["complete"] is True
    assert frame.attrs["skipped"] == []
    assert any("'_step'" in n for n in frame.attrs["notes"])
    # strings, bools, lists, media and W&B's own keys are not metrics; a dict's leaves are
    assert list(frame.columns) == ["count", "inf", "m/a", "m/b", "nan", "neg0", "nested.x", "ninf"]
    assert list(frame.index) == [s for s, _, _ in spec["explicit"]]
    want_a = [float.fromhex(a) for _, a, _ in spec["explicit"]]
    assert same_bits(frame["m/a"], want_a) and same_bits(frame["nested.x"], want_a)
    assert same_bits(frame["m/b"], [float.fromhex(b) for _, _, b in spec["explicit"]])
    assert frame["nan"].isna().all() and present_mask(frame)["nan"].all()
    assert (frame["inf"] == math.inf).all() and (frame["ninf"] == -math.inf).all()
    assert np.signbit(frame["neg0"]).all() and (frame["count"] == 7.0).all()
    assert set(frame.attrs["precision"].values()) == {"float64"}


def test_hf_style_global_step(runs):
    root, spec = runs
    frame = read_metrics(run_dir(root, "a", "hfstyle1"), "wandb")
    assert list(frame.index) == [1, 2, 3, 4]
    assert list(frame.columns) == ["eval/loss", "test/loss", "train/epoch", "train/loss"]
    assert same_bits(frame["train/loss"], [float.fromhex(x) for x in spec["hf"]])
    assert same_bits(frame["train/epoch"], [0.25, 0.5, 0.75, 1.0])
    assert list(present_mask(frame)["eval/loss"]) == [False, True, False, True]
    assert frame.loc[4, "test/loss"] == 0.5
    assert any("'train/global_step'" in n for n in frame.attrs["notes"])
    assert frame.attrs["skipped"] == []


def test_restart_skips_and_exit_code(runs):
    root, _ = runs
    path = run_dir(root, "b", "dup1")
    with pytest.raises(MetricsError, match=r"step 2: 'train/loss'.* first\|last") as e:
        read_metrics(path, "wandb")
    one_line_naming(e.value, "run-dup1.wandb")
    first = read_metrics(path, "wandb", duplicates="first")
    last = read_metrics(path, "wandb", duplicates="last")
    assert first.loc[2, "train/loss"] == 2.0 and last.loc[2, "train/loss"] == 2.5
    assert any("kept the first" in n for n in first.attrs["notes"])
    skipped = {s["reason"]: s["count"] for s in first.attrs["skipped"]}
    assert skipped == {
        "history records without train/global_step": 1,  # setup/x, before any global step
        "integer values a float64 cannot hold exactly": 1,  # 2**60 + 1
    }
    assert "train/tokens" not in first.columns and "setup/x" not in first.columns
    assert first.attrs["complete"] is False
    assert any("exited with code 3" in n for n in first.attrs["notes"])
    assert first.attrs["incomplete"] == "exited with code 3"  # what the refusal says


def test_several_runs_named_and_picked(runs):
    root, _ = runs
    folder = root / "a" / "wandb"
    assert detect(folder).name == "wandb"
    with pytest.raises(MetricsError, match="2 W&B runs") as e:
        read_metrics(folder)
    one_line_naming(e.value, run_dir(root, "a", "explicit1").name)
    assert run_dir(root, "a", "hfstyle1").name in str(e.value)
    by_id = read_metrics(folder, "wandb", run="hfstyle1")
    assert list(by_id.index) == [1, 2, 3, 4]
    by_name = read_metrics(folder, "wandb", run=run_dir(root, "a", "explicit1").name)
    assert "m/a" in by_name.columns
    assert list(read_metrics(folder, "wandb", run="latest-run").index) == [1, 2, 3, 4]
    with pytest.raises(MetricsError, match="no W&B run 'nope'.*explicit1"):
        read_metrics(folder, "wandb", run="nope")
    with pytest.raises(MetricsError, match="this file is run dup1"):
        read_metrics(run_dir(root, "b", "dup1"), "wandb", run="explicit1")
    one = read_metrics(root / "b" / "wandb", "wandb", duplicates="last")  # one run: no --run needed
    assert "train/loss" in one.columns


def test_detection(runs, tmp_path):
    root, _ = runs
    rd = run_dir(root, "c", "big1")
    file = rd / "run-big1.wandb"
    for p in (rd, file, root / "c" / "wandb"):
        assert detect(p).name == "wandb"
    renamed = tmp_path / "metrics.bin"  # claimed by its header, whatever its name
    shutil.copy(file, renamed)
    assert detect(renamed).name == "wandb"
    assert read_metrics(renamed).shape == read_metrics(file).shape


def test_big_record_and_blocks(runs):
    root, spec = runs
    file = run_dir(root, "c", "big1") / "run-big1.wandb"
    raw = file.read_bytes()
    assert len(raw) > 3 * 32768
    assert max(len(p) for _, p in records(raw, file, ReadLog())) > 32768  # spans blocks
    frame = read_metrics(file, "wandb")
    assert frame.shape == (301, 3005) and frame.attrs["skipped"] == []
    assert frame.loc[0, "wide/2999"] == 2999.5
    for k in range(5):
        want = [float.fromhex(v[k]) for v in spec["big"]]
        assert same_bits(frame[f"v{k}"].iloc[1:], want)


def test_truncated_tail_is_counted(runs, tmp_path):
    root, _ = runs
    raw = (run_dir(root, "c", "big1") / "run-big1.wandb").read_bytes()
    full = read_metrics(run_dir(root, "c", "big1"), "wandb")
    cut_file = tmp_path / "run-cut.wandb"
    rng = random.Random(3)
    for cut in [len(raw) - 1, len(raw) - 20, 40000, 70000] + rng.sample(range(8, len(raw)), 12):
        cut_file.write_bytes(raw[:cut])
        frame = read_metrics(cut_file, "wandb")
        assert frame.attrs["complete"] is False  # the exit record is gone
        assert [s["reason"] for s in frame.attrs["skipped"]] in ([CUT], [])
        rows = list(frame.index)
        assert rows == list(full.index[: len(rows)])
        assert same_bits(frame.to_numpy(), full.loc[rows, frame.columns].to_numpy())
    cut_file.write_bytes(raw[: len(raw) - 3])
    assert read_metrics(cut_file, "wandb").attrs["skipped"][0]["count"] == 1


def test_damage_mid_file_is_one_line(runs, tmp_path):
    root, _ = runs
    raw = bytearray((run_dir(root, "c", "big1") / "run-big1.wandb").read_bytes())
    raw[50000] ^= 0x40
    bad = tmp_path / "run-bad.wandb"
    bad.write_bytes(bytes(raw))
    with pytest.raises(MetricsError, match=r"run-bad\.wandb:byte \d+: ") as e:
        read_metrics(bad, "wandb")
    one_line_naming(e.value, "run-bad.wandb")
    not_log = tmp_path / "x.wandb"
    not_log.write_bytes(b"hello world\n")
    with pytest.raises(MetricsError, match="not a W&B run log"):
        read_metrics(not_log, "wandb")


def test_reader_is_read_only_and_does_not_import_wandb(runs, tmp_path):
    root, _ = runs
    file = tmp_path / "run-ro.wandb"
    shutil.copy(run_dir(root, "a", "explicit1") / "run-explicit1.wandb", file)
    file.chmod(0o444)
    before = file.stat().st_mtime_ns
    code = (
        "import sys; from parity.readers import read_metrics; "
        f"f = read_metrics({str(file)!r}, 'wandb'); "
        "assert 'wandb' not in sys.modules; print(f.shape)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert file.stat().st_mtime_ns == before


# --- hand-framed streams: the decoder alone ----------------------------------------------------


def test_hand_framed_stream_and_step_fallback():
    step = _ld(1, _ld(2, b"_step") + _ld(16, b"6"))
    typed = _ld(1, _ld(2, b"typed") + b"\x31" + struct.pack("<d", 0.1))  # HistoryItem.number
    old_style = _ld(  # wandb before 0.31: `key` and a JSON object, media inside
        1, _ld(1, b"cfg") + _ld(16, b'{"a": 1.5, "img": {"_type": "histogram", "bins": [1]}}')
    )
    payloads = [
        history_record({"_step": "0", "loss": "0.5"}, step=0),
        history_record({"loss": "0.25"}, step=3),  # no _step item: HistoryStep's num
        history_record({"x": '"text"', "y": "[1]", "z": "true"}, step=4),  # nothing numeric
        history_record({"loss": "{bad"}, step=5),  # value_json that is not JSON
        b"\x12\x05\x0a\x03\x12\x01",  # history that runs past its record
        _ld(2, step + typed + old_style),
        EXIT,
    ]
    log = frame_log(payloads)
    frame = read_log(log, Path("hand.wandb"), ReadOptions())
    assert list(frame.index) == [0, 3, 6] and list(frame["loss"].iloc[:2]) == [0.5, 0.25]
    assert frame.loc[6, "typed"] == 0.1 and frame.loc[6, "cfg.a"] == 1.5
    assert list(frame.columns) == ["cfg.a", "loss", "typed"]
    where = [f"record at byte {off}" for off, _ in records(log, Path("h"), ReadLog())[3:5]]
    assert frame.attrs["skipped"] == [
        {"reason": "history records that do not decode", "count": 2, "where": where}
    ]
    assert frame.attrs["complete"] is True


def test_multi_block_records_hand_framed():
    big = {f"k{i}": repr(i + 0.25) for i in range(4000)}
    payloads = [history_record({"_step": str(s), **big}) for s in range(3)]
    frame = read_log(frame_log(payloads), Path("big.wandb"), ReadOptions())
    assert frame.shape == (3, 4000) and frame.loc[2, "k3999"] == 3999.25


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(EDGES),
        min_size=1,
        max_size=30,
    )
)
def test_values_round_trip(values):
    payloads = [history_record({"_step": str(i), "v": json.dumps(v)}) for i, v in enumerate(values)]
    frame = read_log(frame_log(payloads + [EXIT]), Path("rt.wandb"), ReadOptions())
    assert same_bits(frame["v"], values)


def _base_log() -> tuple[list[bytes], bytes]:
    payloads = [
        history_record({"_step": str(s), "a": repr(s / 7), "b/c": "NaN", "t": '"x"'}, step=s)
        for s in range(6)
    ]
    payloads.append(EXIT)
    return payloads, frame_log(payloads)


PAYLOADS, BASE = _base_log()


def _outcome(raw: bytes) -> None:
    try:
        frame = read_log(raw, Path("fuzz.wandb"), ReadOptions())
    except MetricsError as e:
        one_line_naming(e, "fuzz.wandb")
    else:
        assert frame.index.is_monotonic_increasing


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_corrupted_bytes(data):
    raw = bytearray(BASE)
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    _outcome(bytes(raw[:cut]))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_corrupted_payloads_with_valid_crcs(data):
    payloads = [bytearray(p) for p in PAYLOADS]
    for _ in range(data.draw(st.integers(1, 4))):
        p = payloads[data.draw(st.integers(0, len(payloads) - 1))]
        if p:
            p[data.draw(st.integers(0, len(p) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        payloads.append(bytearray(data.draw(st.binary(max_size=40))))
    _outcome(frame_log([bytes(p) for p in payloads]))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(tail):
    _outcome(MAGIC + tail)
    _outcome(tail)


# --- the folder given to wandb.init(dir=...), and numbers a float64 cannot hold ---------------


def _run_folder(parent: Path, run_id: str, payloads: list[bytes]) -> Path:
    run = parent / f"run-20250101_000000-{run_id}"
    run.mkdir(parents=True)
    (run / f"run-{run_id}.wandb").write_bytes(frame_log(payloads))
    return run


def test_a_folder_holding_wandb_reads_as_the_run(tmp_path):
    """wandb.init(dir=D) writes D/wandb/run-*/run-ID.wandb: D reads as that run, as a folder
    holding mlruns/ reads as MLflow's; several runs there are named, --run picks one."""
    records = [history_record({"loss": "0.5"}, step=1), history_record({"loss": "0.25"}, step=2)]
    run = _run_folder(tmp_path / "wandb", "abc123", [*records, EXIT])
    (tmp_path / "wandb" / "latest-run").symlink_to(run)
    assert detect(tmp_path).name == "wandb"
    frame = read_metrics(tmp_path)
    assert frame.attrs["format"] == "wandb" and frame.loc[2, "loss"] == 0.25
    assert frame.attrs["source"] == str(run / "run-abc123.wandb") and frame.attrs["complete"]
    _run_folder(tmp_path / "wandb", "def456", [history_record({"loss": "0.75"}, step=1)])
    with pytest.raises(MetricsError, match=r"wandb: 2 W&B runs: .*abc123.*def456") as e:
        read_metrics(tmp_path)
    one_line_naming(e.value, "--run")
    assert read_metrics(tmp_path, run="def456").loc[1, "loss"] == 0.75
    assert read_metrics(tmp_path, run="latest-run").loc[2, "loss"] == 0.25


def test_a_number_a_float64_cannot_hold_is_skipped(tmp_path):
    from parity.readers.frame import UNFIT

    raw = frame_log(
        [
            history_record({"a": "1e999", "b": "0.5"}, step=1),
            history_record({"a": "1e-310", "c": "1" + "0" * 400}, step=2),
            history_record({"a": "Infinity"}, step=3),
        ]
    )
    frame = read_log(raw, tmp_path / "r.wandb", ReadOptions())
    skipped = {s["reason"]: s["count"] for s in frame.attrs["skipped"]}
    assert skipped == {UNFIT: 2}
    assert frame.loc[2, "a"] == 1e-310 and frame.loc[3, "a"] == math.inf
    assert frame.loc[1, "b"] == 0.5 and "c" not in frame.columns
