"""Bringing query batches onto the reference before training (fixes batch shift).

Every method returns an affine transform per batch, ``x' = x * scale[b] + offset[b]`` (each
``(n_batches, n_genes)``), applied to dense mini-batches only, so the count matrix stays sparse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

_STD_FLOOR = 0.05
_SUM_CHUNK = 8_192  # cells per chunk of the group sums (its float64 copy: ~0.1 GiB at 43%)


def identity(n_domains: int, n_genes: int) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.ones((n_domains, n_genes), dtype=np.float32),
        np.zeros((n_domains, n_genes), dtype=np.float32),
    )


def _mean_var(X: sp.csr_matrix) -> tuple[np.ndarray, np.ndarray]:
    mean = np.asarray(X.mean(axis=0)).ravel()
    sq = np.asarray(X.multiply(X).mean(axis=0)).ravel()
    return mean, np.maximum(sq - mean**2, 0.0)


def standardize(X: sp.csr_matrix, domain: np.ndarray, n_domains: int):
    """z-score each gene within each batch (``std`` floored at 0.05 to keep rare genes sane)."""
    scale, offset = identity(n_domains, X.shape[1])
    for d in range(n_domains):
        rows = np.flatnonzero(domain == d)
        if rows.size == 0:
            continue
        mean, var = _mean_var(X[rows])
        sd = np.maximum(np.sqrt(var), _STD_FLOOR)
        scale[d] = 1.0 / sd
        offset[d] = -mean / sd
    return scale, offset


def aligned_rows(
    X: sp.csr_matrix, domain: np.ndarray, scale: np.ndarray, offset: np.ndarray, rows
) -> np.ndarray:
    """The rows ``rows`` of ``X`` dense and aligned: ``x * scale[d] + offset[d]``.

    In place on the densified rows, with torch's threads (the same IEEE products and sums as
    NumPy's, so the same values); a scale of 1 (every method but ``"standardize"``) or an
    offset of 0 is skipped, which leaves the values as they are. Rows of one batch that follow
    each other (the usual case: inputs are concatenated batch by batch, and chunks and
    batches hold sorted rows) take their batch's row by broadcasting, without the
    ``(rows, genes)`` copy of it that an index makes (8,192 rows x 2,000 genes on 2 CPU
    threads: 21 ms against 46 ms, the densifying itself 18 ms); the values are the same.
    """
    dense = X[rows].toarray()
    dtype = np.result_type(dense, scale, offset)
    if dense.dtype != dtype:
        dense = dense.astype(dtype)
    d = np.asarray(domain[rows], dtype=np.int64)
    out = torch.from_numpy(dense)
    if not np.all(scale == 1):
        _per_batch(out, d, np.asarray(scale, dtype=dtype), torch.Tensor.mul_)
    if np.any(offset != 0):
        _per_batch(out, d, np.asarray(offset, dtype=dtype), torch.Tensor.add_)
    return dense


#: above this many runs of one batch in a block of rows, a batch's row is taken by an index
_MAX_RUNS = 16


def _per_batch(out: torch.Tensor, d: np.ndarray, by_batch: np.ndarray, op) -> None:
    """``op(out, by_batch[d])`` in place (``op``: ``Tensor.mul_`` or ``Tensor.add_``): by
    broadcasting over each run of rows of one batch, or through one index where the batches
    alternate.
    """
    if d.size == 0:
        return
    values = torch.from_numpy(by_batch)
    cut = np.flatnonzero(d[1:] != d[:-1]) + 1
    if cut.size >= _MAX_RUNS:
        op(out, values.index_select(0, torch.from_numpy(d)))
        return
    for lo, hi in zip(np.r_[0, cut], np.r_[cut, d.size], strict=True):  # runs, not cells
        op(out[lo:hi], values[d[lo]])


def group_domain_sums(
    X: sp.csr_matrix, groups: np.ndarray, n_groups: int, domain: np.ndarray, n_domains: int
) -> tuple[np.ndarray, np.ndarray]:
    """Summed expression of every (group, batch) pair and its cell count (sparse products only;
    ``groups < 0``: no group).

    Returns ``(sums (n_groups, n_domains, n_genes), counts (n_groups, n_domains))``, float64.
    """
    if not (sp.issparse(X) and X.format == "csr"):
        X = sp.csr_matrix(X)
    n_pairs, n_genes = n_groups * n_domains, X.shape[1]
    # a cell outside every group goes to a last, dropped pair
    pair = np.where(groups >= 0, groups * n_domains + domain, n_pairs).astype(np.int64)
    counts = np.bincount(pair, minlength=n_pairs + 1)[:n_pairs].astype(np.float64)
    # each stored value added to its (pair, gene) sum, in float64 and in cell order within
    # chunks of cells (the sums of a sparse indicator product, without building the indicator
    # or upcasting the whole matrix: 0.7 GiB at 100,000 cells x 2,000 genes, 43% non-zeros)
    sums = np.zeros((n_pairs + 1) * n_genes)
    indptr = X.indptr
    for start in range(0, X.shape[0], _SUM_CHUNK):
        stop = min(X.shape[0], start + _SUM_CHUNK)
        lo, hi = indptr[start], indptr[stop]
        at = np.repeat(pair[start:stop] * n_genes, np.diff(indptr[start : stop + 1]))
        at += X.indices[lo:hi]
        sums += np.bincount(at, weights=X.data[lo:hi], minlength=sums.size)
    sums = sums[: n_pairs * n_genes].reshape(n_groups, n_domains, n_genes)
    return sums, counts.reshape(n_groups, n_domains)


def group_domain_means(
    X: sp.csr_matrix, groups: np.ndarray, n_groups: int, domain: np.ndarray, n_domains: int
) -> tuple[np.ndarray, np.ndarray]:
    """Mean expression of every (group, batch) pair and its cell count (sparse products only).

    Returns ``(means (n_groups, n_domains, n_genes), counts (n_groups, n_domains))``.
    """
    sums, counts = group_domain_sums(X, groups, n_groups, domain, n_domains)
    return sums / np.maximum(counts, 1)[..., None], counts


def class_centroids(X: sp.csr_matrix, labels: np.ndarray, n_classes: int) -> np.ndarray:
    """Mean expression of each labelled class, ``(n_classes, n_genes)``; sparse products only."""
    one_batch = np.zeros(X.shape[0], dtype=np.int64)
    means, _ = group_domain_means(X, labels, n_classes, one_batch, 1)
    return means[:, 0].astype(np.float32)


def aligned_group_means(
    X: sp.csr_matrix,
    groups: np.ndarray,
    n_groups: int,
    domain: np.ndarray,
    scale: np.ndarray,
    offset: np.ndarray,
) -> np.ndarray:
    """Mean of ``x * scale[d] + offset[d]`` over the cells of each group (``groups < 0``: none).

    Computed from per-(group, batch) means of the sparse matrix, so nothing is densified.
    """
    means, counts = group_domain_means(X, groups, n_groups, domain, scale.shape[0])
    pair_mean = means * scale[None] + offset[None]  # (n_groups, n_dom, G), aligned
    w = counts * 1.0
    tot = np.maximum(w.sum(axis=1, keepdims=True), 1)
    return np.einsum("gd,gdj->gj", w / tot, pair_mean)


def profile_similarity(a: np.ndarray, b: np.ndarray, center: np.ndarray) -> np.ndarray:
    """Pearson-like similarity of expression profiles ``a (m, G)`` and ``b (k, G)``, after
    subtracting ``center`` (the mean known-type profile), so shared housekeeping expression does
    not make every pair look alike. Returns ``(m, k)`` in [-1, 1].
    """
    A = a - center
    B = b - center
    A /= np.maximum(np.linalg.norm(A, axis=1, keepdims=True), 1e-12)
    B /= np.maximum(np.linalg.norm(B, axis=1, keepdims=True), 1e-12)
    return A @ B.T


def centroid_shift(
    Xq: sp.csr_matrix,
    centroids: np.ndarray,
    n_iter: int = 3,
    frac: float = 0.5,
) -> np.ndarray:
    """Offset that moves batch ``Xq`` onto the reference class ``centroids``.

    Each query cell is matched to its most correlated centroid; a centroid keeps only the query
    cells among its ``frac * n_q / K`` most correlated ones (mutual matches), so cells of types the
    reference lacks, which match no centroid well, barely contribute. The offset is the mean of
    ``centroid - cell`` over matched pairs, averaged over classes (each class with equal weight),
    re-estimated ``n_iter`` times on the shifted data. Correlations are computed from sparse
    products: the query is never densified.
    """
    n_q, n_genes = Xq.shape
    K = centroids.shape[0]
    C = centroids.astype(np.float64)
    similarity = _centroid_similarity(Xq, C)
    m = max(1, int(np.ceil(frac * n_q / K)))
    offset = np.zeros(n_genes)
    for _ in range(n_iter):
        sim = similarity(offset)
        best = sim.argmax(axis=1)
        shifts = []
        for k in range(K):  # loop over classes, not cells
            cand = np.flatnonzero(best == k)
            if cand.size == 0:
                continue
            top = cand[np.argsort(-sim[cand, k])[:m]]
            cell_mean = np.asarray(Xq[top].mean(axis=0)).ravel()
            shifts.append(C[k] - cell_mean)
        if not shifts:
            break
        offset = np.mean(shifts, axis=0)
    return offset.astype(np.float32)


#: the per-type alignment: a query cell is matched to a known type when its similarity to the
#: type's centroid (after the batch's shift) is at least this quantile of the type's labelled
#: cells' similarity to it ...
TYPE_MATCH_QUANTILE = 0.05
#: ... and a type is shifted on its own when at least this many query cells match it
TYPE_MATCH_MIN_CELLS = 20


def compute_transform(
    method: str,
    X: sp.csr_matrix,
    labels: np.ndarray,
    domain: np.ndarray,
    n_domains: int,
    n_classes: int,
    per_type: str = "none",
    cluster_of: Any = None,
) -> tuple[np.ndarray, np.ndarray, dict, np.ndarray | None]:
    """Per-batch ``(scale, offset)`` for ``method``, plus JSON-able details for ``uns``, and
    each cell's row of them (``None``: its batch's). With ``per_type`` other than ``"none"``
    (``"centroid"`` only; ``Ablation.type_alignment``), each known type gets a row of its own
    that moves the query cells matched to it with confidence onto its centroid
    (:func:`type_groups`).
    """
    if method == "none" or n_domains == 1:
        scale, offset = identity(n_domains, X.shape[1])
        return scale, offset, {"method": method, "anchor": None}, None
    if method == "standardize":
        scale, offset = standardize(X, domain, n_domains)
        return scale, offset, {"method": method, "anchor": None}, None
    if method != "centroid":
        msg = f"Unknown alignment {method!r}."
        raise ValueError(msg)
    scale, offset = identity(n_domains, X.shape[1])
    n_lab = np.bincount(domain[labels >= 0], minlength=n_domains)
    anchor = int(n_lab.argmax())
    anchor_rows = np.flatnonzero(domain == anchor)
    centroids = class_centroids(X[anchor_rows], labels[anchor_rows], n_classes)
    norms = {}
    for d in range(n_domains):
        if d == anchor:
            continue
        rows = np.flatnonzero(domain == d)
        offset[d] = centroid_shift(X[rows], centroids)
        norms[d] = float(np.linalg.norm(offset[d]))
    info = {"method": method, "anchor": anchor, "shift_norm": norms}
    if per_type == "none":
        return scale, offset, info, None
    return type_groups(X, labels, domain, anchor, centroids, scale, offset, info, per_type,
                       cluster_of)  # fmt: skip


def _centroid_similarity(X: sp.csr_matrix, C: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """Each row's similarity to each centroid of ``C`` (float64), as a function of an offset
    added to the rows: the cosine to the centroids centred on their mean (correlation-like),
    from sparse products computed once, so the rows are never densified.
    """
    mu = C.mean(axis=0)  # centre genes on the centroids' mean: correlation-like similarity
    Cc = C - mu  # (K, G)
    Cn = Cc / np.maximum(np.linalg.norm(Cc, axis=1, keepdims=True), 1e-12)
    sq = np.asarray(X.multiply(X).sum(axis=1)).ravel()  # |x|^2 per cell
    XCn = np.asarray(X @ Cn.T)  # (n, K)

    def at(offset: np.ndarray) -> np.ndarray:
        # y = x + offset - mu; cos(y, Cn_k) = (x.Cn_k + (offset-mu).Cn_k) / |y|
        v = offset - mu
        dots = XCn + (Cn @ v)[None, :]  # (n, K)
        norms = np.sqrt(np.maximum(sq + 2 * (X @ v) + v @ v, 1e-12))
        return dots / norms[:, None]

    return at


def _cluster_types(clusters: np.ndarray, best: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """Per cell of one query batch, the known type its cluster (``clusters``) is matched to:
    the type to which most of the cluster's cells are matched with confidence (``ok`` and
    ``best``), ``-1`` where no type has half of them.
    """
    take = np.full(clusters.size, -1)
    for c in np.unique(clusters):  # loop over clusters, not cells
        members = clusters == c
        counts = np.bincount(best[members & ok], minlength=int(best.max()) + 1)
        if counts.size and counts.max() >= 0.5 * members.sum():
            take[members] = int(counts.argmax())
    return take


def type_groups(X, labels, domain, anchor, centroids, scale, offset, info, which="matched",
                cluster_of=None):  # fmt: skip
    """The per-type alignment (a study's setting, ``Ablation.type_alignment``): in each batch
    but the anchor, the cells whose best centroid is known type ``k`` with a similarity at
    least the :data:`TYPE_MATCH_QUANTILE` of ``k``'s labelled cells' own are matched to ``k``;
    where at least :data:`TYPE_MATCH_MIN_CELLS` are, they get an offset of their own that puts
    their mean on ``k``'s centroid. ``which="matched"``: the other cells keep their batch's
    shift; ``"nearest"``: every cell of the batch whose nearest centroid is ``k`` takes
    ``k``'s shift (a type is never split between two shifts); ``"cluster"``: every cell of a
    query cluster (Leiden on the batch's PCA) of which at least half the cells are matched to
    ``k`` takes ``k``'s shift, estimated on those matched cells (a cluster moves whole or not
    at all, and a cluster that matches no type stays; ``cluster_of(rows, scale, offset)``
    gives the clusters). Returns the extended
    ``(scale, offset)``, the details and each cell's row.
    """
    C = centroids.astype(np.float64)
    anchor_lab = np.flatnonzero((domain == anchor) & (labels >= 0))
    own = _centroid_similarity(X[anchor_lab], C)(np.zeros(X.shape[1]))
    y = labels[anchor_lab]
    gate = np.array([np.quantile(own[y == k, k], TYPE_MATCH_QUANTILE) if (y == k).any()
                     else np.inf for k in range(C.shape[0])])  # fmt: skip
    group = np.asarray(domain, dtype=np.int64).copy()
    scales, offsets, matched = [scale], [offset], {}
    n_rows = scale.shape[0]
    for d in range(scale.shape[0]):  # loop over batches and types, not cells
        if d == anchor:
            continue
        rows = np.flatnonzero(domain == d)
        sim = _centroid_similarity(X[rows], C)(offset[d].astype(np.float64))
        best = sim.argmax(axis=1)
        ok = sim[np.arange(rows.size), best] >= gate[best]
        take = best
        if which == "cluster":  # the batch's clusters after its shift
            take = _cluster_types(cluster_of(rows, scale, offset), best, ok)
        for k in range(C.shape[0]):
            cells = rows[ok & (best == k) & (take == k)]
            if cells.size < TYPE_MATCH_MIN_CELLS:
                continue
            shift = C[k] - np.asarray(X[cells].mean(axis=0)).ravel()
            scales.append(scale[d][None])
            offsets.append(shift.astype(np.float32)[None])
            # "nearest": every cell its nearest centroid (take is best); "cluster": its cluster's
            group[cells if which == "matched" else rows[take == k]] = n_rows
            n_rows += 1
            matched.setdefault(d, {})[int(k)] = int(cells.size)
    info = {**info, "per_type": {"cells": which, "matched": matched,
                                 "quantile": TYPE_MATCH_QUANTILE}}  # fmt: skip
    return np.concatenate(scales), np.concatenate(offsets), info, group
