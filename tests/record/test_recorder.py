"""The recorder (`parity.record`): a foreign training loop writes the run folder the harness reads.

tests/jobs/foreign_loop.py is such a loop: plain torch, a tiny next-token model, DDP over 2 gloo
ranks under torchrun, nothing of worker/. Its runs compare, diagnose and round-trip through a golden
as our own jobs' do: A vs A' aligned; a planted data-order change is "batches differ" at its
step; a planted numeric change in one layer is "same batches, numbers differ" with that layer's
gradient named by the fingerprints; a crash mid-run reads as incomplete. The HF callback
(`parity.record.hf`) writes exactly what Trainer logs (its metrics.jsonl and trainer_state.json
compare aligned) and hashes the gradients before the clip. Our own jobs write through the same
code (the goldens and tests/judge/test_diagnose.py hold their format).
"""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from parity.cli import main
from parity.judge.compare import compare_frames
from parity.judge.diagnose import diagnose, rank_agreement, read_fingerprints, read_rank_data
from parity.judge.golden import FINGERPRINT_KEYS, MATCH, fingerprint, save_golden, verify_golden
from parity.readers import read_metrics
from parity.run.job import run_job
from parity.run.launch import LaunchError
from parity.spec import JobSpec
from tests.jobs import hf_callback_run

torch = pytest.importorskip("torch")  # the recorder records torch tensors
from parity.record import Recorder, record_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LOOP = ROOT / "tests" / "jobs" / "foreign_loop.py"
PLANT_STEP = 3  # as foreign_loop.PLANT_STEP


def _loop(plant: str = "none", steps: int = 6) -> JobSpec:
    command = [str(LOOP), "--out", "{out}", "--steps", str(steps), "--plant", plant]
    command += ["--fingerprint-steps", "all"]
    return JobSpec(
        task="custom", world_size=2, steps=steps, command=command,
        timeout_s=120,
    )  # fmt: skip


# --- the files, in one process ------------------------------------------------------------------


def test_records_are_exact_and_the_end_record_is_last(tmp_path):
    rec = Recorder(tmp_path, rank=0, fingerprint_steps=[2])
    rec.manifest({"lr": 0.1}, backend="gloo", world_size=1)
    model = torch.nn.Linear(3, 2)
    third = torch.tensor(1 / 3, dtype=torch.float32)  # a float32 tensor: its value, not a repr
    for step in (1, 2, 3):
        rec.batch(torch.arange(6)[None] + step, torch.ones(1, 6))
        model(torch.ones(1, 3)).sum().backward()
        rec.fingerprint(step, model)
        rec.log(step, {"train/loss": third * step, "n": step, "nan": math.nan}, {"epoch": 0})
    rec.finish()
    frame = read_metrics(tmp_path)
    assert frame.attrs["complete"] is True and list(frame.index) == [1, 2, 3]
    assert frame.loc[2, "train/loss"] == float(third * 2) and math.isnan(frame.loc[3, "nan"])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1]) == {"event": "end", "steps": 3}
    assert json.loads(lines[0])["_meta"] == {"epoch": 0}
    data = read_rank_data(tmp_path)[0]
    assert data[1]["train"]["micro_batches"] == 1 and data[1]["train"]["tokens"] == 6
    assert data[1]["train"]["hash"] != data[2]["train"]["hash"]
    prints = read_fingerprints(tmp_path / "fingerprints.jsonl")
    assert list(prints) == [2] and set(prints[2]["grads"]) == {"weight", "bias"}
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    env = fingerprint(manifest)
    unrecorded = [k for k in FINGERPRINT_KEYS if env[k] is None]
    assert set(unrecorded) <= {"environment.cuda", "environment.gpu", "environment.cpu_vendor"}
    facts = (manifest["config"], manifest["device"], manifest["backend"])
    assert facts == ({"lr": 0.1}, "cpu", "gloo")


def test_a_crash_mid_run_leaves_an_incomplete_run(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with record_run(tmp_path, config={"steps": 5}) as rec:
            for step in (1, 2, 3):
                rec.batch(torch.arange(4))
                if step == 3:
                    raise RuntimeError("boom")
                rec.log(step, {"train/loss": 1.0 / step})
    assert read_metrics(tmp_path).attrs["complete"] is False
    assert "end" not in (tmp_path / "ranks" / "rank0.jsonl").read_text()
    assert sorted(read_rank_data(tmp_path)[0]) == [1, 2]
    assert json.loads((tmp_path / "manifest.json").read_text())["config"] == {"steps": 5}


def test_a_resumed_run_reads_as_one(tmp_path):
    with Recorder(tmp_path, rank=0, fingerprint_steps="all") as rec:
        for step in (1, 2, 3):
            rec.log(step, {"train/loss": float(step)})
    resumed = Recorder(tmp_path, rank=0, fingerprint_steps="all", append=True)
    resumed.resume_at(3)  # state saved after step 2: step 3 and the end records go
    with resumed:
        resumed.log(3, {"train/loss": 3.5})
    frame = read_metrics(tmp_path)
    assert frame["train/loss"].tolist() == [1.0, 2.0, 3.5] and frame.attrs["complete"]
    assert sorted(read_rank_data(tmp_path)[0]) == [1, 2, 3]


def test_a_step_logged_in_two_calls_reads_as_one_step(tmp_path):
    """Train metrics, then the last step's eval metrics in a second call: one step with both in
    metrics.jsonl and console.log (their readers merge a step's records); ranks/ and
    fingerprints.jsonl keep one record a step, rewritten merged (parity.judge.diagnose reads
    them)."""
    rec = Recorder(tmp_path, rank=0, fingerprint_steps=[3], console=True)
    model = torch.nn.Linear(3, 2)
    for step in (1, 2, 3):
        rec.batch(torch.arange(6)[None] + step)
        model(torch.ones(1, 3)).sum().backward()
        rec.fingerprint(step, model)
        rec.log(step, {"train/loss": 1.0 / step}, {"epoch": 0})
    rec.batch(torch.arange(4)[None], kind="val")
    rec.add_fingerprint(3, {"params": {"v": "00ff"}, "grads": {"v": None}}, prefix="critic.")
    rec.log(3, {"eval/loss": 0.5, "eval/perplexity": 1.5})
    rec.finish()
    frame = read_metrics(tmp_path)
    assert list(frame.index) == [1, 2, 3] and frame.attrs["complete"] is True
    assert frame.loc[3, "eval/loss"] == 0.5 and frame.loc[3, "train/loss"] == 1 / 3
    assert compare_frames(frame, read_metrics(tmp_path / "console.log")).verdict == "aligned"
    data = read_rank_data(tmp_path)[0]
    assert set(data[3]) == {"train", "val"} and data[3]["val"]["micro_batches"] == 1
    rank0 = read_metrics(tmp_path / "ranks" / "rank0.jsonl", "jsonl")
    assert rank0.loc[3, "eval/loss"] == 0.5 and rank0.loc[3, "train/loss"] == 1 / 3
    lines = (tmp_path / "ranks" / "rank0.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[2])["_meta"]["epoch"] == 0  # 3 steps, the end
    prints = read_fingerprints(tmp_path / "fingerprints.jsonl")
    assert list(prints) == [3] and set(prints[3]["params"]) == {"weight", "bias", "critic.v"}
    assert rank_agreement(tmp_path).status == "agree"


def test_the_same_key_twice_at_a_step_is_refused_at_the_call(tmp_path):
    rec = Recorder(tmp_path, rank=1)  # on any rank, even one that writes no metrics.jsonl
    rec.log(11, {"train/loss": 0.5})
    rec.log(12, {"train/loss": 0.25})
    rec.log(12, {"eval/perplexity": 3.5})
    before = (tmp_path / "ranks" / "rank1.jsonl").read_bytes()
    with pytest.raises(ValueError, match=r"^rec\.log: step 12 already logged 'eval/perplexity'$"):
        rec.log(12, {"eval/perplexity": 3.25})
    with pytest.raises(ValueError, match=r"step 12 already logged 'train/loss'"):
        rec.log(12, {"train/loss": 0.25})  # the same value again: refused too
    with pytest.raises(ValueError, match=r"rec\.log: step 11 logged again after step 12"):
        rec.log(11, {"eval/loss": 1.0})
    assert (tmp_path / "ranks" / "rank1.jsonl").read_bytes() == before  # nothing written
    rec.batch(torch.arange(4)[None])  # batches of one kind between two calls of a step
    rec.log(12, {"eval/loss": 1.0})
    rec.finish()
    data = read_rank_data(tmp_path)[1]
    assert sorted(data) == [11, 12] and data[12]["train"]["micro_batches"] == 1
    record = read_metrics(tmp_path / "ranks" / "rank1.jsonl", "jsonl").loc[12]
    assert (record["train/loss"], record["eval/perplexity"], record["eval/loss"]) == (0.25, 3.5, 1)


def test_digests_of_one_kind_taken_in_two_calls_fold(tmp_path):
    rec = Recorder(tmp_path, rank=0, metrics=False)
    rec.batch(torch.arange(4)[None])
    rec.log(1, {"a": 1.0})
    rec.batch(torch.arange(5)[None])
    rec.log(1, {"b": 2.0})
    rec.finish()
    train = read_rank_data(tmp_path)[0][1]["train"]
    assert (train["micro_batches"], train["tokens"]) == (2, 9) and len(train["hash"]) == 16


def test_hf_callback_logs_train_eval_and_summary_of_a_step_through_the_recorder(tmp_path):
    """on_log at once, each call a Recorder.log of the step: `epoch` repeated with its value and
    the summary's repeats are left out; another value for a key the step has is refused."""
    pytest.importorskip("transformers")
    from parity.record.hf import ParityCallback

    callback = ParityCallback(tmp_path)
    callback.recorder = Recorder(tmp_path, rank=0)
    history: list[dict] = []

    def log(step, logs):
        history.append({**logs, "step": step})
        state = SimpleNamespace(global_step=step, log_history=history)
        callback.on_log(None, state, None, logs=dict(logs))

    log(1, {"loss": 2.0, "grad_norm": 1.5, "learning_rate": 1e-3, "epoch": 0.5})
    log(2, {"loss": 1.5, "grad_norm": 1.25, "learning_rate": 1e-3, "epoch": 1.0})
    log(2, {"eval_loss": 1.75, "eval_runtime": 0.1, "epoch": 1.0})
    log(2, {"train_runtime": 3.5, "train_loss": 1.75, "epoch": 1.0, "total_flos": 10.0})
    with pytest.raises(ValueError, match=r"rec\.log: step 2 already logged 'eval/loss'"):
        log(2, {"eval_loss": 1.8, "epoch": 1.0})
    callback.on_train_end(None, SimpleNamespace(global_step=2), None)
    frame = read_metrics(tmp_path)
    assert list(frame.index) == [1, 2] and frame.attrs["complete"] is True
    row = frame.loc[2]
    assert (row["train/loss"], row["eval/loss"], row["train/train_loss"]) == (1.5, 1.75, 1.75)
    assert row["train/epoch"] == 1.0 and row["train/total_flos"] == 10.0
    assert set(read_rank_data(tmp_path)[0]) == {1, 2}


def test_the_recorder_is_the_bottom_layer():
    """parity.record imports only torch and the standard library (each library's logger its
    library: transformers in hf.py, ...), none of the rest of parity, nothing of worker; and our
    jobs write through it."""
    stdlib = set(sys.stdlib_module_names)
    own = {"hf.py": {"transformers"}, "lightning.py": {"lightning", "pytorch_lightning"}}
    own["accelerate.py"] = {"accelerate"}
    for path in sorted((ROOT / "parity" / "record").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.partition(".")[0]
                ok = top in stdlib or top == "torch" or name.startswith("parity.record")
                ok = ok or top in own.get(path.name, ())
                assert ok, f"{path.name} imports {name}"
    code = (
        "import sys, parity.record as r, parity.record.env as e; r.Recorder; e.environment\n"
        "r.DataDigest\n"
        "bad = ['pandas', 'transformers', 'worker', 'parity.judge.compare', 'parity.readers',\n"
        "       'accelerate', 'pytorch_lightning', 'lightning']\n"
        "print([m for m in bad if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stderr
    import parity.record.env
    import worker.metrics_log

    assert worker.metrics_log.environment is parity.record.env.environment
    assert isinstance(worker.metrics_log.MetricsLog(ROOT, enabled=False).recorder, Recorder)


# --- HF Trainer, in one process ----------------------------------------------------------------


def test_hf_callback_writes_what_trainer_logs_and_pre_clip_gradients(tmp_path):
    """tests/jobs/hf_callback_run.py: two 3-step Trainer runs, clipped at 1.0 and at 1e-3, in this
    venv (tests/project/test_install.py runs the same under other transformers versions)."""
    pytest.importorskip("transformers")
    a = hf_callback_run.run(tmp_path / "a", max_grad_norm=1.0)
    b = hf_callback_run.run(tmp_path / "b", max_grad_norm=1e-3)
    hf_callback_run.check(a, b)
    # fingerprints without attach: refused in one line (no callback sees the pre-clip gradients)
    from parity.record.hf import ParityCallback

    state = SimpleNamespace(global_step=0)
    with pytest.raises(ValueError, match=r"use ParityCallback.attach\(trainer"):
        ParityCallback(fingerprint_steps="1").on_train_begin(None, state, None)


# --- a foreign loop under torchrun, 2 gloo ranks ------------------------------------------------


@pytest.mark.parity
def test_foreign_loop_a_vs_a_prime_and_its_golden(parity_runner, tmp_path):
    floor = parity_runner.floor(_loop())
    a, again = floor.runs
    assert floor.deterministic, floor.table()
    comparison = compare_frames(a.metrics, again.metrics)
    assert comparison.verdict == "aligned" and a.metrics.attrs["complete"]
    d = diagnose(a.dir, again.dir, comparison)
    assert d.kind == "aligned" and d.train.status == "same" and d.train.steps_compared == 6
    assert d.fingerprints.status == "same" and d.lines() == []
    agreement = rank_agreement(a.dir)
    assert (agreement.status, agreement.ranks) == ("agree", 2)
    manifest = json.loads((a.dir / "manifest.json").read_text())
    assert (manifest["backend"], manifest["device"], manifest["world_size"]) == ("gloo", "cpu", 2)
    baseline = save_golden(tmp_path / "golden", a.dir, spec=a.spec.to_dict())
    result = verify_golden(tmp_path / "golden", again.dir)
    assert result.status == MATCH and result.own_environment and result.baseline == baseline


@pytest.mark.parity
def test_planted_data_order_change_is_batches_differ(parity_runner):
    a, b = parity_runner.job(_loop()), parity_runner.job(_loop("data"))
    d = diagnose(a.dir, b.dir, compare_frames(a.metrics, b.metrics))
    assert (d.kind, d.step, d.train.ranks) == ("batches differ", PLANT_STEP, [1]), d.lines()
    assert d.headline().startswith(f"batches differ from step {PLANT_STEP} (rank 1)")


@pytest.mark.parity
def test_planted_numeric_change_names_the_tensor(parity_runner, capsys):
    a, b = parity_runner.job(_loop()), parity_runner.job(_loop("numeric"))
    d = diagnose(a.dir, b.dir, compare_frames(a.metrics, b.metrics))
    assert (d.kind, d.step, d.metric) == (
        "same batches, numbers differ", PLANT_STEP, "train/grad_norm"
    ), d.lines()  # fmt: skip
    assert d.fingerprints.root == ("gradients", PLANT_STEP, ["fc2.weight"])
    assert d.fingerprints.first_weight_step == PLANT_STEP + 1
    assert main(["compare", str(a.dir), str(b.dir)]) == 1
    out = capsys.readouterr().out
    assert f"diagnosis: same batches, numbers differ from step {PLANT_STEP}" in out
    assert f"gradients first differ at step {PLANT_STEP} in 1 of 5 tensors: fc2.weight" in out


@pytest.mark.parity
def test_crash_mid_run_is_an_incomplete_run(tmp_path):
    with pytest.raises(LaunchError) as info:
        run_job(_loop("crash"), tmp_path)
    assert info.value.result.reason == "crash" and not info.value.result.output_complete
    frame = read_metrics(tmp_path)
    assert list(frame.index) == list(range(1, PLANT_STEP)) and frame.attrs["complete"] is False
    assert sorted(read_rank_data(tmp_path)) == [0, 1]
