"""What happened to one launch (``LaunchResult``, its ``describe()``) and the error that carries
it (``LaunchError``): what every launcher returns, kept apart from the launching itself
(parity.run.launch) so that the readers of a result need none of the process handling.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from parity.run.torchrun_logs import RankFailure, indent, last_lines, tail_file

# argparse's last line when a job refuses its command line (exit code 2, after the usage):
#   python -m worker.sft: error: unrecognized arguments: --val-sampels 3
_ARGPARSE_ERROR = re.compile(r"^\S.*?: error: (?P<message>.+)$")


@dataclass
class LaunchResult:
    """What happened to one torchrun launch; ``describe()`` is the human-readable report."""

    returncode: int | None
    timed_out: bool
    duration_s: float
    run_dir: Path
    timeout_s: float = 0.0
    launcher_log: Path | None = None
    launch_id: str = ""
    #: local rank -> that rank's stderr.log (stdout.log lies next to it). Equal to the global rank
    #: for single-node jobs.
    rank_logs: dict[int, Path] = field(default_factory=dict)
    failures: list[RankFailure] = field(default_factory=list)
    #: Set by the caller when the job's own output is complete (metrics.jsonl has its end record,
    #: written during this launch): a failure is then one of teardown, after training finished.
    output_complete: bool = False
    #: Multi-node launches (``launch_nodes``): one result per node launcher started here.
    nodes: dict[int, LaunchResult] = field(default_factory=dict)
    #: Why the launch failed beyond the ranks' own reports (e.g. a node that never joined).
    note: str = ""
    #: Why the launch is failed although its ranks exited 0: the world they formed instead of
    #: the one asked for (parity.run.world), or output the job did not write; '' when none.
    fault: str = ""
    #: One word for that fault: "world" or "no-output".
    fault_kind: str = ""
    #: time.time() when the launch started (files older than this are not its output).
    started_at: float = 0.0
    #: The ranks' records of the process group each joined (parity.run.world).
    world_dir: Path | None = None
    #: Where the ranks ran: launcher ("local", "slurm"), node names by node rank, ranks per
    #: node, and with Slurm the job id and its variables (written as topology.json).
    topology: dict = field(default_factory=dict)
    #: what was started, as the report names it
    started_as: str = "torchrun job"
    #: set when the job was stopped as hung: how long it went without a new step
    stalled: str = ""
    #: set when the job was stopped as soon as its numbers diverged (parity.run.early): where
    stopped_early: str = ""
    #: where each rank waited when it was stopped (stall or timeout; parity.run.stacks), and
    #: the files that hold each rank's whole stacks
    stacks: str = ""
    stack_files: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.returncode == 0 and not self.timed_out and not self.fault
                and not self.stalled and not self.stopped_early)  # fmt: skip

    @property
    def reason(self) -> str:
        """One word for JSON and reports: ok, teardown-crash, teardown-hang, stall (no new step
        for the job's stall time), timeout, crash.

        teardown-*: the output is complete (training finished), then a rank crashed or hung at
        exit. The metrics can be trusted, the process exit cannot; it is never reported as ok.
        """
        if self.ok:
            return "ok"
        if self.stopped_early:  # stopped as it diverged; a wrong world is failed all the same
            return self.fault_kind if self.fault else "stopped-early"
        if self.fault and self.returncode == 0 and not self.timed_out:
            return self.fault_kind
        if self.output_complete:
            return "teardown-hang" if self.timed_out else "teardown-crash"
        if self.stalled:
            return "stall"
        return "timeout" if self.timed_out else "crash"

    def set_fault(self, kind: str, line: str) -> None:
        """Fail this launch for ``line`` (a no-op when it is ''); the first fault stays."""
        if line and not self.fault:
            self.fault, self.fault_kind = line, kind

    @property
    def refused_arguments(self) -> str | None:
        """argparse's message when the job refused its command line (exit code 2 after a usage
        line, e.g. "unrecognized arguments: --val-sampels 3"): bad input, not a crash."""
        if self.ok or not self.failures or self.failures[0].exitcode != 2:
            return None
        tail = self.failures[0].log_tail
        lines = [line for line in tail.splitlines() if line.strip()]
        m = _ARGPARSE_ERROR.match(lines[-1]) if lines else None
        return m["message"] if m and "usage:" in tail else None

    def to_dict(self) -> dict:
        """JSON-able summary: reason, exit code, and each failing rank with its signal."""
        return {
            "reason": self.reason,
            "returncode": self.returncode,
            "timed_out": self.timed_out,
            "run_dir": str(self.run_dir),
            "failures": [
                {
                    "rank": f.rank,
                    "exitcode": f.exitcode,
                    "signal": f.signal,
                    **({"host": f.host} if f.host else {}),
                }
                for f in self.failures
            ],  # fmt: skip
            **({"note": self.note} if self.note else {}),
            **({"fault": self.fault} if self.fault else {}),
            **({"stall": self.stalled} if self.stalled else {}),
            **({"stopped_early": self.stopped_early} if self.stopped_early else {}),
            **({"stacks": self.stacks} if self.stacks else {}),
            **({"stack_files": [str(p) for p in self.stack_files]} if self.stack_files else {}),
        }

    def tail(self, rank: int, n_lines: int = 30) -> str:
        """Last lines of a rank's stdout and stderr (by local rank), or '' if it has no logs."""
        err = self.rank_logs.get(rank)
        if err is None:
            return ""
        parts = []
        for path in (err.with_name("stdout.log"), err):
            text = tail_file(path, n_lines)
            if text:
                parts.append(f"[{path.name}]\n{text}")
        return "\n".join(parts)

    def stack_lines(self) -> list[str]:
        """Where each rank waited when it was stopped, and the files with the whole stacks."""
        if not self.stacks:
            return []
        files = ", ".join(str(p) for p in self.stack_files)
        return [self.stacks, f"stacks: {files}"] if files else [self.stacks]

    def describe(self, n_lines: int = 30) -> str:
        """A multi-line report: outcome, failing ranks with exit code or signal, and log tails."""
        where = f"run dir {self.run_dir}"
        if self.ok:
            return f"{self.started_as} succeeded in {self.duration_s:.1f} s ({where})"
        if self.stopped_early and not self.fault:
            return f"{self.started_as} {self.stopped_early} after {self.duration_s:.1f} s ({where})"
        if self.reason == self.fault_kind and self.fault:  # ranks exited 0, yet it failed
            return f"{self.fault} (launch logs: {self.run_dir})"
        lines: list[str] = []
        refused = self.refused_arguments  # bad input: say so before the rank details
        if refused is not None:
            lines.append(f"the job refused its arguments: {refused}")
        if self.output_complete:
            how = "hung" if self.timed_out else "crashed"
            first = f" ({self.failures[0].headline()})" if self.failures else ""
            lines.append(
                f"teardown failure: training finished and its metrics are complete (end record "
                f"written), then the job {how} at exit{first}"
            )
        if self.note:
            lines.append(self.note)
        if self.nodes:
            state = "timed out" if self.timed_out else f"failed with exit code {self.returncode}"
            lines.append(f"{len(self.nodes)}-node torchrun job {state} ({where})")
            if self.stalled:
                lines.append(f"stalled: {self.stalled}")
            lines += self.stack_lines()
            if self.failures:
                lines.append(f"first failure: {self.failures[0].headline()}")
            for node, result in sorted(self.nodes.items()):
                lines += [f"--- node {node} ---", indent(result.describe(n_lines))]
            return "\n".join(lines)
        if self.stalled or self.timed_out:
            lines.append(
                f"{self.started_as} stalled: {self.stalled}; killed as hung after "
                f"{self.duration_s:.1f} s ({where})"
                if self.stalled
                else f"{self.started_as} timed out after {self.timeout_s:g} s and was killed "
                f"({where})"
            )
            lines += self.stack_lines()
            for rank in sorted(self.rank_logs):
                lines += [f"--- rank {rank} ---", indent(self.tail(rank, n_lines) or "<empty>")]
            return "\n".join(lines)
        lines.append(
            f"{self.started_as} failed with exit code {self.returncode} after "
            f"{self.duration_s:.1f} s ({where})"
        )
        for i, failure in enumerate(self.failures):
            note = " (first failure)" if i == 0 else " (probably a consequence of the first)"
            lines.append(failure.headline() + note)
            tail = failure.log_tail if i == 0 else last_lines(failure.log_tail, 5)
            lines.append(indent(tail or "<no log>"))
        if not self.failures and self.launcher_log is not None:
            lines += ["no rank failure found; launcher log tail:"]
            lines.append(indent(tail_file(self.launcher_log, n_lines) or "<empty>"))
        return "\n".join(lines)


class Stopped(Exception):
    """Raised from a launch's on_tick to stop a job that is not hung but has said what it was
    run for (parity.run.early: it diverged); ``line`` says where. The launch ends with
    ``stopped_early`` set to it, no stacks taken."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


class LaunchError(RuntimeError):
    """A launch that did not succeed; ``result`` holds the details, ``label`` names the side."""

    def __init__(self, result: LaunchResult, label: str = ""):
        text = result.describe()
        super().__init__(f"{label}: {text}" if label else text)
        self.result = result
        self.label = label
