"""parity: prove that a training refactor changed no number, or say where it did."""

from __future__ import annotations

__all__ = ["assert_parity"]


def __getattr__(name: str):
    if name == "assert_parity":  # lazy: the CLI should not import pytest
        from parity.plugin import assert_parity

        return assert_parity
    raise AttributeError(name)
