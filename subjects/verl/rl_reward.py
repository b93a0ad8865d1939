"""The charcount PPO run's reward: a pure function of the decoded response, so both sides score
the same samples alike (``custom_reward_function.path`` points verl's reward loop at this file).

1.0 when the response holds the right count as ``\\boxed{N}``; otherwise a partial score that
varies from sample to sample (the share of the response's characters that are digits, over 4), so
that the advantages are not all alike even while the policy never answers. Standard library only:
verl imports the file by path inside its reward workers.
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\boxed\{(\d+)\}")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    found = _BOXED.findall(solution_str)
    if found and found[-1] == str(ground_truth):
        return 1.0
    if not solution_str:
        return 0.0
    digits = sum(ch.isdigit() for ch in solution_str)
    return digits / len(solution_str) / 4
