"""What a test needs beyond the harness's lean install (``pip install -e '.[test]'``: no torch,
no reference subject, no writers), as skips that say so. torch and a writer package are asked
for with ``pytest.importorskip`` where they are used; the reference subject here."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution

import pytest

SUBJECT = "needs the reference subject (pip install -e ./worker)"
SUBJECT_DIST = "llm-parity-worker"  # worker/pyproject.toml


def subject_installed() -> bool:
    """The reference subject's distribution is installed (with torch and transformers): its
    jobs can run. Its presets alone may be registered without it (tests/conftest.py)."""
    try:
        distribution(SUBJECT_DIST)
    except PackageNotFoundError:
        return False
    return True


#: a test that runs the reference subject's code (its jobs, its modules that import torch)
subject = pytest.mark.skipif(not subject_installed(), reason=SUBJECT)
