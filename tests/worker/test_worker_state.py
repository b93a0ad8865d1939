"""TrainingWorker state: save/load resumes bitwise; a failed call leaves no stale gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parity import assert_parity
from parity.spec import JobSpec


@pytest.mark.parity
def test_resume_from_saved_state_is_bitwise_equal(parity_runner):
    full = parity_runner.job(
        JobSpec(task="charcount-sft", world_size=2, steps=20, overrides={"save_state_at": 10})
    )
    state = full.dir / "state_step10"
    assert (state / "dcp" / ".metadata").exists()
    resumed = parity_runner.job(
        JobSpec(task="charcount-sft", world_size=2, steps=20, overrides={"resume": str(state)})
    )
    assert list(resumed.metrics.index) == list(range(11, 21))
    assert_parity(full.metrics.loc[11:], resumed.metrics)


def test_resume_into_its_own_folder_reads_as_one_run(tmp_path):
    """A run killed after step 12 (state saved at 10) and resumed in place: steps 1..20, once."""
    from worker.metrics_log import MetricsLog

    log = MetricsLog(tmp_path, enabled=True)
    for step in range(1, 13):
        log.log(step, {"train/loss": float(step)})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "train/lo')  # the truncated record of the killed run
    resumed = MetricsLog(tmp_path, enabled=True, append=True)
    resumed.resume_at(11)
    for step in range(11, 21):
        resumed.log(step, {"train/loss": float(step)})
    resumed.finish(20)
    from parity.readers import read_metrics

    frame = read_metrics(tmp_path)
    assert list(frame.index) == list(range(1, 21)) and frame.attrs["complete"]
    assert read_metrics(tmp_path / "console.log", "verl-console").index.tolist() == list(
        range(1, 21)
    )


def _one_rank_worker():
    from worker.data.batching import BatchingConfig
    from worker.determinism import set_determinism
    from worker.distributed import init_distributed
    from worker.engine import Engine, OptimConfig
    from worker.model import load_model
    from worker.training_worker import TrainingWorker

    d = init_distributed()
    set_determinism(0)
    engine = Engine(load_model(), "ddp", OptimConfig(), d)
    return TrainingWorker(engine, BatchingConfig(micro_batch_size=2))


def test_failed_forward_backward_leaves_no_stale_gradients():
    from worker.data.charcount import DATA_DIR, encode, load_tokenizer, read_jsonl
    from worker.losses import sft_loss

    tok = load_tokenizer()
    batch = [encode(s, tok, 512) for s in read_jsonl(DATA_DIR / "train.jsonl")[:4]]
    calls = {"n": 0}

    def flaky(logits, mb, scale):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom in micro-batch 2")
        return sft_loss(logits, mb, scale)

    worker = _one_rank_worker()
    with pytest.raises(RuntimeError, match="boom"):
        worker.forward_backward(batch, flaky)
    assert all(p.grad is None for p in worker.engine.module.parameters())
    retried = worker.train_batch(batch, sft_loss)["metrics"]
    fresh = _one_rank_worker().train_batch(batch, sft_loss)["metrics"]
    for key in ("loss", "grad_norm", "lr"):
        assert retried[key] == fresh[key], key
    assert torch.isfinite(torch.tensor(retried["grad_norm"]))


def test_non_finite_grad_norm_skips_the_step():
    from worker.data.charcount import DATA_DIR, encode, load_tokenizer, read_jsonl
    from worker.losses import sft_loss

    tok = load_tokenizer()
    batch = [encode(s, tok, 512) for s in read_jsonl(DATA_DIR / "train.jsonl")[:2]]
    worker = _one_rank_worker()
    before = {k: v.clone() for k, v in worker.engine.module.state_dict().items()}
    lr_before = worker.engine.current_lr()

    def poisoned(logits, mb, scale):
        loss, metrics = sft_loss(logits, mb, scale)
        return loss * float("inf"), metrics

    out = worker.forward_backward(batch, poisoned)
    step = worker.optim_step()
    assert not step["applied"] and not np.isfinite(step["grad_norm"]) and np.isinf(out["loss"])
    after = worker.engine.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in worker.engine.module.parameters())
    assert step["lr"] != lr_before  # the scheduler still steps, as in verl
