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
    """SFT loss of one micro-batch; returns (loss, metrics): its per-token log-probs (flat [T],
    label-aligned, detached), which the TrainingWorker hands back per sample."""
    nll = token_nll(logits, mb.labels)
    loss = agg_loss(nll, mb.loss_mask.reshape(-1), mb.seq_ids.reshape(-1), mb.num_seqs, mode, scale)
    return loss, {"logprobs": -nll.detach()}


# --- PPO -----------------------------------------------------------------------------------------


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
    """Per-token log-prob of the labels under logits / temperature, flat [T] float32."""
    return -token_nll(logits / temperature, labels)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of the predicted distribution, flat [T] float32."""
    logp = torch.log_softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def policy_loss_terms(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token, and where the clipped branch was taken (as 0/1 floats)."""
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def value_loss_terms(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss per token (0.5 * max of squared errors), and where clipping won."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def mb_extra(mb, key: str, like: torch.Tensor) -> torch.Tensor:
    """A per-token extra of a micro-batch, flat, on like's device; zeros for an empty dummy."""
    if mb.extras is None:
        return torch.zeros(mb.labels.numel(), dtype=like.dtype, device=like.device)
    return mb.extras[key].reshape(-1).to(like.device)


def ppo_policy_loss(
    logits: torch.Tensor,
    mb,
    scale: LossScale,
    mode: str = "token-mean",
    clip: float = 0.2,
    temperature: float = 1.0,
):
    """PPO policy loss of one micro-batch; metrics are its shares of the global values."""
    logp = token_log_probs(logits, mb.labels, temperature)
    old = mb_extra(mb, "old_log_probs", logp)
    pg, clipped = policy_loss_terms(logp, old, mb_extra(mb, "advantages", logp), clip)
    mask, ids = mb.loss_mask.reshape(-1), mb.seq_ids.reshape(-1)
    loss = agg_loss(pg, mask, ids, mb.num_seqs, mode, scale)
    with torch.no_grad():
        clipfrac = agg_loss(clipped, mask, ids, mb.num_seqs, "token-mean", scale)
        kl = agg_loss(old - logp, mask, ids, mb.num_seqs, "token-mean", scale)
        entropy = agg_loss(token_entropy(logits / temperature), mask, ids, mb.num_seqs, mode, scale)
    metrics = {"pg_clipfrac": clipfrac.item(), "ppo_kl": kl.item(), "entropy": entropy.item()}
    return loss, metrics


def ppo_value_loss(
    values: torch.Tensor, mb, scale: LossScale, mode: str = "token-mean", clip: float = 0.5
):
    """Clipped value loss of one micro-batch; `values` is the value model's [.., T, 1] output."""
    v = values.reshape(-1).float()
    vf, clipped = value_loss_terms(
        v, mb_extra(mb, "old_values", v), mb_extra(mb, "returns", v), clip
    )
    mask, ids = mb.loss_mask.reshape(-1), mb.seq_ids.reshape(-1)
    loss = agg_loss(vf, mask, ids, mb.num_seqs, mode, scale)
    with torch.no_grad():
        clipfrac = agg_loss(clipped, mask, ids, mb.num_seqs, "token-mean", scale)
    return loss, {"vf_clipfrac": clipfrac.item()}
