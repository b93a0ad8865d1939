"""Hashes that let the harness say *where* two runs part: which batches, which tensors.

The engine feeds every micro-batch it runs through a `DataDigest` (training and evaluation
apart) and, at chosen steps, hashes every full parameter and gradient. The job writes them next
to metrics.jsonl (ranks/rank{r}.jsonl, fingerprints.jsonl); `parity.diagnose` reads the files.
Hashes are short blake2b hex digests of the raw bytes, so they are equal exactly when the bits are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

DIGEST_SIZE = 8  # 16 hex characters: plenty to tell two batches or tensors apart


def _update(h, t: torch.Tensor | None) -> None:
    """Shape, dtype and bytes of one tensor (None hashes as a marker, not as nothing)."""
    if t is None:
        h.update(b"none;")
        return
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    t = t.cpu().contiguous()
    h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def tensor_hash(t: torch.Tensor | None) -> str | None:
    """Hex digest of one tensor's shape, dtype and bytes (a DTensor is gathered first)."""
    if t is None:
        return None
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    _update(h, t)
    return h.hexdigest()


class DataDigest:
    """What one rank trained on (or evaluated) since the last take(): a running hash of the
    token ids, labels, positions and loss masks of each micro-batch, plus counts to quote."""

    def __init__(self) -> None:
        self._h: dict[str, object] = {}
        self._counts: dict[str, list[int]] = {}

    def add(self, kind: str, mb) -> None:
        """Fold one micro-batch into the digest of `kind` ("train" or "val")."""
        h = self._h.get(kind)
        if h is None:
            h = self._h[kind] = hashlib.blake2b(digest_size=DIGEST_SIZE)
            self._counts[kind] = [0, 0, 0]
        for t in (mb.input_ids, mb.labels, mb.position_ids, mb.loss_mask, mb.attention_mask):
            _update(h, t)
        counts = self._counts[kind]
        counts[0] += 1
        counts[1] += int(mb.num_tokens)
        counts[2] += int(mb.loss_mask.sum())

    def take(self) -> dict:
        """{kind: {"hash", "micro_batches", "tokens", "loss_tokens"}} so far, then reset."""
        out = {
            kind: {
                "hash": h.hexdigest(),  # type: ignore[attr-defined]
                "micro_batches": self._counts[kind][0],
                "tokens": self._counts[kind][1],
                "loss_tokens": self._counts[kind][2],
            }
            for kind, h in sorted(self._h.items())
        }
        self._h, self._counts = {}, {}
        return out


def parse_steps(text: str) -> list[int] | str:
    """--fingerprint-steps: "1,5,10", "" (none) or "all"; raises ValueError on anything else."""
    text = text.strip()
    if text == "all":
        return "all"
    if not text:
        return []
    steps = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"bad step {part!r} in --fingerprint-steps {text!r}")
        steps.append(int(part))
    return sorted(set(steps))


def model_fingerprint(named: Iterable[tuple[str, torch.nn.Parameter]]) -> dict[str, dict]:
    """{"params": {name: hash}, "grads": {name: hash or None}} in the model's parameter order.

    Every rank must call this together: a sharded (FSDP2) tensor is gathered with full_tensor().
    """
    params: dict[str, str | None] = {}
    grads: dict[str, str | None] = {}
    for name, p in named:
        params[name] = tensor_hash(p)
        grads[name] = tensor_hash(p.grad)
    return {"params": params, "grads": grads}
