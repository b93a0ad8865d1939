"""Which environment variables are secrets, and how they are shown: at the bottom (it imports
nothing of parity), so that the spec, the launchers' reproduce lines and the Slurm step script
all mask the same names without the launchers importing the job model.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["SECRET_WORDS", "is_secret", "masked_env", "secret_vars"]

#: a variable whose name holds one of these (any case) is a secret
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


def is_secret(name: str) -> bool:
    """Whether the variable ``name`` holds a secret (its name holds one of ``SECRET_WORDS``)."""
    return any(w in name.upper() for w in SECRET_WORDS)


def masked_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the values of variables whose names hold TOKEN, KEY, SECRET or PASSWORD
    replaced by ``***``: what may be shown in logs and reports."""
    return {k: "***" if is_secret(k) else v for k, v in env.items()}


def secret_vars(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that ``masked_env`` masks, with their values: what must travel
    only in a private file, never in a log or a script."""
    masked = masked_env(env)
    return {k: v for k, v in env.items() if masked[k] != v}
