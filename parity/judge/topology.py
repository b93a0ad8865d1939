"""Where a run's ranks ran (topology.json in its launch folder), and the line a comparison
carries when the two sides' topologies differ.

Why: bit-exactness across nodes is only promised within one allocation, or on identical
topology (the reduction order a collective library picks depends on the nodes). A bitwise
verdict between sides that ran on different nodes is then luck, not a guarantee; a tolerance
verdict is what is meaningful there, and the reader must be told.
"""

from __future__ import annotations

import json
from pathlib import Path

from parity.files import launch_dir

__all__ = ["describe", "differs", "line", "read"]


def read(run_dir: Path) -> dict:
    """The topology the launch of ``run_dir`` recorded; {} when it recorded none (a run this
    harness did not launch, or one launched before it recorded topologies)."""
    try:
        found = json.loads((launch_dir(Path(run_dir)) / "topology.json").read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def describe(topology: dict) -> str:
    """``slurm job 12: node 0 n1, node 1 n2 (1 rank per node)``, or '' when unknown."""
    nodes = topology.get("nodes") or []
    if not nodes:
        return ""
    per = topology.get("nproc_per_node", "?")
    where = ", ".join(f"node {i} {name}" for i, name in enumerate(nodes))
    job = f" job {topology['job_id']}" if topology.get("job_id") else ""
    return f"{topology.get('launcher', '?')}{job}: {where} ({per} rank(s) per node)"


def differs(a: dict, b: dict) -> bool:
    """Whether two known topologies put the ranks on different nodes (or split them
    differently); unknown ones are not said to differ."""
    if not a.get("nodes") or not b.get("nodes"):
        return False
    keys = ("nodes", "nproc_per_node")
    return any(a.get(k) != b.get(k) for k in keys)


def line(a: dict, b: dict, verdict: str = "") -> str:
    """The comparison's line when the sides ran on different topologies; '' when they did not
    (or one is unknown)."""
    if not differs(a, b):
        return ""
    head = f"the sides ran on different nodes (A: {describe(a)}; B: {describe(b)})"
    if verdict == "aligned":
        return (f"{head}: bit-exactness is only promised within one allocation or on identical "
                "topology, so this bitwise agreement is not a guarantee; across different nodes "
                "only a tolerance verdict is meaningful")  # fmt: skip
    return (f"{head}: bit-exactness is only promised within one allocation or on identical "
            "topology; across different nodes only a tolerance verdict is meaningful")  # fmt: skip
