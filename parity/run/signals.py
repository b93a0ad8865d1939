"""Cancellation as CI does it, and quiet closed pipes (children that die with their parent:
parity.rank.pdeathsig, which the warm ranks use too).

CI cancels a job with signals: GitHub Actions sends SIGINT, then SIGTERM; Slurm and Kubernetes
send SIGTERM; a closed terminal sends SIGHUP. Inside ``cancellable()`` each of them raises
``Interrupted`` in the main thread: a KeyboardInterrupt that remembers its signal. So the three
take the one path Ctrl-C always took, the try/finally blocks that stop launches (whole process
groups, ``parity.run.launch``) and remove worktrees (``parity.check``, ``parity.bisect``); the
entry point that installed the handler prints one line and exits 128 + the signal number (130,
143, 129). Why not a cleanup of its own per signal: one exception path is the one that is tested.

Once a signal has been raised (or is held back), the next ones are ignored: CI's SIGTERM 7.5 s
after its SIGINT must not cut short the cleanup the SIGINT started. ``deferred()`` holds a signal
back, in the main thread, while a step that must not be cut in half runs (starting a launch,
adding or removing a worktree), and raises it right after. A signal ignored when the handler is
installed stays ignored (``nohup``, a non-interactive shell's background job).

A closed pipe (``parity compare A B | head``) is normal use: ``quiet_closed_pipe()`` points the
broken standard stream at /dev/null so that the interpreter's last flush cannot fail again, and
gives exit 141 (128 + SIGPIPE), what a program killed by SIGPIPE gives (``seq 1e6 | head``): not
0, which this tool's exit codes read as "aligned" when the verdict may never have been read.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

__all__ = [
    "EXIT_CLOSED_PIPE",
    "SIGNALS",
    "Interrupted",
    "cancellable",
    "deferred",
    "install",
    "installed",
    "quiet_closed_pipe",
    "received",
]

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_CLOSED_PIPE = 128 + signal.SIGPIPE  # 141


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP, raised in the main thread; ``exit_code`` is 128 + signal."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(f"interrupted by {self.signame}")

    @property
    def signame(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


# main-thread state of the installed handler
_received: int | None = None  # the first signal since install(); later ones are ignored
_raised = False  # whether it was raised already (else it waits for the end of deferred())
_depth = 0  # deferred() blocks open


def _handler(signum: int, frame: object) -> None:
    global _received
    if _received is not None:  # an interruption is under way: let its cleanup finish
        return
    _received = signum
    if _depth == 0:
        _raise()


def _raise(cause: BaseException | None = None) -> None:
    global _raised
    assert _received is not None
    _raised = True
    raise Interrupted(_received) from cause


def _reset() -> None:
    global _received, _raised, _depth
    _received, _raised, _depth = None, False, 0


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def installed() -> bool:
    """Whether this module's handler is installed for any of SIGNALS."""
    return any(signal.getsignal(sig) is _handler for sig in SIGNALS)


def received() -> int | None:
    """The signal that interrupted this process since install() (raised or held), or None."""
    return _received


def install() -> Callable[[], None]:
    """Install the handler for SIGINT, SIGTERM and SIGHUP (not for one that is ignored); return
    the function that puts the previous handlers back. Main thread only."""
    saved = {}
    for sig in SIGNALS:
        old = signal.getsignal(sig)
        if old == signal.SIG_IGN:  # nohup, or a shell's background job: it stays ignored
            continue
        saved[sig] = signal.SIG_DFL if old is None else old
        signal.signal(sig, _handler)
    _reset()

    def restore() -> None:
        for sig, old in saved.items():
            signal.signal(sig, old)
        _reset()

    return restore


@contextlib.contextmanager
def cancellable() -> Iterator[bool]:
    """Within it, SIGINT, SIGTERM and SIGHUP raise ``Interrupted``. Yields True when this call
    installed the handler (its caller then turns ``Interrupted`` into one line and an exit
    code), False when an outer one had (let it through to that one) or off the main thread."""
    if not _main_thread() or installed():
        yield False
        return
    restore = install()
    try:
        yield True
    finally:
        restore()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold back a signal until the block is done, then raise it (chained to the block's own
    exception, if any). For steps that must not be cut in half; a no-op off the main thread or
    without the handler."""
    global _depth
    if not _main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    except BaseException as e:
        _depth -= 1
        if _depth == 0 and _received is not None and not _raised:
            _raise(e)
        raise
    _depth -= 1
    if _depth == 0 and _received is not None and not _raised:
        _raise()


def quiet_closed_pipe() -> int:
    """After a BrokenPipeError on stdout or stderr: point each broken one at /dev/null, so that
    the interpreter's flush at exit cannot raise again, and return 141 (128 + SIGPIPE)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
            continue
        except BrokenPipeError:
            pass
        except (OSError, ValueError):
            continue
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
    return EXIT_CLOSED_PIPE
