"""pytest plugin: the `parity` marker, fixtures that run jobs and pairs, and assert_parity.

    @pytest.mark.parity
    def test_refactor_is_bitwise(parity_runner):
        base = JobSpec(world_size=2, steps=20)
        pair = parity_runner.pair(PairSpec.from_trainers(base, "legacy", "worker"))
        assert_parity(pair.a, pair.b)

Runs are cached for the session by spec, so tests that need the same job share one launch.
`--parity-keep-runs DIR` keeps every run folder there for inspection.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import pandas as pd
import pytest

from parity.compare import Comparison, Policy, compare_frames
from parity.spec import JobSpec, PairSpec


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("parity")
    group.addoption(
        "--parity-keep-runs",
        metavar="DIR",
        default=None,
        help="keep the run folders of parity tests under DIR",
    )
    group.addoption(
        "--parity-update-golden",
        action="store_true",
        help="rewrite the golden baselines from this run instead of checking them",
    )
    group.addoption(
        "--parity-golden-dir",
        metavar="DIR",
        default=None,
        help="where golden baselines live (default: <rootdir>/fixtures/golden)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "parity: multi-rank parity test (launches torchrun jobs; slow)"
    )


def _frame(x) -> pd.DataFrame:
    """A metrics frame from a frame, a Run, or a file / run folder."""
    if isinstance(x, pd.DataFrame):
        return x
    if hasattr(x, "metrics"):
        return x.metrics
    from parity.readers import read_metrics

    return read_metrics(x)


def assert_parity(
    a,
    b,
    policies: Mapping[str, Policy | str] | None = None,
    **compare_kwargs,
) -> Comparison:
    """Fail with a readable table of the first divergences unless A and B are aligned.

    a and b: a Run, a metrics frame, or a metrics file / run folder.
    """
    comparison = compare_frames(_frame(a), _frame(b), policies, **compare_kwargs)
    if not comparison.ok:
        pytest.fail(f"parity: {comparison.verdict}\n{comparison.table()}", pytrace=False)
    return comparison


class ParityRunner:
    """Runs jobs and pairs under torchrun, one launch per distinct spec per session."""

    def __init__(self, base_dir: Path):
        self.base_dir = base_dir
        self._runs: dict[tuple, object] = {}

    def _folder(self, spec: JobSpec) -> Path:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{spec.task}-{spec.trainer}-w{spec.world_size}")
        return self.base_dir / f"{len(self._runs):03d}-{name}"

    def job(self, spec: JobSpec):
        from parity.runs import run_job

        key = tuple(spec.to_args(Path("{out}"))) + (spec.world_size, tuple(spec.torchrun_args))
        if key not in self._runs:
            self._runs[key] = run_job(spec, self._folder(spec))
        return self._runs[key]

    def pair(self, pair: PairSpec, policies: Mapping[str, Policy | str] | None = None):
        from parity.runs import PairResult

        spec_a, spec_b = pair.sides()
        a, b = self.job(spec_a), self.job(spec_b)
        return PairResult(a, b, compare_frames(a.metrics, b.metrics, policies), a.dir.parent)


@pytest.fixture(scope="session")
def parity_runner(request: pytest.FixtureRequest, tmp_path_factory) -> ParityRunner:
    keep = request.config.getoption("--parity-keep-runs")
    base = Path(keep).resolve() if keep else tmp_path_factory.mktemp("parity-runs")
    base.mkdir(parents=True, exist_ok=True)
    return ParityRunner(base)


class GoldenChecker:
    """`parity_golden.check(name, run)`: compare a run with fixtures/golden/<name>, or rewrite."""

    def __init__(self, golden_dir: Path, update: bool):
        self.golden_dir, self.update = golden_dir, update

    def check(self, name: str, run, policies: Mapping[str, Policy | str] | None = None):
        from parity.golden import save_golden, verify_golden

        path = self.golden_dir / name
        if self.update:
            save_golden(path, run.dir, spec=run.spec.to_dict())
        result = verify_golden(path, run.dir, policies)
        if not result.ok:
            pytest.fail(f"{path}: {result.message()}", pytrace=False)
        return result


@pytest.fixture
def parity_golden(request: pytest.FixtureRequest) -> GoldenChecker:
    config = request.config
    where = config.getoption("--parity-golden-dir")
    golden_dir = Path(where).resolve() if where else config.rootpath / "fixtures" / "golden"
    return GoldenChecker(golden_dir, config.getoption("--parity-update-golden"))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Print the mutation score: every mutant test reports whether its check caught it."""
    caught = getattr(config, "_parity_mutants", None)
    if not caught:
        return
    n = sum(caught.values())
    missed = sorted(name for name, ok in caught.items() if not ok)
    terminalreporter.write_sep("-", "parity mutation score")
    terminalreporter.write_line(
        f"mutation score: {n}/{len(caught)} caught ({100.0 * n / len(caught):.0f}%)"
        + (f"; NOT caught: {', '.join(missed)}" if missed else "")
    )


@pytest.fixture
def parity_mutant_score(request: pytest.FixtureRequest):
    """Call with (name, caught) from a mutant test; the session prints the mutation score."""
    store = request.config.__dict__.setdefault("_parity_mutants", {})

    def record(name: str, caught: bool) -> None:
        store[name] = store.get(name, True) and caught

    return record
