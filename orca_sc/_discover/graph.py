"""The clustering every test of discovery shares: the PCA of the aligned expression, the kNN
graph, seeded Leiden, and the resolution that matches the granularity of the labelled types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from .._ablation import DiscoveryRules
from .._align import aligned_rows
from . import compute

_DEFAULTS = DiscoveryRules()
_CHUNK = 8192


def subsample_rows(n: int, seed: int, max_cells: int = _DEFAULTS.max_cells) -> np.ndarray:
    """All row indices, or a sorted random subset of ``max_cells`` of them for large data."""
    rng = np.random.default_rng(seed)
    return np.arange(n) if n <= max_cells else np.sort(rng.choice(n, max_cells, replace=False))


#: overdispersion of the Pearson residuals' negative binomial (Lause, Berens & Kobak 2021)
RESIDUAL_THETA = 100.0


@dataclass(frozen=True)
class PearsonResiduals:
    """Analytic Pearson residuals of the counts behind a log-normalised matrix (Lause, Berens &
    Kobak 2021, Genome Biology 22:258): ``(c - mu) / sqrt(mu + mu^2 / theta)`` with
    ``mu = n_c * p_gb``, ``n_c`` the cell's counts in the selected genes and ``p_gb`` the
    gene's share of its batch's counts, clipped at ``sqrt(number of cells)``.

    Log-normalising a shallow cell multiplies its single counts by the same large factor as its
    markers (``log1p(10,000 / 300)`` for one count of a cell of 300), so at droplet depth the
    PCA of log values follows sampling noise; the residuals weigh a gene's count by the noise a
    cell of that depth would show. The counts are rebuilt from the log values
    (``expm1(x) * total / target_sum``) with each cell's total counts from reading.
    """

    factor: np.ndarray  # (n,) counts per unit of expm1(x): total / target_sum
    depth: np.ndarray  # (n,) counts in the selected genes
    share: np.ndarray  # (n_batches, n_genes) each gene's share of its batch's counts
    clip: float

    @classmethod
    def fit(cls, X: sp.csr_matrix, domain: np.ndarray, totals: np.ndarray,
            target_sum: float) -> PearsonResiduals:  # fmt: skip
        """Depths and per-batch gene shares of all rows of ``X`` (chunk by chunk, sparse)."""
        factor = np.asarray(totals, dtype=np.float64) / target_sum
        n_batches = int(domain.max()) + 1 if domain.size else 0
        sums = np.zeros((n_batches, X.shape[1]))
        depth = np.zeros(X.shape[0])
        for start in range(0, X.shape[0], _CHUNK):
            rows = np.arange(start, min(X.shape[0], start + _CHUNK))
            c = _counts(X, rows, factor)
            depth[rows] = np.asarray(c.sum(axis=1)).ravel()
            for b in np.unique(domain[rows]):  # loop over batches, not cells
                sums[b] += np.asarray(c[domain[rows] == b].sum(axis=0)).ravel()
        share = sums / np.maximum(sums.sum(axis=1, keepdims=True), 1e-300)
        return cls(factor, depth, share, float(np.sqrt(X.shape[0])))

    def rows(self, X: sp.csr_matrix, domain: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The residuals of the cells ``rows``, dense (one chunk at a time)."""
        import torch

        # float64 and in place, each step in the order of (c - mu) / sqrt(mu + mu * mu / theta),
        # with torch's threads (IEEE operations: the values NumPy's would be)
        r = torch.from_numpy(_counts(X, rows, self.factor).toarray())
        at = torch.from_numpy(np.asarray(domain[rows], dtype=np.int64))
        mu = torch.from_numpy(self.share).index_select(0, at)
        mu *= torch.from_numpy(self.depth[rows])[:, None]
        sd = mu * mu
        sd /= RESIDUAL_THETA
        sd += mu
        sd.sqrt_()
        r -= mu
        r /= sd
        r.masked_fill_(sd == 0, 0.0)  # mu = 0: a gene without counts in the cell's batch
        return r.clamp_(-self.clip, self.clip).float().numpy()


def _counts(X: sp.csr_matrix, rows: np.ndarray, factor: np.ndarray) -> sp.csr_matrix:
    """The counts of ``rows`` rebuilt from log-normalised values (float64, sparse)."""
    m = sp.csr_matrix(X[rows], dtype=np.float64)
    np.expm1(m.data, out=m.data)
    m.data *= np.repeat(factor[rows], np.diff(m.indptr))
    return m


def pca_embedding(
    X: sp.csr_matrix,
    domain: np.ndarray,
    scale: np.ndarray,
    offset: np.ndarray,
    n_comps: int = 30,
    seed: int = 0,
    rows: np.ndarray | None = None,
    residuals: PearsonResiduals | None = None,
    group: np.ndarray | None = None,
) -> np.ndarray:
    """PCA of the aligned data (or of ``residuals``' Pearson residuals of the counts): fitted on
    one chunk (at most 8,192 random cells), applied chunk by chunk, so the full matrix is never
    densified. ``group``: each cell's row of ``scale`` and ``offset`` where it is not its
    batch's (the per-type alignment's groups).
    """
    from sklearn.decomposition import PCA

    code = domain if group is None else group

    def dense(r: np.ndarray) -> np.ndarray:
        if residuals is not None:
            return residuals.rows(X, domain, r)
        return aligned_rows(X, code, scale, offset, r)

    rows = np.arange(X.shape[0]) if rows is None else rows
    rng = np.random.default_rng(seed)
    fit_rows = rows if rows.size <= _CHUNK else rng.choice(rows, _CHUNK, replace=False)
    n_comps = int(min(n_comps, fit_rows.size - 1, X.shape[1] - 1))
    if compute.device() is not None:
        return _pca_torch(X, domain, scale, offset, rows, fit_rows, n_comps, residuals)
    pca = PCA(n_components=n_comps, random_state=seed)
    pca.fit(dense(fit_rows))
    out = np.empty((rows.size, n_comps), dtype=np.float32)
    for start in range(0, rows.size, _CHUNK):
        r = rows[start : start + _CHUNK]
        out[start : start + r.size] = pca.transform(dense(r))
    return out


def _pca_torch(X, domain, scale, offset, rows, fit_rows, n_comps, residuals) -> np.ndarray:
    """:func:`pca_embedding` on the device of :mod:`.compute`: the dense rows built there from
    the sparse ones, the components the top eigenvectors of their float64 covariance.
    """
    import torch

    dev = compute.device()
    with torch.no_grad():
        if residuals is None:
            scale_t = torch.as_tensor(scale, dtype=torch.float32, device=dev)
            offset_t = torch.as_tensor(offset, dtype=torch.float32, device=dev)
        else:
            share_t = torch.as_tensor(residuals.share, dtype=torch.float32, device=dev)
            depth_t = torch.as_tensor(residuals.depth, dtype=torch.float32, device=dev)

        def dense(r: np.ndarray) -> torch.Tensor:
            m = X[r] if residuals is None else _counts(X, r, residuals.factor)  # CSR
            at = (np.repeat(np.arange(m.shape[0]), np.diff(m.indptr)), m.indices)
            z = torch.zeros(m.shape, dtype=torch.float32, device=dev)
            z[tuple(torch.as_tensor(a, dtype=torch.int64, device=dev) for a in at)] = (
                torch.as_tensor(m.data, dtype=torch.float32, device=dev)
            )
            d = torch.as_tensor(domain[r], device=dev)
            if residuals is None:
                return z.mul_(scale_t[d]).add_(offset_t[d])
            # in place: two dense temporaries (mu, sd) beside the rows
            mu = share_t[d].mul_(depth_t[torch.as_tensor(r, device=dev), None])
            sd = (mu * mu).div_(RESIDUAL_THETA).add_(mu).sqrt_()
            z.sub_(mu).div_(sd).masked_fill_(sd == 0, 0.0)  # mu = 0: no counts in the batch
            return z.clamp_(-residuals.clip, residuals.clip)

        fit = dense(np.asarray(fit_rows)).double()
        mean = fit.mean(dim=0)
        fit -= mean
        _, vecs = torch.linalg.eigh(fit.T @ fit)
        comps = vecs[:, -n_comps:].flip(1).float()  # largest variance first
        mean32 = mean.float()
        del fit
        out = np.empty((rows.size, n_comps), dtype=np.float32)
        step = 4 * _CHUNK
        for start in range(0, rows.size, step):
            r = rows[start : start + step]
            out[start : start + r.size] = ((dense(r) - mean32) @ comps).cpu().numpy()
        return out


def knn_graph(emb: np.ndarray, n_neighbors: int = _DEFAULTS.n_neighbors) -> sp.csr_matrix:
    """Symmetric, unweighted kNN graph (exact neighbours, Euclidean) as a CSR adjacency matrix.

    Built with scikit-learn rather than ``sc.pp.neighbors``, whose approximate path (used from
    4,096 cells on) breaks with recent scipy and spends ~25 s compiling numba code.
    """
    n = emb.shape[0]
    k = min(n_neighbors, n - 1)
    idx = compute.kneighbors(emb, k)  # each point itself excluded
    rows = np.repeat(np.arange(n), k)
    A = sp.csr_matrix((np.ones(rows.size, dtype=np.float32), (rows, idx.ravel())), shape=(n, n))
    A = A.maximum(A.T).tocsr()
    return A


class _IgraphRandom:
    """A seeded random source for igraph's Leiden (``igraph.set_random_number_generator``), so
    that clustering is reproducible without touching Python's global ``random`` state. Draws as
    scanpy's ``flavor="igraph"`` does (a ``RandomState`` seeded with the seed).
    """

    def __init__(self, seed: int) -> None:
        self._rng = np.random.RandomState(seed)

    def getrandbits(self, k: int) -> int:
        return self._rng.tomaxint() & ((1 << k) - 1)

    def randint(self, a: int, b: int) -> int:
        return self._rng.randint(a, b + 1)

    def gauss(self, mu: float, sigma: float) -> float:
        return self._rng.normal(mu, sigma)

    def random(self) -> float:
        return self._rng.random_sample()


def leiden(
    emb: np.ndarray,
    resolution: float = 1.0,
    seed: int = 0,
    adjacency: sp.csr_matrix | None = None,
    n_neighbors: int = _DEFAULTS.n_neighbors,
) -> np.ndarray:
    """Leiden cluster codes of the rows of ``emb`` (``n_neighbors``-NN graph, modularity, 2
    iterations, seeded).

    Runs igraph's ``community_leiden`` on the graph directly (no AnnData). ``adjacency``: the
    graph of :func:`knn_graph` when already built (to cluster one set of cells at several
    resolutions).
    """
    import random

    import igraph as ig

    if emb.shape[0] < 3:
        return np.zeros(emb.shape[0], dtype=np.int64)
    A = knn_graph(emb, n_neighbors) if adjacency is None else adjacency
    src, dst = A.nonzero()
    g = ig.Graph(n=A.shape[0], edges=list(zip(src.tolist(), dst.tolist(), strict=True)))
    g.es["weight"] = np.asarray(A[src, dst]).ravel()
    ig.set_random_number_generator(_IgraphRandom(seed))
    try:
        part = g.community_leiden(
            objective_function="modularity",
            weights="weight",
            resolution=resolution,
            n_iterations=2,
        )
    finally:
        ig.set_random_number_generator(random)
    return np.asarray(part.membership, dtype=np.int64)


def calibrate_resolution(
    labels: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    seed: int = 0,
    cfg: DiscoveryRules = _DEFAULTS,
) -> tuple[float, list[float]]:
    """The Leiden resolution at which clusters match the granularity of the given annotation.

    What counts as one cell type is the annotator's choice: one atlas splits neurons into many
    types, another keeps broad classes made of distinct sub-populations. The labelled cells show
    which: they (at most ``cfg.calibration_cells``, at random) are clustered at each resolution
    of ``cfg.resolution_grid``
    (Leiden on the PCA of their own expression, ``pca_of(idx)``, one kNN graph) and the
    resolution whose clusters agree best with their labels (adjusted Rand index; ties go to the
    coarser) is returned, with the scores. Candidate novel clusters are then cut at the same
    granularity as the known types. ``labels``: class codes, ``-1`` for unlabelled cells.
    With fewer than two labelled classes, returns ``cfg.fallback_resolution`` and no scores.
    """
    from sklearn.metrics import adjusted_rand_score

    idx = np.flatnonzero(labels >= 0)
    grid = cfg.resolution_grid
    if np.unique(labels[idx]).size < 2 or idx.size < 3:
        return float(cfg.fallback_resolution), []
    if idx.size > cfg.calibration_cells:
        rng = np.random.default_rng(seed)
        idx = np.sort(rng.choice(idx, cfg.calibration_cells, replace=False))
    emb = pca_of(idx)
    graph = knn_graph(emb, cfg.n_neighbors)
    scores = [
        float(adjusted_rand_score(labels[idx], leiden(emb, r, seed, adjacency=graph))) for r in grid
    ]
    return float(grid[int(np.argmax(scores))]), scores


def resolve_resolution(
    labels: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    seed: int = 0,
    calibrate: bool = True,
    cfg: DiscoveryRules = _DEFAULTS,
) -> tuple[float, list[float]]:
    """The Leiden resolution to use for ``cfg.resolution``, with its calibration scores: a number
    is used as given; ``"auto"`` is :func:`calibrate_resolution` on ``labels``, or
    ``cfg.fallback_resolution`` when ``calibrate`` is False (nothing to calibrate against).
    """
    if cfg.resolution != "auto":
        return float(cfg.resolution), []
    if not calibrate:
        return float(cfg.fallback_resolution), []
    return calibrate_resolution(labels, pca_of, seed=seed, cfg=cfg)


def pca_input_verdict(right_log: np.ndarray, right_pearson: np.ndarray, alpha: float) -> dict:
    """The rule that picks what discovery's PCA reads (``pca_input="auto"``), from which
    labelled cells the majority of their nearest labelled neighbours names right in the log
    values (``right_log``) and in the Pearson residuals (``right_pearson``): the residuals where
    they name more cells right and a one-sided exact McNemar test on the cells the two disagree
    on rejects "no better" at ``alpha``, else the log values. Returns the verdict and its figures.
    """
    from scipy.stats import binom

    log_only = int((right_log & ~right_pearson).sum())
    res_only = int((right_pearson & ~right_log).sum())
    p = float(binom.sf(res_only - 1, log_only + res_only, 0.5)) if res_only > log_only else 1.0
    return {
        "pca_input": "pearson" if p < alpha else "log",
        "knn_accuracy_log": float(right_log.mean()),
        "knn_accuracy_pearson": float(right_pearson.mean()),
        "right_only_log": log_only,
        "right_only_pearson": res_only,
        "p_value": p,
        "n_cells": int(right_log.size),
    }


def reference_resolution(
    labels: np.ndarray,
    rows: np.ndarray,
    n_cells: int,
    pca_of: Callable[[np.ndarray], np.ndarray],
    grid: tuple[float, ...],
    *,
    seed: int = 0,
    n_neighbors: int = _DEFAULTS.n_neighbors,
    fallback: float = 1.0,
) -> tuple[float, dict[str, float]]:
    """The resolution at which a batch of ``n_cells`` cells is cut, checked on the labelled
    cells ``rows``: a random ``n_cells`` of them (all, if fewer) are clustered on their own PCA
    (``pca_of``) as a query batch of that size is, at each resolution of ``grid``; a labelled
    type of at least ``n_neighbors`` cells there is *whole* when one cluster holds at least
    half of its cells. The finest resolution at which every such type is whole is returned: a
    finer cut breaks a type the labels say is one, as it would break a known type of the query
    into pieces; at it, a small type as distinct from its neighbours as the labelled types
    still gets a cluster. With fewer than two such types, ``fallback``. Returns the resolution
    and the share of the types whole at each resolution of the grid.
    """
    if rows.size > n_cells:
        rng = np.random.default_rng([seed, 0x6A1, n_cells])
        rows = np.sort(rng.choice(rows, n_cells, replace=False))
    y = labels[rows]
    types, counts = np.unique(y, return_counts=True)
    types = types[counts >= n_neighbors]
    if types.size < 2 or rows.size <= 2 * n_neighbors:
        return float(fallback), {}
    emb = pca_of(rows)
    adjacency = knn_graph(emb, n_neighbors)
    best, whole = None, {}
    for r in sorted(grid):  # loop over resolutions
        codes = leiden(emb, r, seed, adjacency=adjacency, n_neighbors=n_neighbors)
        held = [np.bincount(codes[y == t]).max() >= 0.5 * (y == t).sum() for t in types]
        whole[f"{r:g}"] = float(np.mean(held))
        if all(held):
            best = r
    return float(min(grid) if best is None else best), whole
