"""Helpers several test files share: live processes of a launch, and the float64 val-loss oracle."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def interruptible() -> None:
    """Popen(preexec_fn=interruptible): a child that a SIGINT interrupts even when this test run
    ignores SIGINT (a shell's background job does, and a Python started so installs no handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def procs_mentioning(text: str) -> list[str]:
    """Live (non-zombie) processes whose command line contains ``text`` (a test's unique
    folder), as "pid state: command line" so that a failing assertion shows what was left."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ")
            state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and text.encode() in cmdline:
            found.append(f"{entry.name} {state}: {cmdline.decode(errors='replace').strip()}")
    return found


def oracle_val_loss(weights: dict | None = None, samples: int | None = None) -> float:
    """Token-weighted mean NLL over the val set (or its first `samples`), one sample at a time,
    in float64: an independent check of the trainers' val/loss."""
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
