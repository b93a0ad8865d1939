"""The one loss-aggregation function, and the SFT loss built on it.

Every micro-batch loss is normalized by *global* counts (all ranks, all micro-batches of the step)
and multiplied by dp, because DDP/FSDP average gradients over ranks: summing the micro-batch
losses of all ranks and dividing by dp then gives exactly the full-batch value, whatever the
split into micro-batches and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossScale:
    """Global normalizers of one step: loss tokens and sequences over every rank, and dp."""

    global_tokens: float  # loss-mask sum over the global batch
    global_seqs: float  # sequences in the global batch
    dp: int
    horizon: float = 1.0  # constant length for seq-mean-token-sum-norm (e.g. max length)


def agg_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_seqs: int,
    mode: str,
    scale: LossScale,
) -> torch.Tensor:
    """Aggregate per-token values of one micro-batch into its share of the global loss.

    values, mask, seq_ids: flat [T] tensors; seq_ids numbers the sequences 0..num_seqs-1.
    - token-mean:              sum(v*m) / N_tokens * dp
    - seq-mean-token-sum:      sum_s(sum_t v*m) / N_seqs * dp
    - seq-mean-token-mean:     sum_s(mean_t v over the sequence's loss tokens) / N_seqs * dp
    - seq-mean-token-sum-norm: sum_s(sum_t v*m) / (N_seqs * horizon) * dp
    """
    masked = values * mask.to(values.dtype)
    if mode == "token-mean":
        return masked.sum() / scale.global_tokens * scale.dp
    seq_sums = values.new_zeros(num_seqs).index_add_(0, seq_ids, masked)
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / scale.global_seqs * scale.dp
    if mode == "seq-mean-token-mean":
        seq_tokens = values.new_zeros(num_seqs).index_add_(0, seq_ids, mask.to(values.dtype))
        return (seq_sums / seq_tokens.clamp(min=1)).sum() / scale.global_seqs * scale.dp
    if mode == "seq-mean-token-sum-norm":
        return seq_sums.sum() / (scale.global_seqs * scale.horizon) * scale.dp
    raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {AGG_MODES}")


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood in float32, flat [T]."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none"
    )


def sft_loss(logits: torch.Tensor, mb, scale: LossScale, mode: str = "token-mean"):
    """SFT loss of one micro-batch; returns (loss, per-rank metrics)."""
    nll = token_nll(logits, mb.labels)
    loss = agg_loss(nll, mb.loss_mask.reshape(-1), mb.seq_ids.reshape(-1), mb.num_seqs, mode, scale)
    return loss, {}
