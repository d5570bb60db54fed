"""Printing and saving the figures of a benchmark script."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def report_figures(out: dict[str, Any], path: Path) -> None:
    """Print ``out`` one figure per line (floats to 4 significant digits), write it as JSON."""
    width = max(map(len, out), default=0)
    for k, v in out.items():
        print(f"{k:>{width}}: {v:.4g}" if isinstance(v, float) else f"{k:>{width}}: {v}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
