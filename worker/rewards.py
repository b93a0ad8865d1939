"""The reward-model slot of PPO: a registry of implementations by name.

As in the original stack, the rule-based charcount reward exists only as a legacy implementation;
the engine PPO looks for an engine version first and falls back to it. A name found nowhere fails
the job before any process group exists, with one line on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Callable

BOXED = re.compile(r"\\boxed\{(\d+)\}")

RewardModel = Callable[[list[str], list[dict]], list[float]]


def charcount_score(response: str, sample: dict) -> float:
    """1.0 when the first `\\boxed{k}` in the response holds the right count, else 0.0."""
    m = BOXED.search(response)
    return 1.0 if m is not None and int(m.group(1)) == int(sample["count"]) else 0.0


class RuleRewardModel:
    """The legacy rule-based reward worker: scores decoded responses against their samples."""

    def __call__(self, responses: list[str], samples: list[dict]) -> list[float]:
        return [charcount_score(r, s) for r, s in zip(responses, samples, strict=True)]


LEGACY_REWARD_MODELS: dict[str, Callable[[], RewardModel]] = {"rule": RuleRewardModel}
ENGINE_REWARD_MODELS: dict[str, Callable[[], RewardModel]] = {}  # none has an engine version yet


def resolve_reward_model(name: str, prefer_engine: bool) -> RewardModel:
    """The engine version of `name` when wanted and present, else the legacy one."""
    if prefer_engine and name in ENGINE_REWARD_MODELS:
        return ENGINE_REWARD_MODELS[name]()
    if name in LEGACY_REWARD_MODELS:
        return LEGACY_REWARD_MODELS[name]()
    raise SystemExit(f"error: reward model {name!r} has no engine or legacy implementation")
