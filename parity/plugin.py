"""pytest plugin: the `parity` marker, fixtures that run jobs and pairs, and assert_parity.

    @pytest.mark.parity
    def test_refactor_is_bitwise(parity_runner):
        base = JobSpec(command=["train.py", "--out", "{out}"], world_size=2, steps=20)
        pair = parity_runner.pair(PairSpec(base, b={"env": {"USE_NEW_LOOP": "1"}}))
        assert_parity(pair.a, pair.b)

Runs are cached for the session by spec, so tests that need the same job share one launch, and
jobs run in warm pools (parity.run.pool: one torchrun launch per world size, kept up for the
session,
the same bits as a launch of their own) unless `--parity-no-pool`. `--parity-keep-runs=DIR` keeps
every run folder there for inspection.
"""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pandas as pd
import pytest

from parity.judge.compare import Comparison, Policy, compare_frames
from parity.judge.policy import parse_policies
from parity.spec import JobSpec, PairSpec


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("parity")
    group.addoption(
        "--parity-keep-runs",
        metavar="DIR",
        default=None,
        help="keep the run folders of parity tests under DIR (write --parity-keep-runs=DIR)",
    )
    group.addoption(
        "--parity-no-pool",
        action="store_true",
        help="launch every job on its own instead of in warm pools (parity.run.pool)",
    )
    group.addoption(
        "--parity-update-golden",
        action="store_true",
        help="write the golden baselines of this run's environment instead of checking them "
        "(those of other environments are kept)",
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
    _refuse_hijacked_rootdir(config)


def _refuse_hijacked_rootdir(config: pytest.Config) -> None:
    """`--parity-keep-runs DIR` (a space, DIR existing) can hide the project's ini file: pytest
    looks for it from path arguments before plugins add their options (pytest#8846), so DIR
    outside the project leaves the run without its ini (testpaths, the golden folder under the
    rootdir). Refused in one line when the folder pytest started in has an ini it did not use."""
    args = [str(a) for a in config.invocation_params.args]
    here = config.invocation_params.dir
    for option in ("--parity-keep-runs", "--parity-golden-dir"):
        value = config.getoption(option)
        if value is None or option not in args or config.inipath is not None:
            continue
        if Path(value).exists() and _has_pytest_ini(here):
            raise pytest.UsageError(
                f"{option} {value}: pytest took this folder for a test path and did not read the "
                f"ini file in {here} (pytest#8846); write {option}={value}"
            )


def _has_pytest_ini(folder: Path) -> bool:
    """Whether `folder` has a file pytest reads its configuration from."""
    marks = {"pytest.ini": "", ".pytest.ini": "", "pyproject.toml": "[tool.pytest",
             "tox.ini": "[pytest]", "setup.cfg": "[tool:pytest]"}  # fmt: skip
    for name, mark in marks.items():
        path = folder / name
        if path.is_file() and mark in path.read_text(encoding="utf-8", errors="replace"):
            return True
    return False


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
    """Runs jobs and pairs under torchrun, once per distinct spec per session.

    pool=True: jobs run in warm pools (parity.run.pool), one launch per world size for the session;
    a job that fails there is launched alone, for its own report. A run is cached by its spec
    whichever way it ran: a job run in a pool or in-process (both sides of a pair in one launch,
    `pair(..., in_process=True)`) is bitwise the run a launch of its own gives
    (tests/run/test_pool.py, tests/run/test_inprocess.py), so later tests of the same spec reuse it.
    """

    def __init__(self, base_dir: Path, pool: bool = False, config: pytest.Config | None = None):
        from parity.outdir import OutDir
        from parity.run.pool import Pools

        self.base_dir = base_dir
        self.pools = None
        if pool:
            with OutDir.open(base_dir) as held:
                self.pools = Pools(held.fresh_dir("pools"))  # a kept DIR's earlier pools stay
        self._runs: dict[tuple, object] = {}
        self._separate: dict[tuple, object] = {}  # launched alone, where _runs holds in-process
        self._in_process: dict[tuple, object] = {}  # pair_in_process results, by both keys
        self._count = 0
        self.test_name: str | None = None  # the test running now, where no config says it
        self._config = config  # the session's: the test running now (pytest_runtest_protocol)
        self._jobs_of: dict[str, int] = {}  # runs named after each test so far

    def close(self) -> None:
        """Stop the warm pools (the session fixture calls this at the end)."""
        if self.pools is not None:
            self.pools.close()

    def _folder(self, name: str, kind: str = "") -> Path:
        """A run folder's path whose name, and its launch folder's, are free: a kept DIR's runs
        from an earlier session stay and are never reused. Named after the test running now
        (its node name, then a letter per run it makes: test_x-a, test_x-b; ``kind``: what
        the run is, "repeat"), else ``name`` after a session-wide counter (000-name)."""
        from parity.files import LAUNCH_SUFFIX
        from parity.outdir import free_name

        now = self._config.stash.get(_TEST_NAME, None) if self._config is not None else None
        test = re.sub(r"[^A-Za-z0-9_.-]+", "-", now or self.test_name or "").strip("-.")
        if test:
            n = self._jobs_of.get(test, 0)
            self._jobs_of[test] = n + 1
            name = "-".join(filter(None, [test, _letters(n), kind]))
        else:
            name = re.sub(r"[^A-Za-z0-9_.-]+", "-", "-".join(filter(None, [name, kind])))
            self._count += 1
            name = f"{self._count - 1:03d}-{name}"
        suffixes = (LAUNCH_SUFFIX, "-alone", "-alone" + LAUNCH_SUFFIX)  # see job()
        return self.base_dir / free_name(self.base_dir, name, *suffixes)

    @staticmethod
    def _key(spec: JobSpec) -> tuple:
        from parity.run.pool import context

        launcher = (spec.world_size, spec.nnodes, tuple(spec.torchrun_args))
        env = (spec.distributed, tuple(sorted(spec.env.items())))  # sides apart by env only
        # and the folder and environment it runs in: a test's chdir or setenv is another run
        return tuple(spec.to_args(Path("{out}"))) + launcher + env + context()

    def job(self, spec: JobSpec, separate: bool = False):
        """The run of `spec`; separate=True: one launched on its own, never a pooled or
        in-process one."""
        from parity.run.job import run_job

        key = self._key(spec)
        run = self._runs.get(key)
        if run is not None and not (separate and run.in_process):
            return run
        if separate and key in self._separate:
            return self._separate[key]
        folder, run = self._folder(f"{spec.task}-{spec.variant}-w{spec.world_size}"), None
        if not separate and self.pools is not None:
            run = self.pools.run(spec, folder)
            folder = folder.with_name(folder.name + "-alone")  # the pool's attempt stays
        if run is None:
            run = run_job(spec, folder)
            self._separate[key] = run
        self._runs.setdefault(key, run)
        return run

    def pair(
        self,
        pair: PairSpec,
        policies: Mapping[str, Policy | str] | None = None,
        in_process: bool = False,
        noise_floor: bool = False,
    ):
        """Both sides (cached runs reused); in_process=True: sides not run yet share one launch
        (with pools, they run in the warm pool, which is one launch already).

        in_process raises SpecError (one line) when the sides cannot share a process.
        noise_floor=True: A against a fresh repeat of A first (``result.floor``); if they differ,
        B is not run, ``result.b`` is the repeat and ``result.verdict`` "nondeterministic".
        Compared as `parity pair` compares (parity.pair.compare_pair); ``result.diagnose()``
        diagnoses. Nothing is written beside the cached runs (no summary, report or op-trace
        rerun, which `parity pair` adds).
        """
        from parity.pair import compare_pair, nondeterministic_pair

        spec_a, spec_b = pair.sides()
        floor, policies = None, parse_policies(policies)
        if noise_floor:
            floor = self.floor(spec_a, policies)
            if not floor.deterministic:
                return nondeterministic_pair(floor, floor.a_dir.parent)
        missing = [s for s in (spec_a, spec_b) if self._key(s) not in self._runs]
        if in_process and len(missing) == 2 and self.pools is None:
            result = self.pair_in_process(pair, policies)
            a, b = result.a, result.b
            self._runs.setdefault(self._key(spec_a), a)
            self._runs.setdefault(self._key(spec_b), b)
        else:
            if in_process:
                from parity.run.inprocess import refusal
                from parity.spec import SpecError

                reason = refusal(spec_a, spec_b)
                if reason:
                    raise SpecError(reason)
            a, b = self.job(spec_a), self.job(spec_b)
        return compare_pair(a, b, a.dir.parent, policies, floor=floor)

    def floor(self, spec: JobSpec, policies: Mapping[str, Policy | str] | None = None):
        """The noise floor of ``spec``: its (cached) run against a new launch, never cached,
        since a second run is the whole point. ``floor.runs`` holds the two Runs."""
        from parity.pair import floor_of
        from parity.run.job import run_job

        a = self.job(spec, separate=True)
        name = f"{spec.task}-{spec.variant}-w{spec.world_size}"
        repeat = run_job(spec, self._folder(name, "repeat"))
        return floor_of(a, repeat, parse_policies(policies))

    def pair_in_process(self, pair: PairSpec, policies: Mapping[str, Policy | str] | None = None):
        """Both sides in one launch, always (cached as such): for tests of the mode itself."""
        from parity.pair import compare_pair
        from parity.run.inprocess import run_pair_in_process

        spec_a, spec_b = pair.sides()
        key = (self._key(spec_a), self._key(spec_b))
        if key not in self._in_process:
            name = f"{spec_a.task}-{spec_a.variant}-vs-{spec_b.variant}-w{spec_a.world_size}"
            self._in_process[key] = run_pair_in_process(pair, self._folder(name, "in-process"))
        a, b = self._in_process[key]
        return compare_pair(a, b, a.dir.parent, parse_policies(policies))


def _letters(n: int) -> str:
    """0 -> a, 25 -> z, 26 -> aa: the runs of one test, in the order it made them."""
    out = ""
    n += 1
    while n:
        n, r = divmod(n - 1, 26)
        out = chr(ord("a") + r) + out
    return out


_TEST_NAME = pytest.StashKey[str]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """The test running now, for the names of the run folders it makes (ParityRunner)."""
    item.config.stash[_TEST_NAME] = item.name
    try:
        return (yield)
    finally:
        del item.config.stash[_TEST_NAME]


@pytest.fixture(scope="session")
def parity_runner(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[ParityRunner]:
    from parity.outdir import OutDir

    keep = request.config.getoption("--parity-keep-runs")
    base = Path(keep).resolve() if keep else tmp_path_factory.mktemp("parity-runs")
    with OutDir.open(base):  # held for the session: run folders made new, nothing removed
        _cancellable(request.config, base)
        pool = not request.config.getoption("--parity-no-pool")
        runner = ParityRunner(base, pool=pool, config=request.config)
        try:
            yield runner
        finally:
            runner.close()


def _cancellable(config: pytest.Config, base: Path) -> None:
    """From the first job on, SIGINT, SIGTERM and SIGHUP stop the session alike
    (parity.run.signals): pytest's KeyboardInterrupt path, whose teardown stops the warm pools and
    launches; then one line on stderr and exit 130, 143 or 129 (`pytest_sessionfinish`)."""
    import threading

    from parity.run import signals

    if threading.current_thread() is threading.main_thread() and not signals.installed():
        config.stash[_SIGNALS] = (signals.install(), base)


_SIGNALS = pytest.StashKey[tuple]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int):
    """Around the session's teardown (the warm pools' closing): a signal waits for its end. After
    an interruption, one line on stderr and exit 128 + the signal instead of pytest's 2."""
    from parity.run import signals

    installed = session.config.stash.get(_SIGNALS, None)
    if installed is None:
        return (yield)
    restore, base = installed
    try:
        with signals.deferred():
            return (yield)
    except signals.Interrupted:  # first came during the teardown, which went on to its end
        return None
    finally:
        signum = signals.received()
        restore()
        del session.config.stash[_SIGNALS]
        if signum is not None:
            session.exitstatus = 128 + signum
            name = signal.Signals(signum).name
            sys.stderr.write(
                f"parity: pytest session interrupted by {name} (exit {128 + signum}): warm "
                f"pools and launches stopped; run folders in {base}\n"
            )
            sys.stderr.flush()


def pytest_unconfigure(config: pytest.Config) -> None:
    installed = config.stash.get(_SIGNALS, None)  # no pytest_sessionfinish (an early error)
    if installed is not None:
        installed[0]()
        del config.stash[_SIGNALS]


class GoldenChecker:
    """`parity_golden.check(name, run)`: compare a run with the baseline of its environment in
    fixtures/golden/<name> (parity.judge.golden), or write that baseline."""

    def __init__(self, golden_dir: Path, update: bool):
        self.golden_dir, self.update = golden_dir, update

    def check(self, name: str, run, policies: Mapping[str, Policy | str] | None = None):
        from parity.judge.golden import save_golden, verify_golden

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


#: the user property a mutant test's ``parity_mutant_score`` call leaves on its report: a
#: report is what reaches the session's own process under pytest-xdist, a plugin's state is not
MUTANT_PROPERTY = "parity_mutant"


def mutants_caught(reports) -> dict[str, bool]:
    """Each mutant the reports name: whether every test of it caught it."""
    caught: dict[str, bool] = {}
    for report in reports:
        for key, value in getattr(report, "user_properties", ()):
            if key == MUTANT_PROPERTY:
                name, ok = value
                caught[name] = caught.get(name, True) and bool(ok)
    return caught


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Print the mutation score: every mutant test reports whether its check caught it."""
    reports = [r for kind in terminalreporter.stats.values() for r in kind]
    caught = mutants_caught(reports)
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
    """Call with (name, caught) from a mutant test; the session prints the mutation score (also
    under pytest-xdist: the result travels on the test's report)."""

    def record(name: str, caught: bool) -> None:
        request.node.user_properties.append((MUTANT_PROPERTY, (name, bool(caught))))

    return record
