"""Is PPO on-policy? The rollout's log-probs against the trainer's.

The rollout samples with transformers' `generate` (KV-cache decode) and records its own per-token
log-probs (`trainers.ppo_common.sampler_log_probs`); the trainer recomputes them
(`old_log_probs`) with a full forward over packed or padded micro-batches. Both trainers log the
gap every step (`mismatch_metrics`), over the response tokens of the global batch:

    rollout/logprob_diff_max    max |trainer - rollout| (raw: at the sampling temperature)
    rollout/logprob_diff_mean   mean |trainer - rollout|
    rollout/logprob_diff_frac   the fraction of tokens whose float32 log-probs differ at all
    rollout/k3_kl               mean of exp(r) - 1 - r, r = trainer - rollout: KL(rollout||trainer)
    rollout/processed_*         the same against the log-probs after top-k/top-p

With --logprob-chain a job also writes, every step and rank, what `parity onpolicy` needs to test
torchtitan's chain link by link (`ChainRecorder`): the trainer at a second micro-batch size, the
rollout engine's own prefill (one forward over prompt + response, laid out as `generate` lays
out its batch: left padding, positions from the attention mask), and per-layer fingerprints.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import replace

import torch

from worker.data.batching import BatchingConfig, micro_batch_members
from worker.distributed import all_reduce_sum
from worker.losses import token_log_probs
from worker.trainers.ppo_common import PPOJob, RolloutSample, response_positions

CHAIN_DIR = "onpolicy"
ROLLOUT_KINDS = (("", "rollout_log_probs"), ("processed_", "rollout_processed_log_probs"))


def mismatch_metrics(job: PPOJob, samples: list[RolloutSample]) -> dict[str, float]:
    """The rollout-vs-trainer gap over every response token of the global batch."""
    device = job.dist.device
    positions = [response_positions(s) for s in samples]
    trainer = _response_values(samples, positions, "old_log_probs")
    metrics = {}
    for prefix, key in ROLLOUT_KINDS:
        rollout = _response_values(samples, positions, key)
        diff = trainer.double() - rollout.double()
        k3 = torch.expm1(diff) - diff
        peak = diff.abs().max() if diff.numel() else diff.new_zeros(())
        sums = torch.stack(
            [
                diff.abs().sum(),
                (trainer != rollout).sum().double(),  # compared in float32, the sources' precision
                k3.sum(),
                torch.tensor(float(diff.numel()), dtype=torch.float64),
            ]
        )
        total_abs, differing, total_k3, count = all_reduce_sum(sums, device).tolist()
        peak_t = peak.reshape(1).to(device)
        torch.distributed.all_reduce(peak_t, op=torch.distributed.ReduceOp.MAX)
        count = max(count, 1.0)
        metrics[f"rollout/{prefix}logprob_diff_max"] = float(peak_t.item())
        metrics[f"rollout/{prefix}logprob_diff_mean"] = total_abs / count
        metrics[f"rollout/{prefix}logprob_diff_frac"] = differing / count
        metrics[f"rollout/{prefix}k3_kl"] = total_k3 / count
    return metrics


def _response_values(samples: list[RolloutSample], positions: list, key: str) -> torch.Tensor:
    """The extra `key` at each sample's response positions, concatenated (float32)."""
    parts = [s.extras[key][pos].float() for s, pos in zip(samples, positions, strict=True)]
    return torch.cat(parts) if parts else torch.zeros(0)


# --- the chain's data ---------------------------------------------------------------------------


def chain_batching(cfg, per_rank: int) -> BatchingConfig:
    """The trainer's second micro-batching for link 1: this rank's share in one micro-batch, or
    one sequence per micro-batch when the job already uses the whole share."""
    batching = cfg.batching()
    own = None if batching.dynamic_bsz else batching.micro_batch_size
    size = 1 if own == per_rank else per_rank
    return replace(batching, micro_batch_size=size, dynamic_bsz=False)


@torch.no_grad()
def prefill_log_probs(job: PPOJob, samples: list[RolloutSample]) -> list[torch.Tensor]:
    """The rollout engine's log-probs of each response from one forward over prompt + response,
    in generate's layout (left-padded prompts, responses after them, positions from the mask)."""
    cfg, d = job.cfg, job.dist
    prompt_lens = [len(s) - s.response_length for s in samples]
    width = max(prompt_lens)
    total = width + max(s.response_length for s in samples)
    pad = job.tokenizer.pad_token_id
    ids = torch.full((len(samples), total), pad, dtype=torch.int64)
    attention = torch.zeros_like(ids)
    for i, (s, p) in enumerate(zip(samples, prompt_lens, strict=True)):
        ids[i, width - p : width - p + len(s)] = s.input_ids
        attention[i, width - p : width - p + len(s)] = 1
    positions = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 1)  # as generate does
    with job.actor.gathered():
        logits = job.actor.model(
            input_ids=ids.to(d.device), attention_mask=attention.to(d.device),
            position_ids=positions.to(d.device),
        ).logits  # fmt: skip
    out = []
    for i, s in enumerate(samples):
        n = s.response_length
        row = logits[i, width - 1 : width - 1 + n]
        labels = ids[i, width : width + n].to(d.device)
        out.append(token_log_probs(row, labels, cfg.temperature).cpu())
    return out


class ChainRecorder:
    """--logprob-chain: what `parity onpolicy` reads, one safetensors file per step and rank.

    Per response token: the log-probs of the rollout's decode (raw and processed), of the rollout
    engine's prefill and of the trainer at micro-batch sizes m and n; and per kind a fingerprint
    of every decoder layer's output (and the final norm's) at the position that predicts the
    token, so the judge can name the first layer where a broken link's two sides part. A trainer
    wraps its rollout and its old_log_probs pass in `capture(kind)`; off, it does nothing.
    """

    def __init__(self, job: PPOJob):
        self.job, self.enabled = job, job.cfg.logprob_chain
        self.calls: dict[str, list[list[torch.Tensor]]] = {}

    @contextlib.contextmanager
    def capture(self, kind: str) -> Iterator[None]:
        """Keep each forward's per-layer outputs of the actor while the block runs."""
        if not self.enabled:
            yield
            return
        trunk = self.job.actor.model.model
        modules = [*trunk.layers, trunk.norm]
        calls: list[list[torch.Tensor]] = []
        self.calls[kind] = calls

        def hook(index: int):
            def keep(module, args, output) -> None:
                out = output[0] if isinstance(output, tuple) else output
                if index == 0:
                    calls.append([])
                calls[-1].append(out.detach().float().cpu())

            return keep

        handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(modules)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def write(self, step: int, samples: list[RolloutSample], n: int) -> None:
        """This rank's file for one step, atomically (temp file, then rename)."""
        from safetensors.torch import save_file

        job = self.job
        cfg, d = job.cfg, job.dist
        with self.capture("prefill"):
            prefill = prefill_log_probs(job, samples)
        layers = self._layer_fingerprints(samples)
        tensors = {}
        for i, s in enumerate(samples):
            pos = response_positions(s)
            tensors[f"decode/{i}"] = s.extras["rollout_log_probs"][pos].float()
            tensors[f"processed/{i}"] = s.extras["rollout_processed_log_probs"][pos].float()
            tensors[f"trainer_m/{i}"] = s.extras["old_log_probs"][pos].float()
            tensors[f"trainer_n/{i}"] = s.extras["chain_log_probs"][pos].float()
            tensors[f"prefill/{i}"] = prefill[i].float()
            tensors[f"tokens/{i}"] = s.input_ids[len(s) - s.response_length :].clone()
            for kind, per_sample in layers.items():
                tensors[f"layers/{kind}/{i}"] = per_sample[i]
        batching = cfg.batching()
        names = [f"model.layers.{i}" for i in range(len(job.actor.model.model.layers))]
        meta = {
            "step": step, "rank": d.rank, "world": d.world, "sequences": len(samples),
            "m": "dynamic" if batching.dynamic_bsz else batching.micro_batch_size, "n": n,
            "packed": batching.packed, "temperature": cfg.temperature, "top_k": cfg.top_k,
            "top_p": cfg.top_p, "batch_invariant": cfg.batch_invariant, "trainer": cfg.trainer,
            "layers": [*names, "model.norm"],
        }  # fmt: skip
        folder = cfg.out / CHAIN_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step{step:05d}-rank{d.rank}.safetensors"
        tmp = path.with_name(path.name + ".tmp")
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, str(tmp), {"meta": json.dumps(meta)})
        os.replace(tmp, path)
        self.calls.clear()

    def _layer_fingerprints(self, samples: list[RolloutSample]) -> dict[str, list]:
        """kind -> per sample [response tokens, layers] int64 fingerprints of the hidden state
        at the position predicting each response token, for every kind captured this step."""
        prompt = [len(s) - s.response_length for s in samples]
        width = max(prompt)
        out = {}
        for kind, calls in self.calls.items():
            if not calls:
                continue
            if kind == "decode":  # first call: the prompts; call t: response token t
                per_call = [torch.stack(c)[:, :, -1] for c in calls]  # [layers, B, H]
                stacked = torch.stack(per_call, 2)  # [layers, B, new tokens, H]
                rows = [stacked[:, i, : s.response_length] for i, s in enumerate(samples)]
            elif kind == "prefill":  # one call; responses start at column width
                hidden = torch.stack(calls[0])  # [layers, B, T, H]
                rows = [hidden[:, i, width - 1 : width - 1 + s.response_length]
                        for i, s in enumerate(samples)]  # fmt: skip
            else:
                batching = self.job.cfg.batching()
                if kind == "trainer_n":
                    batching = chain_batching(self.job.cfg, len(samples))
                rows = _trainer_rows(calls, samples, prompt, batching)
            out[kind] = [fingerprint(r.transpose(0, 1)) for r in rows]
        return out


def _trainer_rows(calls, samples, prompt, batching) -> list[torch.Tensor]:
    """Per sample [layers, response tokens, H] from the trainer's micro-batch forwards."""
    members = micro_batch_members(samples, batching, len(calls))
    rows: list[torch.Tensor | None] = [None] * len(samples)
    for call, idx in zip(calls, members, strict=True):
        hidden = torch.stack(call)  # [layers, rows, T, H]
        offset = 0
        for j, i in enumerate(idx):
            s, p = samples[i], prompt[i]
            row = hidden[:, 0, offset : offset + len(s)] if batching.packed else hidden[:, j]
            rows[i] = row[:, p - 1 : p - 1 + s.response_length]
            offset += len(s)
    return rows  # type: ignore[return-value]


_WEIGHTS = torch.randint(1, 2**62, (4096,), generator=torch.Generator().manual_seed(23)) | 1


def fingerprint(hidden: torch.Tensor) -> torch.Tensor:
    """[..., H] float32 -> [...] int64: a hash of each vector's bits (a weighted sum of its int32
    words, wrapping), equal for equal bits; a collision would need 2^-64 luck."""
    words = hidden.contiguous().view(torch.int32).to(torch.int64)
    return (words * _WEIGHTS[: words.shape[-1]]).sum(-1)
