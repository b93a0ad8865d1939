"""The harness's layers, asserted so that they stay: data flows one way, and a module never
imports one of a higher layer, nor another module's private names.

    base     record/ (imports nothing else of parity), rank/ (runs in the user's ranks: imports
             only the standard library, torch inside functions, parity.record and itself; its
             start-up hook the standard library alone), readers/, errors, files, outdir, secrets
    judge    judge/ (policy, ulp, compare, noise, golden, diagnose, opdiff, onpolicy, topology),
             spec, tasks, report
    run      run/ (signals, world, launch, results, torchrun_logs, proc_scan, slurm, job,
             inprocess, pool, trace_rerun)
    orchestration  pair, check, carry, git, store, bisect
    faces    cli, plugin, the package's lazy exports (parity/__init__.py)

Imports under ``if TYPE_CHECKING:`` are annotations only and not counted; an import inside a
function is (it runs).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PARITY = Path(__file__).resolve().parents[2] / "parity"

LAYERS = {
    "base": [
        "parity.record",
        "parity.rank",
        "parity.readers",
        "parity.errors",
        "parity.files",
        "parity.outdir",
        "parity.secrets",
    ],
    "judge": ["parity.spec", "parity.tasks", "parity.judge", "parity.report"],
    "run": ["parity.run"],
    "orchestration": [
        "parity.pair",
        "parity.check",
        "parity.carry",
        "parity.git",
        "parity.store",
        "parity.bisect",
    ],  # fmt: skip
    "faces": ["parity.cli", "parity.plugin", "parity"],
}
ORDER = list(LAYERS)
#: parts of the base layer that run in the user's processes and import nothing else of parity
#: but these: the recorder (in their loop), the rank-side code (in their ranks)
CLOSED = {"parity.record": ("parity.record",), "parity.rank": ("parity.rank", "parity.record")}
#: what else those may import: the standard library, and torch inside a function (the hook: the
#: standard library alone, loaded before anything of parity)
FOREIGN = {"parity.rank": {"torch"}, "parity.rank.sitehook": set()}


def module_name(path: Path) -> str:
    parts = path.relative_to(PARITY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    """The layer of a module: the one whose longest prefix names it."""
    best = ("", "")
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best[0]):
                best = (prefix, layer)
    assert best[1], f"{module} is in no layer: add it to LAYERS (and the docstring)"
    return best[1]


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    return skipped


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported parity module, names taken from it) of each import that runs."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("parity")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("parity"):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            module = node.module or ""
            for alias in node.names:  # `from parity import world`: the submodule
                sub = f"{module}.{alias.name}"
                if (PARITY.parent / sub.replace(".", "/")).with_suffix(".py").exists() or (
                    PARITY.parent / sub.replace(".", "/")
                ).is_dir():
                    found.append((node.lineno, sub, []))
                else:
                    found.append((node.lineno, module, [alias.name]))
    return found


MODULES = sorted(p for p in PARITY.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PARITY.parent)))
def test_no_module_imports_a_higher_layer(path: Path) -> None:
    me = module_name(path)
    mine = ORDER.index(layer_of(me))
    wrong = []
    for line, module, _ in imports(path):
        theirs = layer_of(module)
        if ORDER.index(theirs) > mine:
            wrong.append(f"{path}:{line}: {me} ({ORDER[mine]}) imports {module} ({theirs})")
        for closed, allowed in CLOSED.items():
            if _under(me, closed) and not any(_under(module, a) for a in allowed):
                wrong.append(f"{path}:{line}: {me} imports {module}: {closed} imports only "
                             f"{', '.join(allowed)} of parity")  # fmt: skip
    assert not wrong, "\n".join(wrong)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def foreign_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, top-level package, inside a function) of each import of something not parity that
    runs (under ``if TYPE_CHECKING:``: not counted)."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    in_function = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        found += [
            (node.lineno, name.split(".")[0], id(node) in in_function)
            for name in names
            if name.split(".")[0] != "parity"
        ]
    return found


RANK_MODULES = [p for p in MODULES if _under(module_name(p), "parity.rank")]


@pytest.mark.parametrize("path", RANK_MODULES, ids=lambda p: str(p.relative_to(PARITY.parent)))
def test_rank_code_imports_only_the_standard_library_and_torch_lazily(path: Path) -> None:
    """What runs in the user's ranks loads nothing the harness depends on (pandas, numpy,
    matplotlib): the standard library, and torch only inside the function that needs it."""
    me = module_name(path)
    rule = max((prefix for prefix in FOREIGN if _under(me, prefix)), key=len)
    wrong = [
        f"{path}:{line}: {me} imports {top}"
        + (" at import: only inside the function that needs it" if top in FOREIGN[rule]
           else f": {rule} imports the standard library{' and torch' * bool(FOREIGN[rule])} only")
        for line, top, lazily in foreign_imports(path)
        if top not in sys.stdlib_module_names and not (top in FOREIGN[rule] and lazily)
    ]  # fmt: skip
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PARITY.parent)))
def test_no_module_takes_another_modules_private_names(path: Path) -> None:
    me = module_name(path)
    wrong = [
        f"{path}:{line}: {me} takes {name} from {module}"
        for line, module, names in imports(path)
        for name in names
        if name.startswith("_") and module != me
    ]
    assert not wrong, "\n".join(wrong)


def test_the_local_launcher_imports_no_job_model() -> None:
    """parity.run.launch starts processes: what it masks in its reproduce line comes from the
    base module parity.secrets, not from the job and pair model in parity.spec."""
    taken = [module for _, module, _ in imports(PARITY / "run" / "launch.py")]
    assert "parity.spec" not in taken
    assert "parity.secrets" in taken


def test_a_planted_upward_import_is_caught(tmp_path: Path, monkeypatch) -> None:
    """The check can fail: readers importing the CLI is named with its line."""
    planted = PARITY / "readers" / "planted_for_test.py"
    monkeypatch.setattr(
        Path, "read_text",
        lambda self, *a, **k: "import os\nfrom parity.cli import main\n" if self == planted
        else Path.read_bytes(self).decode(),
    )  # fmt: skip
    with pytest.raises(AssertionError, match=r"planted_for_test.py:2: parity.readers.planted_for"):
        test_no_module_imports_a_higher_layer(planted)


@pytest.mark.parametrize(
    "planted, line",
    [
        ("from parity.run.launch import launch\n", "parity.rank.planted imports parity.run.launch"),
        ("import pandas\n", "imports pandas: parity.rank imports the standard library and torch"),
        ("import torch\n", "imports torch at import: only inside the function"),
    ],
    ids=["the-harness", "pandas", "torch-at-import"],
)
def test_a_rank_module_that_loads_the_harness_is_caught(monkeypatch, planted, line) -> None:
    """The rank's rule can fail: an import of the harness, of pandas, of torch at import time."""
    path = PARITY / "rank" / "planted.py"
    monkeypatch.setattr(
        Path, "read_text",
        lambda self, *a, **k: f"import os\n{planted}" if self == path
        else Path.read_bytes(self).decode(),
    )  # fmt: skip
    with pytest.raises(AssertionError, match=rf"planted.py:2: .*{line}"):
        test_no_module_imports_a_higher_layer(path)
        test_rank_code_imports_only_the_standard_library_and_torch_lazily(path)
