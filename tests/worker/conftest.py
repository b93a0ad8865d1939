"""The reference subject's own tests: every one runs its code (torch, transformers), so the
folder skips where the subject is not installed."""

import pytest

from tests.needs import SUBJECT, subject_installed

if not subject_installed():
    pytest.skip(SUBJECT, allow_module_level=True)
