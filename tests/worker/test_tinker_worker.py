"""The TrainingWorker driven the Tinker way, in this process (one rank): a step split into
forward_backward calls is the fused step bit for bit, a call failing mid-step leaves nothing
behind, per-sample log-probs come back in the caller's order, AdamParams drive each step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from worker.data.batching import BatchingConfig, dynamic_count, micro_batch_members
from worker.engine import OptimConfig
from worker.losses import sft_loss
from worker.trainers.tinker import adam_params, split_chunks
from worker.training_worker import AdamParams, TrainingWorker

OPTIM = OptimConfig()  # what _worker's engine is built with


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One thread, as torchrun gives each rank (ci/test.sh too): on 2 busy cores, 2 OpenMP
    threads made a step 10-20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def samples():
    from worker.data.charcount import DATA_DIR, encode, load_tokenizer, read_jsonl

    tok = load_tokenizer()
    return [encode(s, tok, 512) for s in read_jsonl(DATA_DIR / "train.jsonl")[:40]]


def _worker(**batching) -> TrainingWorker:
    from worker.determinism import set_determinism
    from worker.distributed import init_distributed
    from worker.engine import Engine
    from worker.model import load_model

    d = init_distributed()  # a one-process group when not under torchrun
    set_determinism(0)
    engine = Engine(load_model(), "ddp", OPTIM, d)
    return TrainingWorker(engine, BatchingConfig(**{"micro_batch_size": 2, **batching}))


def _split_step(worker: TrainingWorker, batch, step: int, k: int, loss_fn=sft_loss) -> dict:
    """A Tinker client's step, without zero_grad (Tinker's client has none): the step's
    normalizer declared once, k calls, optim_step with the schedule's lr."""
    scale = worker.loss_scale(batch)
    for chunk in split_chunks(batch, k):
        worker.forward_backward(chunk, loss_fn, scale=scale)
    return worker.optim_step(adam_params(OPTIM, step))


def _bits(x: float) -> int:
    return int(np.float64(x).view(np.uint64))


def _same_weights(a: TrainingWorker, b: TrainingWorker) -> bool:
    pa, pb = a.engine.model.state_dict(), b.engine.model.state_dict()
    return all(torch.equal(pa[k].view(torch.int32), pb[k].view(torch.int32)) for k in pa)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_split_step_is_the_fused_step_bit_for_bit(samples, k):
    """8 samples in micro-batches of 2: chunks of 8, 4 or 2 samples are whole micro-batches of
    the fused split, so the micro-batch losses, their backward and the accumulation order are
    the fused step's; the lr the client computes is the scheduler's."""
    fused, split = _worker(), _worker()
    for step in (1, 2, 3):
        batch = samples[8 * (step - 1) : 8 * step]
        f = fused.train_batch(batch, sft_loss)["metrics"]
        s = _split_step(split, batch, step, k)
        assert s["per_rank"]["forward_backward_calls"] == [k]
        assert _bits(s["loss"]) == _bits(f["loss"]), step
        assert _bits(s["grad_norm"]) == _bits(f["grad_norm"]), step
        assert s["lr"] == OPTIM.lr_at(step - 1) and OPTIM.lr_at(step) == f["lr"]
        assert s["global_tokens"] == f["global_tokens"]
    assert split.total_tokens == fused.total_tokens
    assert _same_weights(fused, split)
    assert split.engine.scheduler.last_epoch == 0  # the client drove the lr


def test_failed_forward_backward_mid_step_leaves_no_stale_gradient(samples):
    """Chunk 1 of a step runs its backward, chunk 2 fails: the worker clears the gradients and
    the step's totals, so the client's next step (straight on, no zero_grad) is the step of a
    run that never failed. The control keeps chunk 1's gradients and shows they would count."""
    clean, failing, stale = _worker(), _worker(), _worker()
    first, lost, nxt = samples[0:8], samples[8:16], samples[16:24]
    for w in (clean, failing, stale):
        _split_step(w, first, 1, 2)
    calls = {"n": 0}

    def fails_in_chunk_2(logits, mb, scale):
        calls["n"] += 1
        if calls["n"] == 3:  # micro-batch 1 of chunk 2 (chunks of 4 in micro-batches of 2)
            raise RuntimeError("boom in chunk 2")
        return sft_loss(logits, mb, scale)

    scale = failing.loss_scale(lost)
    one, two = split_chunks(lost, 2)
    assert failing.forward_backward(one, fails_in_chunk_2, scale=scale)["loss"] > 0
    assert any(p.grad is not None for p in failing.engine.module.parameters())
    with pytest.raises(RuntimeError, match="boom"):
        failing.forward_backward(two, fails_in_chunk_2, scale=scale)
    assert all(p.grad is None for p in failing.engine.module.parameters())
    stale.forward_backward(one, sft_loss, scale=stale.loss_scale(lost))  # never cleared

    a, b, c = (_split_step(w, nxt, 2, 2) for w in (clean, failing, stale))
    for key in ("loss", "grad_norm", "lr", "global_tokens", "per_rank"):
        assert a[key] == b[key], key
    assert _same_weights(clean, failing)
    assert c["grad_norm"] != a["grad_norm"] and c["loss"] != a["loss"]  # stale ones would show


def test_a_second_call_without_the_declared_normalizer_is_refused(samples):
    worker = _worker()
    one, two = split_chunks(samples[:8], 2)
    worker.forward_backward(one, sft_loss)  # a step's one call may normalize by its own counts
    with pytest.raises(ValueError, match="declared"):
        worker.forward_backward(two, sft_loss)
    assert all(p.grad is None for p in worker.engine.module.parameters())  # refused = failed
    worker.forward_backward(one, sft_loss)
    with pytest.raises(ValueError, match="declared"):  # nor declared after an undeclared one
        worker.forward_backward(two, sft_loss, scale=worker.loss_scale(samples[:8]))


@pytest.mark.parametrize(
    "batching",
    [{}, {"packed": False}, {"dynamic_bsz": True, "micro_batch_size": None,
                              "max_tokens_per_rank": 600}],
    ids=["packed", "padded", "dynamic"],
)  # fmt: skip
def test_log_probs_come_back_per_sample_in_order(samples, batching):
    worker = _worker(**batching)
    batch = samples[:8]
    if batching.get("dynamic_bsz"):  # the balanced split really reorders the samples
        count = dynamic_count(batch, worker.batching.max_tokens_per_rank)
        groups = micro_batch_members(batch, worker.batching, count)
        assert count > 1 and [i for g in groups for i in g] != list(range(8))
    out = worker.forward(batch, sft_loss)
    fb = worker.forward_backward(batch, sft_loss)
    assert len(out["logprobs"]) == len(fb["logprobs"]) == len(batch)
    mask_sum, weighted = 0, 0.0
    for s, lp, lp_fb in zip(batch, out["logprobs"], fb["logprobs"], strict=True):
        assert lp.shape == (len(s),) and torch.equal(lp, lp_fb)
        alone = worker.forward([s], sft_loss)["logprobs"][0]
        torch.testing.assert_close(lp, alone, rtol=1e-4, atol=1e-5)
        mask = torch.roll(s.loss_mask, -1)
        mask[-1] = 0
        weighted += float(-(lp.double() * mask).sum())
        mask_sum += int(mask.sum())
    # Tinker's cross-entropy with weights mask / N: the sum over samples is the loss
    assert weighted / mask_sum == pytest.approx(out["loss"], rel=1e-6)


def test_adam_params_drive_the_step(samples):
    """Tinker's AdamParams: lr, betas, eps and weight decay for this step; grad_clip_norm 0 is
    no clipping; the engine's scheduler is left alone."""
    batch = samples[:8]
    params = AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.99, eps=1e-10, weight_decay=0.05)
    unclipped, huge, clipped = _worker(), _worker(), _worker()
    outs = []
    for w, clip in ((unclipped, 0.0), (huge, 1e9), (clipped, 1.0)):
        w.forward_backward(batch, sft_loss)
        outs.append(w.optim_step(dataclasses.replace(params, grad_clip_norm=clip)))
    assert outs[0]["grad_norm"] > 1.0 and outs[0]["lr"] == 3e-3
    assert _same_weights(unclipped, huge) and not _same_weights(unclipped, clipped)
    group = unclipped.engine.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        3e-3, (0.8, 0.99), 1e-10, 0.05,
    )  # fmt: skip
    assert unclipped.engine.scheduler.last_epoch == 0
    assert unclipped.engine.current_lr() == OPTIM.lr_at(0)  # the internal schedule, untouched


def test_chunk_token_mean_mutant_shows_only_in_a_split_step(samples, monkeypatch):
    """The mutant normalizes each call by its own tokens: the fused step (one call) keeps every
    bit, a 2-call step about doubles its loss."""
    from worker.mutants import MUTANTS

    batch = samples[:8]
    fused, split = _worker().train_batch(batch, sft_loss), _split_step(_worker(), batch, 1, 2)
    monkeypatch.setattr(TrainingWorker, "_call_scale", TrainingWorker._call_scale)  # undone after
    MUTANTS["chunk-token-mean"][1]()
    fused_m = _worker().train_batch(batch, sft_loss)
    split_m = _split_step(_worker(), batch, 1, 2)
    assert fused_m["metrics"] == {**fused["metrics"], "mfu": fused_m["metrics"]["mfu"]}
    assert split_m["loss"] == pytest.approx(2 * split["loss"], rel=0.1)


def test_split_chunks():
    assert [len(c) for c in split_chunks(list(range(8)), 3)] == [3, 3, 2]
    assert [len(c) for c in split_chunks(list(range(8)), 5)] == [2, 2, 2, 1, 1]
    assert split_chunks([1, 2], 4) == [[1], [2]]
    assert sum(split_chunks(list(range(7)), 2), []) == list(range(7))


def test_tinker_is_an_sft_trainer_only(tmp_path):
    """`--trainer tinker` is an SFT trainer (what `parity pair --b tinker` passes); PPO refuses
    it in argparse's way (the harness's exit 2: the job refused its arguments)."""
    from parity.spec import JobSpec, PairSpec
    from worker.trainers.ppo_common import parse_config as ppo_config
    from worker.trainers.sft_common import parse_config

    _, b = PairSpec.from_variants(
        JobSpec(task="charcount-sft", world_size=2, overrides={"chunks": 4}), "legacy", "tinker"
    ).sides()
    args = b.to_args(tmp_path)
    assert args[:2] == ["-m", "worker.sft"]
    cfg = parse_config(args[2:])
    assert (cfg.trainer, cfg.chunks) == ("tinker", 4)
    with pytest.raises(SystemExit) as e:
        ppo_config(["--out", str(tmp_path), "--trainer", "tinker"])
    assert e.value.code == 2
