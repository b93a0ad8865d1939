"""parity: prove that a training refactor changed no number, or say where it did.

The API, loaded on first use (PEP 562) so that `import parity` and the CLI import neither torch
nor pytest (only `assert_parity`, the pytest helper, needs pytest):

    import parity

    job = parity.JobSpec(command=["train.py", "--out", "{out}"], world_size=2)
    pair = parity.PairSpec(job, b={"env": {"USE_NEW_LOOP": "1"}})
    result = parity.run_pair(pair, "runs/pair")  # what `parity pair` does
    print(result.verdict, result.diagnosis.lines(), result.report)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers and editors see; at run time, __getattr__ below
    from parity.bisect import bisect, bisect_revisions
    from parity.check import check_golden, check_revisions
    from parity.errors import InputError, SpecError
    from parity.git import RevisionError
    from parity.judge.compare import Policy, compare_frames, compare_runs
    from parity.pair import run_pair
    from parity.plugin import assert_parity
    from parity.readers import MetricsError, read_metrics
    from parity.report import build_report
    from parity.run.job import run_job
    from parity.run.launch import LaunchError
    from parity.spec import JobSpec, PairSpec
    from parity.store import RunStore

#: each public name and the module it lives in
_HOMES = {
    # one function per command: pair, compare, report, check (revisions, golden), bisect
    "run_pair": "parity.pair",
    "compare_runs": "parity.judge.compare",
    "build_report": "parity.report",
    "check_revisions": "parity.check",
    "check_golden": "parity.check",
    "bisect": "parity.bisect",
    "bisect_revisions": "parity.bisect",
    # the parts they are made of
    "run_job": "parity.run.job",
    "JobSpec": "parity.spec",
    "PairSpec": "parity.spec",
    "compare_frames": "parity.judge.compare",
    "Policy": "parity.judge.compare",
    "read_metrics": "parity.readers",
    "RunStore": "parity.store",
    "assert_parity": "parity.plugin",
    # the errors a caller catches: bad input (exit 2), a run that failed (exit 3)
    "InputError": "parity.errors",
    "SpecError": "parity.errors",
    "MetricsError": "parity.readers",
    "RevisionError": "parity.git",
    "LaunchError": "parity.run.launch",
}

__all__ = [
    "InputError",
    "JobSpec",
    "LaunchError",
    "MetricsError",
    "PairSpec",
    "Policy",
    "RevisionError",
    "RunStore",
    "SpecError",
    "assert_parity",
    "bisect",
    "bisect_revisions",
    "build_report",
    "check_golden",
    "check_revisions",
    "compare_frames",
    "compare_runs",
    "read_metrics",
    "run_job",
    "run_pair",
]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'parity' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    # kept: the next use is a plain lookup. For `bisect` this also replaces the submodule
    # parity.bisect, which importing it bound here, with its function.
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
