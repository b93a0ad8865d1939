"""The run folder's names live in one module, parity/record/runfolder.py: the recorder that writes
a run folder and the harness that reads it must never spell a name on their own, or the two
drift apart. This scans parity/ for a name spelled as a string outside that module, and checks
that docs/run-folder.md, the folder's description for people who write one by hand, names every
entry the module does.

Docstrings are prose and may name the files; every other string counts, f-strings included.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from parity.record import runfolder

ROOT = Path(__file__).resolve().parents[2]
PARITY = ROOT / "parity"
HOME = PARITY / "record" / "runfolder.py"
DOC = ROOT / "docs" / "run-folder.md"

#: the module's names: NAME -> its value (every upper-case string constant it exports)
NAMES = {n: getattr(runfolder, n) for n in runfolder.__all__ if n.isupper()}
FILES = [v for v in NAMES.values() if "." in v and "{" not in v and not v.startswith(".")]
FOLDERS = [v for v in NAMES.values() if "." not in v]
SUFFIXES = [v for v in NAMES.values() if v.startswith(".")]
# a rank file spelled as a template, an f-string, a number or a regex: rank{r}.jsonl,
# f"rank{rank}.jsonl", rank0.jsonl, r"rank(\d+)\.jsonl"
RANK_FILE = re.compile(
    r"rank(\{[^}]*\}|\d+|\(\\d\+\))"
    + re.escape(runfolder.RANK_FILE.split("}", 1)[1]).replace(r"\.", r"\\?\.")
)


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring nodes (module, class, function): prose, not names."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


PATH_CALLS = {"Path", "PurePath", "joinpath", "join"}


def _in_path(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """Whether a bare folder name is used as a path: an operand of `/`, an argument of Path(),
    joinpath or os.path.join, or a name of its own (X = "ops", X, Y = "ranks", ...); a JSON key
    or a word of a message is not."""
    parent = parents.get(id(node))
    if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Div):
        return True
    if isinstance(parent, ast.Call) and node in parent.args:
        func = parent.func
        return getattr(func, "id", getattr(func, "attr", None)) in PATH_CALLS
    if isinstance(parent, ast.Tuple):
        parent = parents.get(id(parent))
    return isinstance(parent, (ast.Assign, ast.AnnAssign))


def _text(node: ast.AST) -> str | None:
    """A string constant's text, an f-string's with each placeholder as {}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def spelled_names(source: str, name: str = "<source>") -> list[str]:
    """'FILE:LINE: what' for each run-folder name a module spells as a string of its own."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    found = []
    for node in ast.walk(tree):
        text = _text(node)
        if text is None or id(node) in skip or isinstance(parents.get(id(node)), ast.JoinedStr):
            continue
        hits = [f for f in FILES if f in text]
        hits += [m.group(0) for m in [RANK_FILE.search(text)] if m]
        hits += [s for s in SUFFIXES if text == s]
        hits += [d for d in FOLDERS if text.startswith(d + "/")]
        hits += [d for d in FOLDERS if text == d and _in_path(node, parents)]
        found += [f"{name}:{node.lineno}: {h!r}" for h in hits]  # type: ignore[attr-defined]
    return found


def test_no_run_folder_name_is_spelled_outside_its_module() -> None:
    modules = sorted(p for p in PARITY.rglob("*.py") if p != HOME)
    assert len(modules) > 50, "the scan found too few files: wrong root?"
    found = [
        hit
        for path in modules
        for hit in spelled_names(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not found, "use parity.record.runfolder's names:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        'p = run_dir / "metrics.jsonl"',
        'raise E(f"{path}: folder has no manifest.json")',
        'LineLog(out / "fingerprints.jsonl")',
        'opened("console.log", True)',
        'opened(f"ranks/rank{rank}.jsonl", True)',
        'folder = Path(out) / "ops"',
        'OPS = "ops"',
        'RANKS_DIR, FP = "ranks", "x"',
        'pattern = re.compile(r"rank(\\d+)\\.jsonl")',
        'pt = path.with_suffix(".pt")',
    ],
)
def test_a_spelled_name_is_caught(source: str) -> None:
    """The scan can fail: each way the names were spelled before they had a module is named."""
    assert spelled_names(source), source


def test_prose_and_json_keys_are_not_names() -> None:
    source = '''
def f():
    """Reads metrics.jsonl and ranks/rank{r}.jsonl."""
    return {"ops": 3, "ranks": [0, 1]}, rec.get("ops"), f"rank {r}: {n} ops"
'''
    assert spelled_names(source) == []


def test_the_module_imports_only_the_standard_library() -> None:
    """The recorder (in the user's ranks) and every layer of the harness import it."""
    tree = ast.parse(HOME.read_text())
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    outside = [m for m in modules if m.split(".")[0] not in sys.stdlib_module_names]
    assert not outside, outside


def test_the_doc_names_every_entry() -> None:
    """docs/run-folder.md names each file and folder the module does, with its constant."""
    doc = DOC.read_text()
    missing = [
        f"{name} ({value})"
        for name, value in NAMES.items()
        if f"`{name}`" not in doc or (value.replace("{rank}", "{r}") not in doc)
    ]
    assert not missing, f"{DOC.name} does not describe: {', '.join(missing)}"


def test_the_helpers_join_the_names(tmp_path: Path) -> None:
    assert runfolder.metrics_path(tmp_path) == tmp_path / "metrics.jsonl"
    assert runfolder.manifest_path(tmp_path) == tmp_path / "manifest.json"
    assert runfolder.rank_path(tmp_path, 3) == tmp_path / "ranks" / "rank3.jsonl"
    assert runfolder.op_trace_paths(tmp_path, 1) == (
        tmp_path / "ops" / "rank1.jsonl",
        tmp_path / "ops" / "rank1.pt",
    )
    folder = tmp_path / "ranks"
    folder.mkdir()
    for name in ("rank10.jsonl", "rank2.jsonl", "rank2.jsonl.tmp", "notes.txt"):
        (folder / name).touch()
    assert runfolder.numbered_files(folder) == {
        2: folder / "rank2.jsonl",
        10: folder / "rank10.jsonl",
    }
    assert runfolder.numbered_files(tmp_path / "ops") == {}
