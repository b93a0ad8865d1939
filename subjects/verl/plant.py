"""The planted data bug the verl subjects' tests use, parsed in one place: ``PARITY_VERL_PLANT=
repeat-batch@K`` feeds step K the data of step K-1 again (the SFT recorder's engine batch,
``subjects.verl.recorder``; the RL rollout's prompts, ``subjects.verl.rl_rollout``). Standard
library only, and importing it patches nothing (``subjects.verl.recorder`` installs its hooks
when imported, so the RL rollout must not import it).
"""

from __future__ import annotations

import os

PLANT = "PARITY_VERL_PLANT"


def plant() -> int | None:
    """K of ``PARITY_VERL_PLANT=repeat-batch@K`` (None when unset); ValueError when malformed."""
    text = os.environ.get(PLANT, "")
    if not text:
        return None
    kind, _, step = text.partition("@")
    if kind != "repeat-batch" or not step.isdigit() or int(step) < 2:
        raise ValueError(f"{PLANT}={text!r}: expected repeat-batch@K with K >= 2")
    return int(step)
