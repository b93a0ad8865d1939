"""Hashes that let the harness say *where* two runs part: which batches, which tensors.

A `DataDigest` folds every micro-batch a rank runs into a running hash per kind ("train", "val";
PPO also "prompts" and "rollout"); `model_fingerprint` hashes every full parameter and gradient.
The recorder writes them next to metrics.jsonl (ranks/rank{r}.jsonl, fingerprints.jsonl) and
`parity.judge.diagnose` reads the files. Hashes are short blake2b hex digests of shape, dtype and
raw
bytes, so they are equal exactly when the bits are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

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
    """What one rank ran since the last take(), per kind: a running hash of the tensors of each
    micro-batch (or of each prompt), plus counts to quote."""

    def __init__(self) -> None:
        self._h: dict[str, Any] = {}
        self._counts: dict[str, dict[str, int]] = {}

    def _start(self, kind: str, counts: tuple[str, ...]):
        h = self._h.get(kind)
        if h is None:
            h = self._h[kind] = hashlib.blake2b(digest_size=DIGEST_SIZE)
            self._counts[kind] = dict.fromkeys(counts, 0)
        return h, self._counts[kind]

    def pending(self) -> list[str]:
        """The kinds with batches folded in since the last take()."""
        return sorted(self._h)

    def add_tensors(
        self,
        kind: str,
        tensors: Sequence[torch.Tensor | None],
        tokens: int,
        loss_tokens: int | None = None,
    ) -> None:
        """Fold one micro-batch, given as its tensors in a fixed order, into the digest of `kind`;
        `loss_tokens` (the tokens the loss counts) defaults to `tokens`."""
        h, counts = self._start(kind, ("micro_batches", "tokens", "loss_tokens"))
        for t in tensors:
            _update(h, t)
        counts["micro_batches"] += 1
        counts["tokens"] += int(tokens)
        counts["loss_tokens"] += int(tokens if loss_tokens is None else loss_tokens)

    def add(self, kind: str, mb) -> None:
        """Fold one micro-batch with input_ids, labels, position_ids, loss_mask, attention_mask
        and num_tokens (worker.data.batching.MicroBatch) into the digest of `kind`."""
        tensors = (mb.input_ids, mb.labels, mb.position_ids, mb.loss_mask, mb.attention_mask)
        self.add_tensors(kind, tensors, int(mb.num_tokens), int(mb.loss_mask.sum()))

    def add_prompts(self, prompts: list[list[int]], kind: str = "prompts") -> None:
        """Fold this step's prompts (token ids, in order) into the digest of `kind`."""
        h, counts = self._start(kind, ("prompts", "tokens"))
        for ids in prompts:
            _update(h, torch.tensor(ids, dtype=torch.int64))
        counts["prompts"] += len(prompts)
        counts["tokens"] += sum(len(ids) for ids in prompts)

    def take(self) -> dict:
        """{kind: {"hash", and the counts}} so far, then reset."""
        out = {
            kind: {"hash": h.hexdigest(), **self._counts[kind]}
            for kind, h in sorted(self._h.items())
        }
        self._h, self._counts = {}, {}
        return out


def parse_steps(text: str) -> list[int] | str:
    """Fingerprint steps: "1,5,10", "" (none) or "all"; raises ValueError on anything else."""
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


def chosen_steps(steps: str | Iterable[int] | None) -> list[int] | str:
    """Fingerprint steps as given to a recorder ("1,5", "all", [1, 5], None) in one form."""
    if steps is None:
        return []
    if isinstance(steps, str):
        return parse_steps(steps)
    return sorted({int(s) for s in steps})


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
