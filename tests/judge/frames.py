"""Metric frames for the judging tests, built from lists as a reader would hand them over."""

from __future__ import annotations

import numpy as np
import pandas as pd


def frame(data: dict[str, list[float]]) -> pd.DataFrame:
    """Steps 1..n; every cell present, so NaN here is a logged NaN, not an absent value."""
    n = len(next(iter(data.values())))
    f = pd.DataFrame(data, index=pd.RangeIndex(1, n + 1, name="step"), dtype=np.float64)
    f.attrs["present"] = f.notna() | True
    return f
