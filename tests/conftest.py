"""Fixtures the test folders share. Shared job specs are plain data in specs.py (pytest's
parametrize needs them at import), and the process check the launch tests share in run/procs.py."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest


@pytest.fixture
def interruptible() -> Callable[[], None]:
    """Popen(preexec_fn=interruptible): a child that a SIGINT interrupts even when this test run
    ignores SIGINT (a shell's background job does, and a Python started so installs no handler)."""
    return _default_sigint


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def oracle_val_loss() -> Callable[..., float]:
    """oracle_val_loss(weights=None, samples=None): the token-weighted mean NLL over the val set
    (or its first `samples`), one sample at a time, in float64: an independent check of the
    trainers' val/loss."""
    return _oracle_val_loss


def _oracle_val_loss(weights: dict | None = None, samples: int | None = None) -> float:
    import torch

    from worker.data.batching import collate
    from worker.data.charcount import DATA_DIR, encode, load_tokenizer, read_jsonl
    from worker.model import load_model

    model = load_model(attn="eager").double()
    if weights is not None:
        model.load_state_dict({k: v.double() for k, v in weights.items()}, strict=False)
    tok = load_tokenizer()
    nll_sum, tokens = 0.0, 0
    with torch.no_grad():
        for sample in read_jsonl(DATA_DIR / "val.jsonl")[:samples]:
            mb = collate([encode(sample, tok, 512)])
            logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), mb.labels.reshape(-1), reduction="none"
            )
            nll_sum += float((nll * mb.loss_mask.reshape(-1)).sum())
            tokens += mb.num_loss_tokens
    return nll_sum / tokens
