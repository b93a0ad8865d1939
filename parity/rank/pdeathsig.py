"""A child SIGKILLed when its parent dies (Linux prctl), however the parent dies.

Both sides use it: the harness's launcher arms it in the process it starts (torchrun, or a plain
job: parity.run.launch, Popen's preexec_fn), the warm process in each child it forks for a job
(parity.rank.warm). The start-up hook arms the same for torchrun's ranks with its own copy
(sitehook/sitecustomize.py: standard library only, loaded before parity can be).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies
PR_SET_CHILD_SUBREAPER = 36  # prctl(2): orphans below this process are re-parented to it


def parent_death_signal(parent: int, adopt_orphans: bool = False) -> Callable[[], None] | None:
    """What a child runs first (Popen's preexec_fn, or a forked child itself; Linux): it is then
    SIGKILLed when ``parent`` dies, and ends at once if it already has. None elsewhere. prctl is
    looked up here, before the fork, not in the child.

    ``adopt_orphans`` (a launch's root process; kept across exec): a process its job starts and
    orphans at once (a double fork, a daemon) is re-parented to it rather than to init, so the
    launch's watchdog still finds it as a descendant, however fast its parent exited."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if adopt_orphans:
            prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm
