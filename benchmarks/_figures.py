"""Printing and saving the figures of a benchmark script."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd


def report_figures(out: dict[str, Any], path: Path) -> None:
    """Print ``out`` one figure per line (floats to 4 significant digits), write it as JSON."""
    width = max(map(len, out), default=0)
    for k, v in out.items():
        print(f"{k:>{width}}: {v:.4g}" if isinstance(v, float) else f"{k:>{width}}: {v}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))


def agreement(a, b) -> float:
    """Share of cells with the same label once each label of ``b`` is renamed to the label of
    ``a`` it overlaps most (novel cluster numbers may differ between runs).
    """
    tab = pd.crosstab(pd.Series(b, name="b"), pd.Series(a, name="a"))
    rename = tab.idxmax(axis=1).to_dict()
    return float(np.mean(np.array([rename[x] for x in b]) == a))
