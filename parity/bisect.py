"""`parity bisect`: the first commit whose run leaves the good revision's numbers.

The good revision's run is the reference. ``git bisect run`` then tests commits in a temporary
``git worktree`` of its own, with the harness as the test: each commit's run is compared with the
reference under the spec's policies (aligned: good, diverged: bad, a failed run: skip, 125).

The user's repository is left exactly as it was: the worktree has its own HEAD and its own
bisect state (``refs/bisect/*`` and ``BISECT_*`` are per worktree), hooks and auto-gc are off,
and the worktree is reset, removed and pruned whatever happens, Ctrl-C included.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import parity
from parity.compare import Comparison, MetricResult, Policy, _json, compare_frames
from parity.files import write_json_atomic, write_text_atomic
from parity.launch import LaunchError, carrying, kill_carrying
from parity.readers import MetricsError, read_metrics
from parity.revisions import RevisionError, repo_root, resolve_revision, run_in_tree, worktree
from parity.signals import deferred
from parity.spec import JobSpec, SpecError, load_spec

__all__ = ["BisectResult", "TestedCommit", "bisect", "first_divergence", "step_main"]

GOOD, BAD, SKIP, ABORT = 0, 1, 125, 255  # `git bisect run` exit codes of the test command
_QUIET_GIT = ("-c", "core.hooksPath=/dev/null", "-c", "gc.auto=0")
_MARKER_ENV = "PARITY_BISECT_ID"  # marks every process of one `git bisect run`
_FIRST_BAD = re.compile(r"^([0-9a-f]{40}) is the first bad commit", re.MULTILINE)
_ANY_OF = re.compile(r"first bad commit could be any of:\n((?:[0-9a-f]{40}\n?)+)")

# The test command `git bisect run` executes in the worktree. `-P` and the explicit path keep the
# worktree's own files (it may be this very repository) off the harness's import path; any error
# before the comparison exits 255, which stops the bisection instead of marking a commit bad.
_STEP = """\
import sys
sys.path.insert(0, sys.argv.pop(1))
try:
    from parity.bisect import step_main
except BaseException as e:
    print(f"parity bisect: cannot import the harness: {e}", file=sys.stderr)
    sys.exit(255)
sys.exit(step_main(sys.argv[1:]))
"""


@dataclass
class TestedCommit:
    """One commit's run against the reference: aligned, diverged, or skipped (run failed)."""

    commit: str
    subject: str
    verdict: str
    metric: str | None = None  # the first divergent metric, its step and the policy in force
    step: int | None = None
    policy: str | None = None
    a_value: float | None = None
    b_value: float | None = None
    run: str | None = None
    error: str | None = None


@dataclass
class BisectResult:
    """verdict: "found" (first_bad named), "aligned" (bad agrees with good: nothing to find),
    or "ambiguous" (skipped commits hide it among ``candidates``)."""

    verdict: str
    good: str
    bad: str
    out: Path
    first_bad: TestedCommit | None = None
    candidates: list[str] = field(default_factory=list)
    tested: list[TestedCommit] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, non-finite floats as strings."""

        def clean(t: TestedCommit | None) -> dict[str, Any] | None:
            return None if t is None else {k: _json(v) for k, v in asdict(t).items()}

        return {
            "verdict": self.verdict,
            "good": self.good,
            "bad": self.bad,
            "out": str(self.out),
            "first_bad": clean(self.first_bad),
            "candidates": self.candidates,
            "tested": [clean(t) for t in self.tested],
        }

    def text(self) -> str:
        """What a person reads: the culprit, where it first diverged, and what was tested."""
        lines = []
        if self.verdict == "aligned":
            lines.append(f"bad {self.bad[:12]} is aligned with good {self.good[:12]}: no culprit")
        elif self.verdict == "ambiguous":
            lines.append("skipped commits (failed runs) hide the first bad commit; one of:")
            lines += [f"  {c}" for c in self.candidates]
        t = self.first_bad
        if t is not None:
            lines.append(f"first bad commit: {t.commit} {t.subject}")
            lines.append(
                f"  first divergence: {t.metric} at step {t.step} (policy {t.policy}): "
                f"good {t.a_value!r}, this commit {t.b_value!r}"
            )
        for t in self.tested:
            lines.append(f"  tested {t.commit[:12]} {t.verdict:<8} {t.subject}")
        return "\n".join(lines)


def first_divergence(comparison: Comparison) -> MetricResult | None:
    """The failing metric that goes wrong earliest (then by name); None when aligned."""
    failures = comparison.failures
    if not failures:
        return None

    def key(m: MetricResult) -> tuple[bool, int, str]:
        step = m.first_divergent_step
        return (step is None, step or 0, m.name)

    return min(failures, key=key)


def _git(repo: Path, *args: str) -> str:
    from parity.revisions import _git as git

    return git(repo, *_QUIET_GIT, *args)


def _subject(repo: Path, commit: str) -> str:
    return _git(repo, "log", "-1", "--format=%s", commit)


def _test_commit(
    spec: JobSpec,
    tree: Path,
    reference: Path,
    out: Path,
    policies: dict[str, Policy | str],
    skip_failed: bool = True,
) -> TestedCommit:
    """Run the spec in ``tree`` (at some commit), compare with the reference, record the verdict
    in out/commits/<sha>/verdict.json. A failed or unreadable run is "skipped" (with
    skip_failed; else its LaunchError or MetricsError is raised)."""
    commit = _git(tree, "rev-parse", "HEAD")
    run_dir = out / "commits" / commit[:12]
    tested = TestedCommit(commit, _subject(tree, commit), "skipped", run=str(run_dir))
    try:
        run_in_tree(spec, tree, run_dir)
        comparison = compare_frames(read_metrics(reference), read_metrics(run_dir), policies)
    except (LaunchError, MetricsError) as e:
        if not skip_failed:
            raise
        tested.error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    else:
        tested.verdict = comparison.verdict
        m = first_divergence(comparison)
        if m is not None:
            tested.metric, tested.step = m.name, m.first_divergent_step
            tested.policy = m.first_divergent_policy or m.policy
            tested.a_value, tested.b_value = m.a_value, m.b_value
    write_json_atomic(run_dir / "verdict.json", {k: _json(v) for k, v in asdict(tested).items()})
    return tested


def step_main(argv: list[str]) -> int:
    """The `git bisect run` test: 0 aligned, 1 diverged, 125 run failed, 255 harness error."""
    try:
        args = dict(zip(argv[::2], argv[1::2], strict=True))
        config = json.loads(Path(args["--config"]).read_text())
        spec = JobSpec.from_dict(config["spec"], "bisect spec")
        tested = _test_commit(
            spec, Path.cwd(), Path(config["reference"]), Path(config["out"]), config["policies"]
        )
    except BaseException as e:  # Ctrl-C included: stop the bisection, never mark a commit
        print(f"parity bisect: harness error: {type(e).__name__}: {e}", file=sys.stderr)
        return ABORT
    print(f"parity bisect: {tested.commit[:12]} {tested.verdict}", file=sys.stderr)
    return {"aligned": GOOD, "diverged": BAD}.get(tested.verdict, SKIP)


def _run_bisect(tree: Path, config: Path) -> str:
    """``git bisect run`` the step in its own process group; on Ctrl-C, SIGTERM, SIGHUP
    (parity.signals) or any error, `_stop` stops it and everything it started."""
    harness_root = str(Path(parity.__file__).resolve().parent.parent)
    cmd = ["git", "-C", str(tree), *_QUIET_GIT, "bisect", "run"]
    cmd += [sys.executable, "-P", "-c", _STEP, harness_root, "--config", str(config)]
    marker = uuid.uuid4().hex  # in the environment of every process the bisection starts
    proc = None
    try:
        with deferred():  # a signal waits for `proc`, which it then stops
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
                env={**os.environ, _MARKER_ENV: marker},
            )
        output, _ = proc.communicate()
    except BaseException:
        if proc is not None:
            with deferred():
                _stop(proc, marker)
        raise
    return output


def _stop(proc: subprocess.Popen, marker: str, grace_s: float = 30.0) -> None:
    """SIGINT to git bisect run's group, so that the step's launcher tears its job down (its
    torchrun is in a session of its own); whatever still carries ``marker`` after ``grace_s``
    (git, the step, the job's torchrun and ranks) is killed."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + grace_s
    while carrying(_MARKER_ENV, marker) and time.monotonic() < deadline:
        proc.poll()  # reap git as soon as it exits
        time.sleep(0.1)
    kill_carrying(_MARKER_ENV, marker, proc)


def bisect(
    spec: JobSpec | str | Path,
    good: str,
    bad: str,
    out: Path,
    *,
    repo: Path | None = None,
    policies: dict[str, Policy | str] | None = None,
) -> BisectResult:
    """Find the first commit in good..bad whose run diverges from good's run.

    Writes the reference run to out/good, each tested commit's run and verdict.json to
    out/commits/<sha>, and out/bisect.json and out/bisect.log. Raises RevisionError (bad repo or
    revisions), SpecError, or LaunchError when the good or the bad revision's run fails.
    """
    if not isinstance(spec, JobSpec):
        loaded = load_spec(spec)
        if not isinstance(loaded, JobSpec):
            raise SpecError(f"{spec}: bisect runs one job spec, not an [a]/[b] pair")
        spec = loaded
    root = repo_root(Path(repo or Path.cwd()))
    good_c, bad_c = resolve_revision(root, good), resolve_revision(root, bad)
    if good_c == bad_c:
        raise RevisionError(f"good {good!r} and bad {bad!r} are the same commit {good_c[:12]}")
    try:
        _git(root, "merge-base", "--is-ancestor", good_c, bad_c)
    except RevisionError:
        raise RevisionError(f"good {good!r} is not an ancestor of bad {bad!r}") from None
    out = Path(out).resolve()
    for stale in out.glob("commits/*/verdict.json"):  # an earlier bisect's verdicts
        stale.unlink()
    policies = {k: str(v) for k, v in (policies or {}).items()}
    reference = out / "good"
    with worktree(root, good_c) as tree:
        _say(f"reference run of good {good_c[:12]} {_subject(root, good_c)}")
        run_in_tree(spec, tree, reference)
    if read_metrics(reference).attrs.get("complete") is False:  # fail once, not in every step
        raise MetricsError(f"{reference / 'metrics.jsonl'}: the good run is incomplete")
    config = out / "bisect-config.json"
    settings = {"spec": spec.to_dict(), "reference": str(reference), "out": str(out)}
    write_json_atomic(config, {**settings, "policies": policies})
    with worktree(root, bad_c) as tree:
        _say(f"checking that bad {bad_c[:12]} diverges")
        first = _test_commit(spec, tree, reference, out, policies, skip_failed=False)
        if first.verdict == "aligned":
            result = BisectResult("aligned", good_c, bad_c, out, tested=[first])
        else:
            result = _bisect_in(tree, good_c, bad_c, out, config)
    write_json_atomic(out / "bisect.json", result.to_dict())
    return result


def _bisect_in(tree: Path, good_c: str, bad_c: str, out: Path, config: Path) -> BisectResult:
    try:
        _git(tree, "bisect", "start", bad_c, good_c, "--")
        _say("git bisect run: each commit's run against the reference")
        output = _run_bisect(tree, config)
        try:
            write_text_atomic(out / "bisect.log", _git(tree, "bisect", "log") + "\n")
        except RevisionError:
            pass
    finally:  # the worktree's own bisect state; removing the worktree drops it anyway
        with deferred():
            subprocess.run(
                ["git", "-C", str(tree), *_QUIET_GIT, "bisect", "reset", "--quiet"],
                capture_output=True,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
    tested = {}
    for path in sorted((out / "commits").glob("*/verdict.json")):
        t = TestedCommit(**json.loads(path.read_text()))
        tested[t.commit] = t
    found = _FIRST_BAD.search(output)
    if found:
        culprit = tested.get(found[1])
        if culprit is None:
            raise RevisionError(f"git bisect named {found[1]}, which was never tested")
        return BisectResult("found", good_c, bad_c, out, culprit, tested=list(tested.values()))
    maybe = _ANY_OF.search(output)
    if maybe:
        candidates = maybe[1].split()
        return BisectResult(
            "ambiguous", good_c, bad_c, out, candidates=candidates, tested=list(tested.values())
        )
    last = [line for line in output.strip().splitlines() if line.strip()]
    raise RevisionError(f"git bisect run stopped: {last[-1] if last else 'no output'}")


def _say(text: str) -> None:
    print(f"parity bisect: {text}", file=sys.stderr, flush=True)
