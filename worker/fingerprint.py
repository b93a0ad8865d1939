"""Hashes that let the harness say *where* two runs part: which batches, which tensors.

The engine feeds every micro-batch it runs through a `DataDigest` (training apart from
evaluation, or, in PPO, from the rollout's scoring forwards; PPO also digests each step's prompts)
and, at chosen steps, hashes every full parameter and gradient. The job writes them next to
metrics.jsonl (ranks/rank{r}.jsonl, fingerprints.jsonl) through the recorder; `parity.diagnose`
reads the files. The code is the recorder's (`parity.record.digest`), which any training loop
uses: one way to hash a run.
"""

from __future__ import annotations

from parity.record.digest import (
    DIGEST_SIZE,
    DataDigest,
    model_fingerprint,
    parse_steps,
    tensor_hash,
)

__all__ = ["DIGEST_SIZE", "DataDigest", "model_fingerprint", "parse_steps", "tensor_hash"]
