"""`parity`: run matched pairs, compare metric files, write reports, check git revisions.

Exit codes: 0 aligned, 1 diverged, 2 bad input (spec, file, format, a partial read, nothing
compared, a path that cannot be read or written: one line `parity: error: ...`), 3 a run failed,
4 nondeterministic (pair --noise-floor: side A run twice differed), 5 imprecise (a metric judged
exact whose source is rounded: the line names it and its precision), 70 an internal error (a
bug of ours: one line `parity: internal error, please report: ...`, then the traceback). bisect:
1 when it names the first diverging commit, 0 when bad is aligned with good. Stopped by a
signal: 130 (SIGINT), 143 (SIGTERM), 129 (SIGHUP); output into a closed pipe: 141. No other code:
1 is only "diverged".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import traceback

from parity.cli import bisect, catalogue, check, ci, compare, onpolicy, pair, report, spec
from parity.cli.common import (
    EXIT_ALIGNED,
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    EXIT_IMPRECISE,
    EXIT_INTERNAL,
    EXIT_NONDETERMINISTIC,
    EXIT_RUN_FAILED,
)
from parity.errors import InputError
from parity.readers.frame import clip_message
from parity.run.launch import LaunchError

__all__ = [
    "EXIT_ALIGNED", "EXIT_BAD_INPUT", "EXIT_DIVERGED", "EXIT_IMPRECISE", "EXIT_INTERNAL",
    "EXIT_NONDETERMINISTIC", "EXIT_RUN_FAILED", "build_parser", "main",
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser, each from its own module (parity/cli/<command>.py)."""
    p = argparse.ArgumentParser(prog="parity", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for command in (pair, compare, report, check, bisect, onpolicy, spec):
        command.add_parser(sub)
    catalogue.add_parsers(sub)
    ci.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """The command line. SIGINT, SIGTERM and SIGHUP stop it alike (parity.run.signals): launches
    stopped, worktrees and temp folders removed, what was written kept, one line on stderr, exit
    130, 143 or 129. Output into a closed pipe (`parity compare A B | head`) ends quietly, 141."""
    from parity.run.signals import Interrupted, cancellable, quiet_closed_pipe

    args = build_parser().parse_args(argv)
    with cancellable() as owner:
        try:
            return _run(args)
        except Interrupted as e:
            if not owner:  # an outer handler (the pytest plugin's) reports it
                raise
            try:
                print(_interrupted_line(args, e.signame, e.exit_code), file=sys.stderr, flush=True)
            except BrokenPipeError:
                quiet_closed_pipe()
            return e.exit_code
        except BrokenPipeError:
            return quiet_closed_pipe()


_CLEANED_UP = {
    "pair": "launches stopped",
    "onpolicy": "launch stopped",
    "check": "launches stopped, temporary worktrees removed",
    "bisect": "launches stopped, temporary worktree and its bisect state removed",
}


def _interrupted_line(args: argparse.Namespace, signame: str, exit_code: int) -> str:
    """The one line an interrupted command prints: what, by which signal, where its results are."""
    line = f"parity: {args.command} interrupted by {signame} (exit {exit_code})"
    if args.command in _CLEANED_UP:
        line += f": {_CLEANED_UP[args.command]}"
    out = getattr(args, "out", None)
    return line + (f"; what was completely written is in {out}" if out else "")


def _run(args: argparse.Namespace) -> int:
    """The command, with every exception it may raise turned into the exit-code contract: bad
    input 2 (one line), a failed run 3, anything else a bug of ours, 70 with its traceback. An
    uncaught exception would leave as Python's exit 1, which a CI script reads as "diverged"."""
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except InputError as e:  # the one class of bad input (parity.errors)
        return _bad_input(str(e))
    except LaunchError as e:
        refused = e.result.refused_arguments
        if refused is not None:  # e.g. a misspelled key in the spec's overrides
            source = getattr(args, "spec", None) or "the job's flags"
            return _bad_input(
                f"{source}: the job refused its arguments: {refused} (log: {e.result.run_dir})"
            )
        if getattr(args, "json", False):  # a crashed run is "failed", never aligned or diverged
            print(json.dumps({"verdict": "failed", **e.result.to_dict(), "error": str(e)}))
        print(f"parity: run failed: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except BrokenPipeError:
        raise  # main's closed pipe (141), not a path of the user's
    except OSError as e:
        if e.filename is not None or isinstance(e, _PATH_ERRORS):
            return _bad_input(_path_error(e))
        return _internal_error(e)
    except Exception as e:  # RecursionError included: a reader turns its own into MetricsError
        return _internal_error(e)


MAX_ERROR_LINE = 300  # characters of an error line; a longer one loses values, then its middle
# OSErrors about a path the user gave (--out a regular file, an unreadable input): bad input
_PATH_ERRORS = (
    FileExistsError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError,
)  # fmt: skip


def _error_line(text: str) -> str:
    """``text`` as one line of at most MAX_ERROR_LINE characters: the one place error lines are
    clipped, so that a 10 MB value quoted in a message cannot flood a CI log."""
    line = clip_message(re.sub(r"\s*\n\s*", " ", text.strip()))  # quoted values elided first
    if len(line) > MAX_ERROR_LINE:  # then the middle: the path in front, the advice at the end
        tail = MAX_ERROR_LINE // 3
        line = line[: MAX_ERROR_LINE - tail - 5] + " ... " + line[-tail:]
    return line


def _bad_input(message: str) -> int:
    print(_error_line(f"parity: error: {message}"), file=sys.stderr)
    return EXIT_BAD_INPUT


def _path_error(e: OSError) -> str:
    """'PATH: File exists' (both paths of a rename or link): the path first, as errors do here."""
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    what = e.strerror or str(e) or type(e).__name__
    return f"{where}: {what}" if where else what


def _internal_error(e: Exception) -> int:
    """Not a verdict and not the user's input: a bug to report, with the traceback to report."""
    sys.stdout.flush()
    head = _error_line(f"parity: internal error, please report: {type(e).__name__}: {e}")
    print(head, file=sys.stderr)
    traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    return EXIT_INTERNAL
