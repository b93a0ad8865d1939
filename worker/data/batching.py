"""Micro-batches: fixed size or dynamic (token budget), packed without padding or padded.

Labels are shifted inside each sequence, so a packed row and a padded batch see exactly the same
(token, label, mask) triples; only the layout differs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from worker.data.charcount import Encoded
from worker.distributed import all_reduce_max, all_reduce_sum


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [1, T] packed or [n, L] padded
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # None when packed (positions mark the sequences)
    labels: torch.Tensor  # same shape as input_ids
    loss_mask: torch.Tensor  # same shape; 1 where the loss is taken
    seq_ids: torch.Tensor  # same shape; index of the sequence each position belongs to
    num_seqs: int
    num_tokens: int  # real (non-pad) tokens
    extras: dict[str, torch.Tensor] | None = None  # per-token tensors, same layout (e.g. PPO)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def model_inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        inputs = {
            "input_ids": self.input_ids.to(device),
            "position_ids": self.position_ids.to(device),
        }
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask.to(device)
        return inputs


def _shifted(sample: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.roll(sample.input_ids, -1)
    mask = torch.roll(sample.loss_mask, -1)
    mask[-1] = 0  # the last token predicts nothing
    return labels, mask


def _extras(samples: list[Encoded], packed: bool, width: int) -> dict[str, torch.Tensor] | None:
    """Per-token extras of samples that carry them (e.g. PPO rollouts), laid out like the labels.

    Extras are stored label-aligned already (position i goes with label i), so they are not shifted.
    """
    first = getattr(samples[0], "extras", None)
    if not first:
        return None
    out = {}
    for key in first:
        values = [s.extras[key] for s in samples]
        if packed:
            out[key] = torch.cat(values)[None]
        else:
            out[key] = values[0].new_zeros(len(values), width)
            for i, v in enumerate(values):
                out[key][i, : len(v)] = v
    return out


def collate(samples: list[Encoded], packed: bool = True, pad_id: int = 0) -> MicroBatch:
    """One micro-batch; an empty list gives a one-token dummy with no loss (keeps ranks in step)."""
    if not samples:
        one = torch.zeros(1, 1, dtype=torch.int64)
        return MicroBatch(one, one.clone(), None, one.clone(), one.clone(), one.clone(), 1, 0)
    shifted = [_shifted(s) for s in samples]
    if packed:
        ids = torch.cat([s.input_ids for s in samples])[None]
        pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
        labels = torch.cat([lab for lab, _ in shifted])[None]
        mask = torch.cat([m for _, m in shifted])[None]
        seq = torch.cat([torch.full((len(s),), i) for i, s in enumerate(samples)])[None]
        extras = _extras(samples, packed, ids.numel())
        return MicroBatch(ids, pos, None, labels, mask, seq, len(samples), ids.numel(), extras)
    width = max(len(s) for s in samples)
    n = len(samples)
    ids = torch.full((n, width), pad_id, dtype=torch.int64)
    labels = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    attn = torch.zeros_like(ids)
    for i, (s, (lab, m)) in enumerate(zip(samples, shifted, strict=True)):
        ids[i, : len(s)] = s.input_ids
        labels[i, : len(s)] = lab
        mask[i, : len(s)] = m
        attn[i, : len(s)] = 1
    pos = torch.arange(width).expand(n, width).contiguous()
    seq = torch.arange(n)[:, None].expand(n, width).contiguous()
    extras = _extras(samples, packed, width)
    return MicroBatch(ids, pos, attn, labels, mask, seq, n, int(attn.sum()), extras)


def split_fixed(samples: list[Encoded], micro_batch_size: int) -> list[list[Encoded]]:
    return [samples[i : i + micro_batch_size] for i in range(0, len(samples), micro_batch_size)]


def dynamic_count(samples: list[Encoded], max_tokens: int) -> int:
    """Smallest number of micro-batches whose balanced partition fits the token budget."""
    too_long = [len(s) for s in samples if len(s) > max_tokens]
    if too_long:
        raise ValueError(
            f"a sequence of {too_long[0]} tokens exceeds max_tokens_per_rank={max_tokens}"
        )
    total = sum(len(s) for s in samples)
    count = max(1, -(-total // max_tokens))
    while (
        max((sum(len(s) for s in g) for g in split_dynamic(samples, count)), default=0) > max_tokens
    ):
        count += 1
    return count


def split_dynamic(samples: list[Encoded], count: int) -> list[list[Encoded]]:
    """Balanced partition into exactly `count` groups: longest first onto the lightest group.

    Each group keeps the samples' original order, so the result is a pure function of the input.
    """
    return [[samples[i] for i in g] for g in dynamic_groups([len(s) for s in samples], count)]


def dynamic_groups(lengths: list[int], count: int) -> list[list[int]]:
    """split_dynamic's partition as sample indices (each group ascending)."""
    loads = [0] * count
    members: list[list[int]] = [[] for _ in range(count)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        g = min(range(count), key=lambda g: (loads[g], g))
        loads[g] += lengths[i]
        members[g].append(i)
    return [sorted(m) for m in members]


def step_order(
    n: int, global_batch: int, rank: int, world: int, seed: int, steps: range
) -> Iterator[tuple[int, int, list[int]]]:
    """(step, epoch, this rank's sample indices) for 1-based steps, epoch after epoch.

    torch's DistributedSampler with set_epoch: the global batch of a step is the same set of
    samples for every world size, interleaved over the ranks.
    """
    from torch.utils.data import DistributedSampler

    per_rank, per_epoch = global_batch // world, n // global_batch
    sampler = DistributedSampler(
        range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    for step in steps:
        epoch, index = divmod(step - 1, per_epoch)
        sampler.set_epoch(epoch)
        yield step, epoch, list(sampler)[index * per_rank : (index + 1) * per_rank]


@dataclass(frozen=True)
class BatchingConfig:
    micro_batch_size: int | None = 4
    dynamic_bsz: bool = False
    max_tokens_per_rank: int = 2048
    packed: bool = True
    horizon: float = 1.0

    @classmethod
    def of(cls, job_config: Any, horizon: int) -> BatchingConfig:
        """The batching flags every job config (SFT, PPO) carries, with that job's horizon:
        the constant length of seq-mean-token-sum-norm (SFT: max length, PPO: new tokens)."""
        return cls(
            micro_batch_size=job_config.micro_batch_size,
            dynamic_bsz=job_config.dynamic_bsz,
            max_tokens_per_rank=job_config.max_tokens_per_rank,
            packed=job_config.packed,
            horizon=float(horizon),
        )


def make_micro_batches(
    samples: list[Encoded], cfg: BatchingConfig, device: torch.device
) -> list[MicroBatch]:
    """Split a rank's share into micro-batches; every rank ends with the same count."""
    if cfg.dynamic_bsz:
        count = all_reduce_max(dynamic_count(samples, cfg.max_tokens_per_rank), device)
        groups = split_dynamic(samples, count)
    else:
        groups = split_fixed(samples, cfg.micro_batch_size)
        count = all_reduce_max(len(groups), device)
        groups += [[] for _ in range(count - len(groups))]
    return [collate(g, packed=cfg.packed) for g in groups]


def micro_batch_members(samples: list[Encoded], cfg: BatchingConfig, count: int) -> list[list[int]]:
    """Which samples each of make_micro_batches' `count` micro-batches holds, as indices in
    their order there (an empty list for a dummy)."""
    if cfg.dynamic_bsz:
        return dynamic_groups([len(s) for s in samples], count)
    index = list(range(len(samples)))
    groups = split_fixed(index, cfg.micro_batch_size)  # type: ignore[arg-type]
    return groups + [[] for _ in range(count - len(groups))]


def global_sample_counts(
    samples: list[Encoded], device: torch.device
) -> tuple[float, float, float]:
    """global_counts of these samples however they are cut into micro-batches: (loss tokens,
    sequences, attention tokens) over every rank, counted from the samples themselves."""
    local = torch.tensor(
        [
            float(sum(int(_shifted(s)[1].sum()) for s in samples)),
            float(len(samples)),
            float(sum(len(s) for s in samples)),
        ],
        dtype=torch.float64,
    )
    tokens, seqs, attn = all_reduce_sum(local, device).tolist()
    return tokens, seqs, attn


def global_counts(mbs: list[MicroBatch], device: torch.device) -> tuple[float, float, float]:
    """(loss tokens, sequences, attention tokens) summed over every rank's micro-batches."""
    local = torch.tensor(
        [
            float(sum(mb.num_loss_tokens for mb in mbs)),
            float(sum(mb.num_seqs for mb in mbs if mb.num_tokens)),
            float(sum(mb.num_tokens for mb in mbs)),
        ],
        dtype=torch.float64,
    )
    tokens, seqs, attn = all_reduce_sum(local, device).tolist()
    return tokens, seqs, attn
