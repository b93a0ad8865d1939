"""Run a job with named mutants applied first, in every rank: the harness's one way to break code.

    torchrun ... -m parity.inject --mutants NAME[,NAME] [--catalogue MODULE] -m worker.sft ARGS...

A catalogue is any importable module with `MUTANTS = {name: (description, apply)}`, where
`apply()` monkeypatches the code under test. Ours is `worker.mutants`; other stacks bring theirs.
"""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys
from collections.abc import Callable

DEFAULT_CATALOGUE = "worker.mutants"


def load_catalogue(module: str = DEFAULT_CATALOGUE) -> dict[str, tuple[str, Callable[[], None]]]:
    try:
        catalogue = importlib.import_module(module).MUTANTS
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"error: mutant catalogue {module!r} not loadable: {e}") from None
    return dict(catalogue)


def apply_mutants(names: list[str], module: str = DEFAULT_CATALOGUE) -> None:
    catalogue = load_catalogue(module)
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        known = ", ".join(sorted(catalogue))
        raise SystemExit(f"error: unknown mutant {unknown[0]!r} in {module}; known: {known}")
    for name in names:
        catalogue[name][1]()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-m" not in argv:
        raise SystemExit(
            "usage: python -m parity.inject --mutants A,B [--catalogue M] -m MODULE ..."
        )
    split = argv.index("-m")
    parser = argparse.ArgumentParser(prog="python -m parity.inject")
    parser.add_argument("--mutants", default="")
    parser.add_argument("--catalogue", default=DEFAULT_CATALOGUE)
    args = parser.parse_args(argv[:split])
    target, rest = argv[split + 1], argv[split + 2 :]
    apply_mutants([n for n in args.mutants.split(",") if n], args.catalogue)
    sys.argv = [target, *rest]
    runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
