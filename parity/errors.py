"""The one base class of bad input, at the very bottom (it imports nothing).

Every error that means "what you gave is wrong" (a spec, a metric file, a revision, a policy,
an output folder) derives from ``InputError``, and the CLI turns exactly these into its one-line
``parity: error: ...`` and exit 2. Anything else that escapes is a bug of the harness: exit 70
with its traceback, never "bad input" and never 1 ("diverged"). ``InputError`` is a ValueError,
so code that caught ValueError before still does.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input of the user's; the message is one line naming the file, key, step or metric."""


class SpecError(InputError):
    """An invalid job or pair spec; the message is one line."""


class PolicyError(InputError):
    """A policy text (`--policy`, a spec's [policies]) that does not parse."""
