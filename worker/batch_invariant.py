"""`--batch-invariant`: a forward whose per-token result depends neither on how many rows share a
call nor on KV-cache decode vs a full prefill, for the reference model on CPU.

What breaks invariance in the default forward, measured on this project's CPUs (torch 2.13):
- a matmul computes a row with another kernel when the call has fewer than 4 rows (the GEMV
  path), so a decode step (one row per sequence) and a prefill round the same row differently;
  from 4 rows on, a row's bits are the same whatever the row count and position;
- attention reduces over every key of the call: where a sequence starts in its row (left
  padding in the rollout, packing in the trainer) and how many keys the call has decide which
  partial sums the vectorized softmax and the scores-times-values product form;
- rotary cos/sin are computed per call, and the tail of a call that is not a multiple of the
  vector width goes through the scalar libm path: a position can get another last bit.

The fix, all through the hooks the model offers (no file of transformers is edited):
- every Linear is a `BatchInvariantLinear`: rows padded with zeros to at least `MIN_ROWS`;
- attention is registered with transformers' `AttentionInterface` under `ATTENTION`: each
  sequence's queries see their keys moved to a canonical buffer (the sequence's first key at 0,
  `canonical_keys` long, zeros after), so the scores, the masked softmax and the product with
  the values have the same shapes and positions in the trainer, the prefill and every decode
  step;
- rotary cos/sin come from one table of every position, computed once.

Row-wise ops (RMSNorm, SiLU, log-softmax over the vocabulary) were found invariant as they are.
One intra-op thread per rank (`torch.set_num_threads(1)`): with more, a matmul's rows are split
between threads and a short share takes the small-row path again. `check_matmul_rows()` proves
the matmul property on the host it runs on; the mode refuses a host where it does not hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ATTENTION = "parity_batch_invariant"
MIN_ROWS = 8  # the small-row matmul path ends at 4 rows on the CPUs measured; 8 leaves a margin


def padded_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a's rows (dim -2) padded with zeros to MIN_ROWS, so no call takes the
    small-row path: each row's bits then depend on that row and b only."""
    rows = a.shape[-2]
    if rows >= MIN_ROWS:
        return a @ b
    return (F.pad(a, (0, 0, 0, MIN_ROWS - rows)) @ b)[..., :rows, :]


class BatchInvariantLinear(torch.nn.Linear):
    """nn.Linear whose output rows do not depend on the number of rows in the call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = padded_matmul(flat, self.weight.t())
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _allowed(mask: torch.Tensor | None, b: int, tq: int, tk: int, device) -> torch.Tensor:
    """The [B, Tq, Tk] boolean mask (True: attend) from what transformers passes: a boolean or
    additive 4-D mask, or None for plain causal attention."""
    if mask is None:
        q = torch.arange(tq, device=device)[:, None] + (tk - tq)
        return (torch.arange(tk, device=device)[None, :] <= q).expand(b, tq, tk)
    mask = mask[:, 0] if mask.dim() == 4 else mask
    allowed = mask if mask.dtype == torch.bool else mask == 0
    return allowed.expand(b, tq, tk)


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention in a canonical layout per sequence (see the module docstring).

    query [B, H, Tq, D], key/value [B, Hkv, Tk, D]; returns ([B, Tq, H, D], None) as
    transformers' sdpa does. Each query's allowed keys must be one contiguous run (causal with
    padding or packing); anything else is refused rather than computed another way.
    """
    if dropout:
        raise ValueError("batch-invariant attention has no dropout")
    bsz, heads, tq, dim = query.shape
    tk = key.shape[2]
    repeat = heads // key.shape[1]
    key = key.repeat_interleave(repeat, dim=1)
    value = value.repeat_interleave(repeat, dim=1)
    scaling = dim**-0.5 if scaling is None else scaling
    length = canonical_keys(module)
    allowed = _allowed(attention_mask, bsz, tq, tk, query.device)
    count = allowed.sum(-1)
    first = allowed.int().argmax(-1)
    last = tk - 1 - allowed.flip(-1).int().argmax(-1)
    if bool(((count > 0) & (last - first + 1 != count)).any()):
        raise ValueError("batch-invariant attention: a query's keys are not one contiguous run")
    if int(count.max()) > length:
        raise ValueError(f"batch-invariant attention: {int(count.max())} keys > {length}")
    out = query.new_zeros(bsz, heads, tq, dim)
    positions = torch.arange(length, device=query.device)
    for b in range(bsz):
        live = count[b] > 0
        for start in first[b][live].unique().tolist():
            rows = ((first[b] == start) & live).nonzero().squeeze(1)
            k = _canonical(key[b, :, start : start + length], length)
            v = _canonical(value[b, :, start : start + length], length)
            scores = padded_matmul(query[b][:, rows], k.transpose(-1, -2)) * scaling
            keep = positions[None, :] < count[b, rows][:, None]
            probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
            out[b, :, rows] = padded_matmul(probs, v)
    return out.transpose(1, 2).contiguous(), None


def _canonical(x: torch.Tensor, length: int) -> torch.Tensor:
    """[H, n, D] keys or values of one sequence from its first key on, zero-padded to length."""
    return F.pad(x, (0, 0, 0, length - x.shape[1]))


def canonical_keys(module) -> int:
    """The canonical key buffer's length: the model's position limit, rounded up to 64 so the
    softmax rows are whole vectors."""
    limit = int(module.config.max_position_embeddings)
    return -(-limit // 64) * 64


class RotaryTable(torch.nn.Module):
    """cos/sin of every position computed once by the model's own rotary module, then looked up:
    a position's values do not depend on which call asks for them."""

    def __init__(self, rotary: torch.nn.Module, positions: int):
        super().__init__()
        self.rotary = rotary
        with torch.no_grad():
            probe = torch.zeros(1, dtype=torch.float32)
            cos, sin = rotary(probe, torch.arange(positions)[None])
        self.register_buffer("cos", cos[0], persistent=False)
        self.register_buffer("sin", sin[0], persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)


def register() -> None:
    """Make ATTENTION a name transformers accepts as attn_implementation (with sdpa's masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


def make_batch_invariant(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a loaded causal LM (or value model) to the batch-invariant forward, in place."""
    check_matmul_rows()
    register()
    model.config._attn_implementation = ATTENTION
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = BatchInvariantLinear
    trunk = model.model
    trunk.rotary_emb = RotaryTable(trunk.rotary_emb, int(model.config.max_position_embeddings))
    return model


def check_matmul_rows(k: int = 64, n: int = 96) -> None:
    """Refuse the mode on a host whose matmul rounds a row by the number of rows in the call
    (from MIN_ROWS on), since every other guarantee here rests on it."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    whole = a @ b
    for start, stop in ((0, MIN_ROWS), (5, 5 + MIN_ROWS + 3), (17, 64)):
        if not torch.equal(padded_matmul(a[start:stop], b), whole[start:stop]):
            raise RuntimeError(
                f"--batch-invariant: on this host a matmul row's bits depend on the rows in the "
                f"call (rows {start}-{stop} of 64 differ with {torch.get_num_threads()} threads; "
                "the mode needs torch.set_num_threads(1), which the PPO job sets)"
            )
