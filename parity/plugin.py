"""pytest plugin: the `parity` marker, fixtures to run jobs and pairs, and assert_parity."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "parity: multi-rank parity test (launches torchrun jobs; slow)"
    )
