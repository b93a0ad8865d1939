"""The launch tests' shared fixture: the catalogue's plain launches, made once per session (once
per run of pytest-xdist's workers too: the first to need them makes them, the other reads them)."""

from __future__ import annotations

import fcntl
import os

import pytest

from tests.run.catalogue import CatalogueRuns, read_catalogue, run_catalogue


@pytest.fixture(scope="session")
def catalogue_runs(tmp_path_factory) -> CatalogueRuns:
    """Every preset with every mutant, then clean, through plain launches, in-process and a pool
    (tests/run/catalogue.py); the fast-path and Slurm differential tests compare against it.
    Under pytest-xdist the workers share one making of it (in the folder above their own, under
    a lock while one makes it; the others read its run folders)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return run_catalogue(tmp_path_factory.mktemp("catalogue"))
    shared = tmp_path_factory.getbasetemp().parent
    with open(shared / "catalogue.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (shared / "catalogue.made").exists():
            return read_catalogue(shared / "catalogue")
        runs = run_catalogue(shared / "catalogue")
        (shared / "catalogue.made").touch()
        return runs
