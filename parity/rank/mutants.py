"""Run a job with named mutants applied first, in every rank: the harness's one way to break code.

    torchrun ... -m parity.rank.mutants --mutants NAME[,NAME] [--catalogue MODULE] -m pkg ARGS...

A catalogue is any importable module with `MUTANTS = {name: (description, apply)}`, where
`apply()` monkeypatches the code under test. A package registers its catalogues in the
``llm_parity.mutants`` entry points, and a name is looked up in all of them; the reference
subject's is `worker.mutants`. ``--catalogue`` names one module instead.

The lookup lives here because it runs in the rank (standard library only); the harness lists
the catalogues through parity.tasks (`parity mutants`), which raises its TaskError for ours.
"""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys
from collections.abc import Callable
from importlib.metadata import entry_points

MUTANT_GROUP = "llm_parity.mutants"


class MutantError(LookupError):
    """A mutant or catalogue that is not known, or that its package failed to give."""


def catalogues() -> dict[str, str]:
    """Registered mutant catalogues: name -> module (each with MUTANTS)."""
    return {ep.name: ep.value for ep in entry_points(group=MUTANT_GROUP)}


def load_catalogue(module: str) -> dict[str, tuple[str, Callable[[], None]]]:
    """MUTANTS of one catalogue module."""
    try:
        catalogue = importlib.import_module(module).MUTANTS
    except (ImportError, AttributeError) as e:
        raise MutantError(f"mutant catalogue {module!r} not loadable: {e}") from None
    return dict(catalogue)


def find_mutants(
    names_: list[str], module: str | None = None
) -> dict[str, tuple[str, Callable[[], None]]]:
    """Each named mutant's (catalogue module, apply), from ``module`` or else from every
    registered catalogue (a name two catalogues share must be given its catalogue)."""
    modules = [module] if module else list(catalogues().values())
    found: dict[str, list[tuple[str, Callable[[], None]]]] = {}
    for mod in modules:
        for name, (_, apply) in load_catalogue(mod).items():
            found.setdefault(name, []).append((mod, apply))
    out = {}
    for name in names_:
        where = found.get(name, [])
        if not where:
            known = ", ".join(sorted(found)) or f"none (no package registers {MUTANT_GROUP})"
            raise MutantError(f"unknown mutant {name!r} in {', '.join(modules) or 'no catalogue'}; "
                              f"known: {known}")  # fmt: skip
        if len(where) > 1:
            both = ", ".join(mod for mod, _ in where)
            raise MutantError(f"mutant {name!r} is in several catalogues ({both}); give one")
        out[name] = where[0]
    return out


def apply_mutants(names: list[str], module: str | None = None) -> set[str]:
    """Apply each named mutant (an unknown one: SystemExit with the known ones); the catalogue
    modules they came from."""
    try:
        found = find_mutants(names, module)
    except MutantError as e:
        raise SystemExit(f"error: {e}") from None
    for name in names:
        found[name][1]()
    return {home for home, _ in found.values()}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-m" not in argv:
        raise SystemExit(
            "usage: python -m parity.rank.mutants --mutants A,B [--catalogue M] -m MODULE ..."
        )
    split = argv.index("-m")
    parser = argparse.ArgumentParser(prog="python -m parity.rank.mutants")
    parser.add_argument("--mutants", default="")
    parser.add_argument("--catalogue", default=None, help="default: every registered catalogue")
    args = parser.parse_args(argv[:split])
    target, rest = argv[split + 1], argv[split + 2 :]
    apply_mutants([n for n in args.mutants.split(",") if n], args.catalogue)
    sys.argv = [target, *rest]
    runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
