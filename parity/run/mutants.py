"""Run a job with named mutants applied first, in every rank: the harness's one way to break code.

    torchrun ... -m parity.run.mutants --mutants NAME[,NAME] [--catalogue MODULE] -m pkg ARGS...

A catalogue is any importable module with `MUTANTS = {name: (description, apply)}`, where
`apply()` monkeypatches the code under test. A package registers its catalogues in the
``llm_parity.mutants`` entry points (parity.tasks), and a name is looked up in all of them; the
reference subject's is `worker.mutants`. ``--catalogue`` names one module instead.
"""

from __future__ import annotations

import argparse
import runpy
import sys

from parity.tasks import TaskError, find_mutants


def apply_mutants(names: list[str], module: str | None = None) -> set[str]:
    """Apply each named mutant (an unknown one: SystemExit with the known ones); the catalogue
    modules they came from."""
    try:
        found = find_mutants(names, module)
    except TaskError as e:
        raise SystemExit(f"error: {e}") from None
    for name in names:
        found[name][1]()
    return {home for home, _ in found.values()}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-m" not in argv:
        raise SystemExit(
            "usage: python -m parity.run.mutants --mutants A,B [--catalogue M] -m MODULE ..."
        )
    split = argv.index("-m")
    parser = argparse.ArgumentParser(prog="python -m parity.run.mutants")
    parser.add_argument("--mutants", default="")
    parser.add_argument("--catalogue", default=None, help="default: every registered catalogue")
    args = parser.parse_args(argv[:split])
    target, rest = argv[split + 1], argv[split + 2 :]
    apply_mutants([n for n in args.mutants.split(",") if n], args.catalogue)
    sys.argv = [target, *rest]
    runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
