"""The launch tests' shared fixture: the catalogue's plain launches, made once per session."""

from __future__ import annotations

import pytest

from tests.run.catalogue import CatalogueRuns, run_catalogue


@pytest.fixture(scope="session")
def catalogue_runs(tmp_path_factory) -> CatalogueRuns:
    """Every preset with every mutant, then clean, through plain launches, in-process and a pool
    (tests/run/catalogue.py); the fast-path and Slurm differential tests compare against it."""
    return run_catalogue(tmp_path_factory.mktemp("catalogue"))
