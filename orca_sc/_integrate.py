"""Integration of the run's batches in the space discovery reads: Harmony (``harmonypy``) on the
joint PCA of the aligned expression, batch = the run's batches (reference and query by default).

Discovery's kNN graphs, candidate clusters, label support and deserts and query votes then read
the integrated embedding instead of a PCA of each cell set (``DiscoveryConfig.integration``).
Torch-free and AnnData-free.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np


def harmony(pcs: np.ndarray, batch: np.ndarray, seed: int = 0) -> np.ndarray:
    """Harmony's corrected embedding ``(n, d)`` of the PCA ``pcs`` ``(n, d)`` with one batch
    per distinct value of ``batch`` ``(n,)`` (its defaults: theta 2, sigma 0.1, at most 10
    rounds; ``seed`` fixes its k-means).
    """
    import harmonypy
    import pandas as pd

    meta = pd.DataFrame({"batch": np.asarray(batch).astype(str)})
    logging.getLogger("harmonypy").setLevel(logging.WARNING)
    ho = harmonypy.run_harmony(
        np.ascontiguousarray(pcs, dtype=np.float64), meta, "batch", random_state=seed,
        verbose=False,
    )  # fmt: skip
    z = np.asarray(ho.Z_corr)
    if z.shape != pcs.shape:  # older harmonypy: (d, n)
        z = z.T
    return z.astype(np.float32)


def integrated_space(
    pcs: np.ndarray, batch: np.ndarray, method: str, seed: int = 0
) -> tuple[np.ndarray | None, dict[str, Any]]:
    """The integrated embedding of ``method`` (``"harmony"``) and its record for ``uns``, or
    ``(None, record)`` where there is nothing to integrate (``"none"``, or one batch).
    """
    n_batches = int(np.unique(batch).size)
    if method == "none" or n_batches < 2:
        reason = "not asked" if method == "none" else "one batch"
        return None, {"method": "none", "reason": reason}
    t0 = time.perf_counter()
    emb = harmony(pcs, batch, seed)
    return emb, {
        "method": method,
        "batches": n_batches,
        "cells": int(pcs.shape[0]),
        "n_pcs": int(pcs.shape[1]),
        "seconds": round(time.perf_counter() - t0, 3),
    }
