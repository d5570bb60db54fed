"""``--set key=value`` options of the benchmark scripts, read as ``OrcaConfig`` overrides."""

from __future__ import annotations

import ast
from typing import Any


def config_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["epochs=5", "pair_space=pca"]`` -> ``{"epochs": 5, "pair_space": "pca"}``: values are
    Python literals where they parse as one, strings otherwise.
    """
    overrides: dict[str, Any] = {}
    for kv in pairs:
        k, v = kv.split("=", 1)
        try:
            overrides[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            overrides[k] = v
    return overrides
