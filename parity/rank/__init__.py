"""Code that runs inside the user's ranks, on the user's interpreter, beside their training code.

    sitehook/sitecustomize.py  the start-up hook every process of a launch loads (its world record,
                               its stacks on a signal, death with its launcher); standard library
                               only, loaded as a top-level module before anything of parity
    warm.py                    the warm process: imports once, then forks a fresh child per job
                               (both sides of an in-process pair: `-m parity.rank.warm`)
    serve.py                   a warm pool's rank: the jobs of its queue, one child each
                               (`-m parity.rank.serve`)
    mutants.py                 named mutants looked up and applied before the job starts
                               (`-m parity.rank.mutants`)
    pdeathsig.py               a child SIGKILLed when its parent dies (Linux prctl)

Its rule, held by tests/project/test_layers.py as the recorder's is: it imports only the standard
library, torch (lazily, inside the function that needs it) and parity.record, never the harness's
other layers, so nothing the harness depends on (pandas, matplotlib, ...) ever loads in a rank,
and a rank's start-up is the job's own. The harness (parity.run) imports from here what both
sides must agree on (the flags, file names and queue layout below); this package never imports
the harness.
"""

from __future__ import annotations

from pathlib import Path

#: first on every launch's PYTHONPATH (parity.run.world.launch_env), so Python loads the hook
HOOK_DIR = Path(__file__).resolve().parent / "sitehook"
#: the folder a launch's world records go to; the hook reads it too (its own copy: stdlib only)
WORLD_DIR_ENV = "PARITY_WORLD_DIR"
