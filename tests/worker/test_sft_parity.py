"""Legacy vs worker SFT on charcount, 2 ranks under torchrun: every metric bitwise equal.

Each claim is paired with a mutant (a deliberately broken worker, applied by parity.rank.mutants)
that the same check must catch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from parity import assert_parity
from parity.readers import read_metrics
from parity.spec import JobSpec
from tests.specs import DDP_PADDED, DYNAMIC, FIXED, legacy_vs_worker, plain
from worker.data.batching import collate
from worker.data.charcount import DATA_DIR, encode, load_tokenizer, read_jsonl
from worker.model import load_model

pytestmark = pytest.mark.parity

BITWISE = [
    "train/loss",
    "train/grad_norm",
    "train/lr",
    "train/global_tokens",
    "train/total_tokens(B)",
]


@pytest.mark.parametrize(
    "base", [FIXED, DYNAMIC, DDP_PADDED], ids=["fixed-micro-batches", "dynamic-bsz", "ddp-padded"]
)
def test_legacy_and_worker_are_bitwise_equal(parity_runner, base):
    pair = legacy_vs_worker(parity_runner, base)
    comparison = assert_parity(pair.a, pair.b)
    for metric in BITWISE + ["val/loss"]:
        result = comparison.metrics[metric]
        assert result.status == "match" and result.policy == "exact", metric
        assert result.steps_compared >= (20 if metric.startswith("train") else 1)
    assert comparison.metrics["train/mfu"].status == "ignored"
    # the split really has several micro-batches per rank
    lines = (pair.b.dir / "metrics.jsonl").read_text().splitlines()
    per_rank = [json.loads(x)["_meta"]["per_rank"] for x in lines if '"_meta"' in x]
    assert len(per_rank) == 20
    assert all(p["num_micro_batches"] == [2, 2] for p in per_rank), per_rank


def test_final_weights_are_bitwise_equal(parity_runner):
    pair = legacy_vs_worker(parity_runner, FIXED)
    wa, wb = (load_file(str(r.dir / "final.safetensors")) for r in (pair.a, pair.b))
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name].view(torch.int32), wb[name].view(torch.int32)), name
    initial = load_model().state_dict()
    assert not torch.equal(initial["model.norm.weight"], wb["model.norm.weight"])  # it trained


def test_any_local_hf_model_folder(parity_runner, tmp_path):
    """--model takes any local HF causal LM folder: here a Llama, with the fixture tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(load_tokenizer()), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "llama"))
    base = JobSpec(task="charcount-sft", world_size=2, steps=3, model=str(tmp_path / "llama"))
    pair = legacy_vs_worker(parity_runner, base)
    assert pair.b.manifest["num_params"] < 40_000
    assert_parity(pair.a, pair.b)


# --- val loss: the fixed value against an independent float64 oracle ---------------------------


def test_first_step_loss_matches_float64_oracle(parity_runner):
    """train/loss at step 1 (initial weights) against the first global batch, in float64."""
    from torch.utils.data import DistributedSampler

    tok = load_tokenizer()
    train = read_jsonl(DATA_DIR / "train.jsonl")
    order = list(DistributedSampler(range(len(train)), num_replicas=1, rank=0, seed=0))
    model = load_model(attn="eager").double()
    nll_sum, tokens = 0.0, 0
    with torch.no_grad():
        for i in order[:16]:  # the global batch of step 1, whatever the world size
            mb = collate([encode(train[i], tok, 512)])
            logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), mb.labels.reshape(-1), reduction="none"
            )
            nll_sum += float((nll * mb.loss_mask.reshape(-1)).sum())
            tokens += mb.num_loss_tokens
    oracle = nll_sum / tokens
    for run in legacy_vs_worker(parity_runner, FIXED).a, legacy_vs_worker(parity_runner, FIXED).b:
        assert abs(run.metrics["train/loss"][1] - oracle) / oracle <= 1e-6


def test_val_loss_matches_float64_oracle(parity_runner, oracle_val_loss):
    run = legacy_vs_worker(parity_runner, FIXED).b
    val = run.metrics["val/loss"].dropna()
    assert list(val.index) == [0, 20]
    before = oracle_val_loss()
    after = oracle_val_loss(load_file(str(run.dir / "final.safetensors")))
    assert abs(val[0] - before) / before <= 1e-6
    assert abs(val[20] - after) / after <= 1e-6


def test_oracle_check_catches_old_formula(parity_runner, oracle_val_loss):
    run = legacy_vs_worker(parity_runner, FIXED, inject_b=["old-val-loss"]).b
    before = oracle_val_loss()
    assert abs(run.metrics["val/loss"][0] - before) / before > 0.4


# --- the legacy formula: wrong with several micro-batches, exact with one ----------------------


def _val_only(trainer: str, val_loss: str, micro_batch_size: int) -> JobSpec:
    return JobSpec(
        task="charcount-sft",
        trainer=trainer,
        world_size=2,
        steps=1,
        micro_batch_size=micro_batch_size,
        val_loss=val_loss,
        overrides={"val_before_train": True, "val_samples": 16},
    )


def test_legacy_val_formula_divides_by_micro_batch_count(parity_runner):
    # one val batch of 16 = the global batch; 8 per rank in micro-batches of 4: 2 per rank
    old = parity_runner.job(_val_only("legacy", "legacy", 4)).metrics["val/loss"][0]
    fixed = parity_runner.job(_val_only("worker", "fixed", 4)).metrics["val/loss"][0]
    assert old == pytest.approx(fixed / 2, rel=1e-12)
    assert old != fixed


def test_legacy_val_formula_is_exact_with_one_micro_batch(parity_runner):
    old = parity_runner.job(_val_only("legacy", "legacy", 8)).metrics["val/loss"][0]
    fixed = parity_runner.job(_val_only("worker", "fixed", 8)).metrics["val/loss"][0]
    assert np.float64(old).view(np.uint64) == np.float64(fixed).view(np.uint64)


# --- accelerate launch ------------------------------------------------------------------------


def _accelerate(out, *launcher_args: str, steps: int = 20) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher_args]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += ["-m", "worker.sft", "--trainer", "worker", "--out", str(out), "--steps", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_worker_under_accelerate_launch_matches_torchrun(parity_runner, tmp_path):
    proc = _accelerate(tmp_path / "acc", "--multi_gpu", "--num_processes", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    accelerated = read_metrics(tmp_path / "acc")
    torchrun = parity_runner.job(plain()).metrics
    assert_parity(accelerated, torchrun)


def test_accelerate_cpu_flag_trap_runs_one_process(tmp_path):
    """`accelerate launch --cpu --num_processes 2` silently runs ONE process, as measured."""
    proc = _accelerate(tmp_path / "cpu", "--cpu", "--num_processes", "2", steps=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "cpu" / "manifest.json").read_text())
    assert manifest["world_size"] == 1
