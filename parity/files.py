"""Atomic writes: a temp file in the same folder, then a rename. Nothing is ever written half.

The one implementation is the recorder's (`parity.record.files`), the bottom layer; reports,
summaries and goldens refuse NaN here, where a run's own records spell it as Python does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from parity.record.files import write_text_atomic

__all__ = ["write_json_atomic", "write_text_atomic"]


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")
