"""Integration of the run's batches in the space discovery reads: Harmony (``harmonypy``), or a
mutual-nearest-neighbour correction (:func:`mnn_correct`), on the joint PCA of the aligned
expression, batch = the run's batches (reference and query by default).

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


def merge_order(batch: np.ndarray, labelled: np.ndarray | None) -> np.ndarray:
    """The order :func:`mnn_correct` merges the batches in: those holding labelled cells (the
    reference) first, then the others, each group largest first (ties by code).
    """
    codes, sizes = np.unique(batch, return_counts=True)
    has_labels = np.zeros(codes.size, dtype=bool)
    if labelled is not None:
        has_labels = np.isin(codes, np.unique(batch[np.asarray(labelled, dtype=bool)]))
    return codes[np.lexsort((codes, -sizes, ~has_labels))]


def integrated_space(
    pcs: np.ndarray,
    batch: np.ndarray,
    method: str,
    seed: int = 0,
    labelled: np.ndarray | None = None,
) -> tuple[np.ndarray | None, dict[str, Any]]:
    """The integrated embedding of ``method`` (``"harmony"``, or ``"mnn"``: :func:`mnn_correct`,
    the batches with ``labelled`` cells merged first) and its record for ``uns``, or
    ``(None, record)`` where there is nothing to integrate (``"none"``, or one batch).
    """
    n_batches = int(np.unique(batch).size)
    if method == "none" or n_batches < 2:
        reason = "not asked" if method == "none" else "one batch"
        return None, {"method": "none", "reason": reason}
    t0 = time.perf_counter()
    extra: dict[str, Any] = {}
    if method == "mnn":
        emb, merged = mnn_correct(pcs, batch, merge_order(batch, labelled))
        extra = {"pairs": [m["pairs"] for m in merged]}
    else:
        emb = harmony(pcs, batch, seed)
    return emb, {
        "method": method,
        "batches": n_batches,
        "cells": int(pcs.shape[0]),
        "n_pcs": int(pcs.shape[1]),
        **extra,
        "seconds": round(time.perf_counter() - t0, 3),
    }


#: neighbours each way that make a mutual pair (batchelor's ``fastMNN`` default)
MNN_NEIGHBORS = 20
#: paired cells whose corrections smooth each cell's (its nearest ones, Gaussian-weighted)
MNN_SMOOTH_CELLS = 50
#: cells whose distances to their paired cells are computed at once
_CHUNK = 4096


def _unit(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` scaled to unit length (zero rows left at zero)."""
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norm, 1e-12)


def _mnn_pairs(a: np.ndarray, b: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Mutual nearest neighbours of the rows of ``a`` and ``b`` (cosine: rows already unit
    length): the pairs ``(i, j)`` where ``b[j]`` is among the ``k`` nearest of ``a[i]`` in ``b``
    and ``a[i]`` among the ``k`` nearest of ``b[j]`` in ``a``. Sorted by ``(i, j)``.
    """
    from ._discover.compute import kneighbors

    ka, kb = min(k, b.shape[0]), min(k, a.shape[0])
    a_to_b = kneighbors(b, ka, a)  # (n_a, ka): rows of b
    b_to_a = kneighbors(a, kb, b)  # (n_b, kb): rows of a
    i = np.repeat(np.arange(a.shape[0]), ka)
    j = a_to_b.ravel()
    mutual = (b_to_a[j] == i[:, None]).any(axis=1)
    return i[mutual], j[mutual]


def mnn_correct(
    pcs: np.ndarray,
    batch: np.ndarray,
    order: np.ndarray,
    *,
    k: int = MNN_NEIGHBORS,
    smooth: int = MNN_SMOOTH_CELLS,
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """Mutual-nearest-neighbour correction of the PCA ``pcs`` ``(n, d)`` (Haghverdi et al. 2018,
    as batchelor's ``fastMNN`` does it in PCA space): the batches are merged in ``order``
    (batch codes, the first kept as it is); each next batch is moved onto the cells merged so
    far by the mean difference of its mutual nearest pairs (cosine, ``k`` neighbours each way),
    each of its cells by the Gaussian-weighted mean correction of its ``smooth`` nearest paired
    cells (bandwidth: the median distance to them). A translation per neighbourhood, not a
    clustering as Harmony's; but a type only the moved batch holds still pairs with the nearest
    cells of the other batch, which can be of a type the moved batch lacks, and is then moved
    onto them (``docs/discovery.md``: over-correction on small queries, and novel types merged
    when discovery cuts the query in this space). Returns the corrected PCA and, per merged
    batch, its cells and pairs.
    """
    from ._discover.compute import kneighbors

    out = np.array(pcs, dtype=np.float64, copy=True)
    merged = batch == order[0]
    record: list[dict[str, Any]] = []
    for b in order[1:]:  # loop over batches, not cells
        moving = np.flatnonzero(batch == b)
        fixed = np.flatnonzero(merged)
        i, j = _mnn_pairs(_unit(out[fixed]), _unit(out[moving]), k)
        record.append({"cells": int(moving.size), "pairs": int(i.size)})
        # never empty: the closest pair of the two batches is always mutual
        paired, inv = np.unique(j, return_inverse=True)
        diff = out[fixed[i]] - out[moving[j]]  # each paired cell's mean difference to its partners
        vec = np.zeros((paired.size, out.shape[1]))
        np.add.at(vec, inv, diff)
        vec /= np.bincount(inv, minlength=paired.size)[:, None]
        src, x = out[moving[paired]], out[moving]
        near = kneighbors(src, min(smooth, paired.size), x)  # (n_moving, m)
        d2 = np.empty(near.shape)
        for s in range(0, x.shape[0], _CHUNK):  # blocks of cells, not single cells
            blk = slice(s, s + _CHUNK)
            d2[blk] = ((x[blk, None, :] - src[near[blk]]) ** 2).sum(axis=2)
        h2 = max(float(np.median(d2)), 1e-12)  # the bandwidth needs every distance first
        w = np.exp(-(d2 - d2.min(axis=1, keepdims=True)) / h2)
        w /= w.sum(axis=1, keepdims=True)
        shift = np.empty_like(x)
        for s in range(0, x.shape[0], _CHUNK):
            blk = slice(s, s + _CHUNK)
            shift[blk] = np.einsum("nm,nmd->nd", w[blk], vec[near[blk]])
        out[moving] = x + shift
        merged |= batch == b
    return out.astype(np.float32), record
