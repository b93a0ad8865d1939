"""Security checks that scan the code, plus the loaders they rely on.

Weights and state are only ever read as safetensors, ``torch.load(weights_only=True)`` or DCP
through the allow-list metadata reader; no pickle from a log, a golden or a checkpoint; no
``shell=True``; report text is escaped (tests/faces/test_report.py) and the pre-merge check
leaves the user's tree alone (tests/orchestration/test_check.py).
"""

from __future__ import annotations

import ast
import importlib
import io
import os
import pickle
from pathlib import Path

import pytest

from parity.judge.compare import compare_frames
from parity.pair import PairResult, write_summary
from parity.run.job import Run
from parity.run.launch import LaunchResult
from parity.spec import JobSpec
from tests.needs import subject, subject_installed

if subject_installed():  # the safe DCP reader is the subject's; the source scan needs neither
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from worker.safe_checkpoint import SafeFileSystemReader, load_metadata

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("worker", "parity", "subjects", "benchmarks", "tests", "ci")
# the only module allowed to subclass pickle.Unpickler: it is the allow-list
UNPICKLER_HOME = ROOT / "worker" / "safe_checkpoint.py"


def _sources() -> list[Path]:
    files = [p for d in SCANNED for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 30, "the scan found too few files: wrong root?"
    return sorted(files)


def _dotted(node: ast.AST) -> str:
    """'a.b.c' for a Name/Attribute chain, '' otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


_FORBIDDEN_CALLS = {
    "pickle.load", "pickle.loads", "cPickle.load", "dill.load", "dill.loads", "joblib.load",
    "marshal.load", "marshal.loads", "shelve.open", "yaml.load", "yaml.unsafe_load",
    "yaml.full_load", "pd.read_pickle", "pandas.read_pickle", "os.system", "os.popen",
    "eval", "exec", "torch.distributed.checkpoint.load",
}  # fmt: skip


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and path != UNPICKLER_HOME:
            if any(_dotted(b).endswith("Unpickler") for b in node.bases):
                found.append(f"{rel}:{node.lineno}: a pickle Unpickler outside the allow-list")
        if not isinstance(node, ast.Call):
            continue
        name, where = _dotted(node.func), f"{rel}:{node.lineno}"
        shell = _kw(node, "shell")
        if shell is not None and not (isinstance(shell, ast.Constant) and shell.value is False):
            found.append(f"{where}: shell= in a subprocess call")
        if name in _FORBIDDEN_CALLS:
            found.append(f"{where}: {name}(...)")
        if name.endswith("torch.load") and not _is_true(_kw(node, "weights_only")):
            found.append(f"{where}: torch.load without weights_only=True")
        if name in ("np.load", "numpy.load") and _kw(node, "allow_pickle") is not None:
            found.append(f"{where}: np.load with allow_pickle")
        if name == "dcp.load":
            reader = _kw(node, "storage_reader")
            safe = isinstance(reader, ast.Call) and _dotted(reader.func) == "SafeFileSystemReader"
            if not safe:
                found.append(f"{where}: dcp.load without storage_reader=SafeFileSystemReader(...)")
        model = name.endswith(".from_pretrained") and "Model" in name  # not configs, tokenizers
        if model and not _is_true(_kw(node, "use_safetensors")):
            found.append(f"{where}: {name} without use_safetensors=True")
    return found


def test_code_loads_nothing_unsafe_and_never_uses_a_shell() -> None:
    problems = [v for path in _sources() for v in _violations(path)]
    assert problems == [], "\n".join(problems)


def test_the_scan_catches_what_it_claims(tmp_path: Path) -> None:
    bad = tmp_path / "probe.py"
    bad.write_text(
        "import subprocess, pickle, torch, yaml\n"
        "subprocess.run('ls', shell=True)\n"
        "subprocess.run(['ls'], shell=flag)\n"
        "pickle.loads(b'')\n"
        "torch.load('x.pt')\n"
        "torch.load('x.pt', weights_only=False)\n"
        "yaml.load('a: 1')\n"
        "dcp.load(state, checkpoint_id='x')\n"
        "AutoModelForCausalLM.from_pretrained('m')\n"
        "class U(pickle.Unpickler): pass\n"
        "subprocess.run(['ls'], shell=False)\n"
        "torch.load('x.pt', weights_only=True)\n"
    )
    found = _violations(bad)
    assert len(found) == 9, found
    assert not any(":11:" in v or ":12:" in v for v in found)


def _dcp_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return state


@subject
def test_safe_reader_loads_a_genuine_dcp_checkpoint(tmp_path: Path) -> None:
    saved = _dcp_checkpoint(tmp_path / "ckpt")
    loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load(loaded, storage_reader=SafeFileSystemReader(str(tmp_path / "ckpt")), no_dist=True)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {_Payload.marker}",))

    marker = ""


@subject
def test_safe_reader_refuses_a_tampered_metadata_pickle(tmp_path: Path) -> None:
    _dcp_checkpoint(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    _Payload.marker = str(marker)
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_Payload()))
    loaded = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    reader = SafeFileSystemReader(str(tmp_path / "ckpt"))
    with pytest.raises(pickle.UnpicklingError, match=r"\.metadata: refusing to load (posix|os)\."):
        reader.read_metadata()
    with pytest.raises(CheckpointException):  # the same through dcp.load, as Engine.load calls it
        dcp.load(loaded, storage_reader=SafeFileSystemReader(str(tmp_path / "ckpt")), no_dist=True)
    assert not marker.exists()
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(pickle.UnpicklingError, match="not DCP metadata"):
        reader.read_metadata()


@subject
@pytest.mark.parametrize("name", ["Enum", "Any", "Sequence", "Metadata.__init__"])
def test_safe_reader_refuses_what_dcp_metadata_only_imports(name: str) -> None:
    """The metadata module's namespace re-exports enum, typing and collections.abc names (and
    protocol 4 resolves dotted names): only the classes it defines itself may be named."""
    module = "torch.distributed.checkpoint.metadata"
    assert hasattr(importlib.import_module(module), name.split(".")[0])  # reachable from there
    crafted = f"c{module}\n{name}\n.".encode()  # GLOBAL module name, STOP
    with pytest.raises(pickle.UnpicklingError, match=rf"refusing to load {module}\.{name}"):
        load_metadata(io.BytesIO(crafted), "ckpt/.metadata")
    load_metadata(io.BytesIO(f"c{module}\nMetadata\n.".encode()))  # what DCP pickles: allowed


def test_summary_md_fence_survives_hostile_metric_names(tmp_path: Path) -> None:
    import pandas as pd

    evil = "x```\n<img src=x onerror=alert(1)>"
    frame = pd.DataFrame({evil: [1.0, 2.0]}, index=pd.Index([1, 2], name="step"))
    run = Run(JobSpec(task="charcount-sft"), tmp_path, LaunchResult(0, False, 1.0, tmp_path), frame)
    write_summary(PairResult(run, run, compare_frames(frame, frame), tmp_path))
    md = (tmp_path / "summary.md").read_text()
    fence = md.splitlines()[2]
    assert set(fence) == {"`"} and len(fence) > 3 and md.rstrip("\n").endswith(fence)
    body = md.split(fence)[1]
    assert "<img" in body and "<img" not in md.split(fence)[0]  # only inside the code block
