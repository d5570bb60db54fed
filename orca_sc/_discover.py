"""The ``discover`` stage: candidate novel clusters, the number of novel types, and which novel
clusters are known types after all. Every rule that decides these lives here, and every knob is
a field of :class:`orca_sc.DiscoveryConfig`. Arrays in, a frozen :class:`Discovery` out: no
AnnData, no torch.

After the supervised warm-up, :func:`discover` takes each cell's embedding and cosine to the seen
heads and finds the candidates:

* :func:`ood_clusters`: unlabelled cells whose best cosine to a seen head is below the
  ``ood_quantile`` of the labelled cells', plus, in batches labelled at random, cells with
  improbably few labelled neighbours (:func:`label_deserts`), clustered with Leiden at the
  resolution that matches the granularity of the labelled types (:func:`calibrate_resolution`);
* :func:`query_ood_clusters`: in batches without labelled cells (a separate query), clusters of
  the whole batch, voted by their share of out-of-distribution cells.

Candidates of at least :func:`min_cluster_size` cells start the novel heads; their number is the
estimate of ``n_novel``. After training, :func:`match_known_types` reports novel clusters that are
a known type of another batch as that type. Without a warm-up, :func:`estimate_n_novel` counts
Leiden clusters of all cells that lack labels.

Leiden runs directly on igraph (exact kNN graph from scikit-learn), on at most
``DiscoveryConfig.max_cells`` cells.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp

from ._align import aligned_rows, group_domain_means
from ._config import DiscoveryConfig

_DEFAULTS = DiscoveryConfig()
#: below this many unlabelled cells, discover notes that small novel types go undetected
_SMALL_QUERY = 500
#: below this median of labelled cells per seen class, discover notes that known types may be
#: called novel (the suite's few-label corners: 17-25 cells per type failed, ~70 did not)
_FEW_LABELS = 50
_CHUNK = 8192


def subsample_rows(n: int, seed: int, max_cells: int = _DEFAULTS.max_cells) -> np.ndarray:
    """All row indices, or a sorted random subset of ``max_cells`` of them for large data."""
    rng = np.random.default_rng(seed)
    return np.arange(n) if n <= max_cells else np.sort(rng.choice(n, max_cells, replace=False))


def pca_embedding(
    X: sp.csr_matrix,
    domain: np.ndarray,
    scale: np.ndarray,
    offset: np.ndarray,
    n_comps: int = 30,
    seed: int = 0,
    rows: np.ndarray | None = None,
) -> np.ndarray:
    """PCA of the aligned data: fitted on one chunk (at most 8,192 random cells), applied chunk by
    chunk, so the full matrix is never densified.
    """
    from sklearn.decomposition import PCA

    rows = np.arange(X.shape[0]) if rows is None else rows
    rng = np.random.default_rng(seed)
    fit_rows = rows if rows.size <= _CHUNK else rng.choice(rows, _CHUNK, replace=False)
    n_comps = int(min(n_comps, fit_rows.size - 1, X.shape[1] - 1))
    pca = PCA(n_components=n_comps, random_state=seed)
    pca.fit(aligned_rows(X, domain, scale, offset, fit_rows))
    out = np.empty((rows.size, n_comps), dtype=np.float32)
    for start in range(0, rows.size, _CHUNK):
        r = rows[start : start + _CHUNK]
        out[start : start + r.size] = pca.transform(aligned_rows(X, domain, scale, offset, r))
    return out


def knn_graph(emb: np.ndarray, n_neighbors: int = _DEFAULTS.n_neighbors) -> sp.csr_matrix:
    """Symmetric, unweighted kNN graph (exact neighbours, Euclidean) as a CSR adjacency matrix.

    Built with scikit-learn rather than ``sc.pp.neighbors``, whose approximate path (used from
    4,096 cells on) breaks with recent scipy and spends ~25 s compiling numba code.
    """
    from sklearn.neighbors import NearestNeighbors

    n = emb.shape[0]
    k = min(n_neighbors, n - 1)
    # kneighbors() without X excludes each point itself
    idx = NearestNeighbors(n_neighbors=k).fit(emb).kneighbors(return_distance=False)
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
    cfg: DiscoveryConfig = _DEFAULTS,
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
    cfg: DiscoveryConfig = _DEFAULTS,
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


def min_cluster_size(n_unlabeled: int, cfg: DiscoveryConfig = _DEFAULTS) -> int:
    """Smallest candidate novel cluster: ``cfg.min_cluster_cells`` cells or
    ``cfg.min_cluster_fraction`` of the unlabelled cells.
    """
    return max(cfg.min_cluster_cells, int(np.ceil(cfg.min_cluster_fraction * n_unlabeled)))


def labelled_neighbours(
    labeled: np.ndarray,
    domain: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    n_neighbors: int = _DEFAULTS.n_neighbors,
) -> tuple[np.ndarray, np.ndarray]:
    """Labelled fraction of every cell's ``n_neighbors`` nearest neighbours (itself excluded),
    found within each batch that has labelled cells, in the PCA of that batch's cells
    (``pca_of(idx)``). Returns ``(fraction, tested)``; cells of batches without labels are not
    tested (fraction 0).
    """
    from sklearn.neighbors import NearestNeighbors

    frac = np.zeros(labeled.shape[0])
    tested = np.zeros(labeled.shape[0], dtype=bool)
    for d in np.unique(domain[labeled]):  # loop over batches, not cells
        idx = np.flatnonzero(domain == d)
        if idx.size <= n_neighbors:
            continue
        nn = NearestNeighbors(n_neighbors=n_neighbors).fit(pca_of(idx))
        frac[idx] = labeled[idx][nn.kneighbors(return_distance=False)].mean(axis=1)
        tested[idx] = True
    return frac, tested


def cluster_cores(
    assign: np.ndarray,
    feats: np.ndarray,
    *,
    n_neighbors: int = _DEFAULTS.n_neighbors,
    min_agree: float = _DEFAULTS.core_min_agree,
    min_core: float = _DEFAULTS.core_min_fraction,
) -> np.ndarray:
    """Cells at the core of a coherent candidate cluster.

    A cell is at the core of its cluster (``assign >= 0``; ``-1``: no cluster) when at least
    ``min_agree`` of its ``n_neighbors`` nearest neighbours (itself excluded) among all cells
    (``feats``, e.g. PCA coordinates) are in the same cluster. A cluster that is a whole novel
    type is nearly all core; a cluster that swept up poorly scored cells of several known types
    (their neighbours are mostly cells of their own, non-candidate type) is not coherent: when
    less than ``min_core`` of its cells are core, none of them is kept. Returns a boolean mask.
    """
    from sklearn.neighbors import NearestNeighbors

    core = np.zeros(assign.shape[0], dtype=bool)
    cand = np.flatnonzero(assign >= 0)
    if cand.size == 0 or assign.shape[0] <= n_neighbors:
        return core
    nn = NearestNeighbors(n_neighbors=n_neighbors + 1).fit(feats)
    idx = nn.kneighbors(feats[cand], return_distance=False)[:, 1:]  # drop the cell itself
    agree = (assign[idx] == assign[cand, None]).mean(axis=1)
    core[cand] = agree >= min_agree
    n = np.bincount(assign[cand])
    frac = np.bincount(assign[cand], weights=core[cand]) / np.maximum(n, 1)
    return core & (assign >= 0) & (frac[np.maximum(assign, 0)] >= min_core)


def labelled_support(
    labeled: np.ndarray,
    domain: np.ndarray,
    frac: np.ndarray,
    tested: np.ndarray,
    *,
    n_neighbors: int = _DEFAULTS.n_neighbors,
    min_fraction: float = _DEFAULTS.support_fraction,
    min_count: int = _DEFAULTS.support_min,
) -> np.ndarray:
    """Unlabelled cells that sit among labelled cells, so are not of a novel type.

    In a batch where cells were labelled at random, a cell of a known type has about a fraction
    ``f`` of labelled cells among its nearest neighbours (``frac``, from
    :func:`labelled_neighbours`), while a cell of a type nobody labelled has few or none. ``f`` is
    measured around the batch's labelled cells (their neighbours are cells of their own type). An
    unlabelled cell with at least ``min_fraction`` of that fraction (and at least ``min_count``
    labelled neighbours of ``n_neighbors``) is
    supported by labels: the seen heads may score it poorly (a small class fitted to its few
    labelled cells) or a wrong seen head may have absorbed it, but it is no novel type. Untested
    cells (batches without labels) are never supported. Returns a boolean mask.
    """
    supported = np.zeros(labeled.shape[0], dtype=bool)
    for idx, expected in _tested_batches(labeled, domain, frac, tested):
        floor = max(min_count / n_neighbors, min_fraction * expected)
        supported[idx] = ~labeled[idx] & (frac[idx] >= floor)
    return supported


def _tested_batches(labeled, domain, frac, tested):
    """For each batch with tested cells (:func:`labelled_neighbours`): its tested cells and the
    labelled fraction ``f`` expected around a cell of a known type, measured around its labelled
    cells.
    """
    for d in np.unique(domain[tested]):  # loop over batches, not cells
        idx = np.flatnonzero((domain == d) & tested)
        yield idx, frac[idx][labeled[idx]].mean()


def label_deserts(
    labeled: np.ndarray,
    domain: np.ndarray,
    frac: np.ndarray,
    tested: np.ndarray,
    *,
    n_neighbors: int = _DEFAULTS.n_neighbors,
    alpha: float = _DEFAULTS.desert_alpha,
) -> np.ndarray:
    """Unlabelled cells whose neighbourhood lacks labels: improbably few labelled neighbours.

    The counterpart of :func:`labelled_support`. In a batch where cells were labelled at random,
    a cell of a known type has about a fraction ``f`` of labelled cells among its
    ``n_neighbors`` nearest neighbours (``frac``, from :func:`labelled_neighbours`; ``f`` is
    measured around the batch's labelled cells). A cell with so few that a binomial draw at ``f``
    gives as few with probability below ``alpha`` (0 or 1 of 15 at ``f`` = 0.4) sits among cells
    nobody labelled: a type without labels, even when a seen head scores it confidently. Untested
    cells (batches without labels) are never deserts. Returns a boolean mask.
    """
    from scipy.stats import binom

    desert = np.zeros(labeled.shape[0], dtype=bool)
    for idx, expected in _tested_batches(labeled, domain, frac, tested):
        count = np.rint(frac[idx] * n_neighbors)
        desert[idx] = ~labeled[idx] & (binom.cdf(count, n_neighbors, expected) < alpha)
    return desert


def segregated_batches(
    labeled: np.ndarray,
    domain: np.ndarray,
    supported: np.ndarray,
    tested: np.ndarray,
    *,
    min_supported: float = _DEFAULTS.segregated_support,
) -> list[int]:
    """Batches whose labelled and unlabelled cells are two populations, not a random draw.

    :func:`labelled_support` and :func:`label_deserts` assume that a batch's labelled cells were
    drawn from its cells at random, so that unlabelled cells of known types sit among labelled
    ones. When under ``min_supported`` of a tested batch's unlabelled cells do, the labels were
    not given at random (typically a reference and a query concatenated into one batch): every
    unlabelled cell looks like a desert. Returns the codes of those batches.
    """
    out = []
    for d in np.unique(domain[tested]):  # loop over batches, not cells
        u = tested & (domain == d) & ~labeled
        if u.any() and supported[u].mean() < min_supported:
            out.append(int(d))
    return out


def ood_clusters(
    maxcos: np.ndarray,
    labeled: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    quantile: float = _DEFAULTS.ood_quantile,
    resolution: float = 1.0,
    min_size: int = _DEFAULTS.min_cluster_cells,
    seed: int = 0,
    exclude: np.ndarray | None = None,
    include: np.ndarray | None = None,
    threshold: float | None = None,
    n_neighbors: int = _DEFAULTS.n_neighbors,
) -> tuple[np.ndarray, list[int], float]:
    """Candidate novel clusters from the cells the seen heads do not explain.

    An unlabelled cell is out-of-distribution when its highest cosine similarity to a seen-class
    head is below ``threshold`` (default: the ``quantile`` of that similarity over labelled
    cells; see :func:`ood_threshold`); cells in ``include``
    (e.g. :func:`label_deserts`) are treated as OOD however well they are scored. The OOD cells
    are clustered (Leiden on the PCA of their own expression, ``pca_of(idx)``); clusters of at
    least ``min_size`` cells are the candidates; cells in ``exclude`` (e.g.
    :func:`labelled_support`) never are. Returns ``(assign, sizes, threshold)`` with
    ``assign[i]`` the candidate index of cell ``i`` (``-1`` outside candidates), largest first.
    """
    tau = float(np.quantile(maxcos[labeled], quantile)) if threshold is None else threshold
    ood = ~labeled & (maxcos < tau)
    if include is not None:
        ood |= include & ~labeled
    if exclude is not None:
        ood &= ~exclude
    ood = np.flatnonzero(ood)
    assign = np.full(maxcos.shape[0], -1, dtype=np.int64)
    if ood.size < min_size:
        return assign, [], tau
    codes = leiden(pca_of(ood), resolution, seed, n_neighbors=n_neighbors)
    counts = np.bincount(codes)
    keep = [c for c in np.argsort(-counts, kind="stable") if counts[c] >= min_size]
    for rank, c in enumerate(keep):
        assign[ood[codes == c]] = rank
    return assign, [int(counts[c]) for c in keep], tau


def novel_clusters(
    emb: np.ndarray,
    labeled: np.ndarray,
    *,
    resolution: float = 1.0,
    rel_threshold: float = _DEFAULTS.no_warmup_rel_threshold,
    min_size: int | None = None,
    seed: int = 0,
    n_neighbors: int = _DEFAULTS.n_neighbors,
) -> list[int]:
    """Sizes (unlabelled cells, largest first) of the Leiden clusters of ``emb`` that look like
    novel types: at least ``min_size`` unlabelled cells and a labelled fraction below
    ``rel_threshold`` times the overall one.
    """
    clusters = leiden(emb, resolution, seed, n_neighbors=n_neighbors)
    if min_size is None:
        min_size = min_cluster_size(int((~labeled).sum()))
    frac_all = labeled.mean()
    found = []
    for c in np.unique(clusters):  # loop over clusters, not cells
        in_c = clusters == c
        n_c_unl = int((in_c & ~labeled).sum())
        if n_c_unl >= min_size and labeled[in_c].mean() < rel_threshold * frac_all:
            found.append(n_c_unl)
    return sorted(found, reverse=True)


def estimate_n_novel(
    labels: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    seed: int = 0,
    cfg: DiscoveryConfig = _DEFAULTS,
) -> dict:
    """Estimate the number of novel types without a warm-up: :func:`novel_clusters` of the PCA
    of all the given cells (``pca_of(idx)``) at the resolution of ``cfg``.
    """
    labeled = labels >= 0
    resolution, _ = resolve_resolution(labels, pca_of, seed=seed, cfg=cfg)
    sizes = novel_clusters(
        pca_of(np.arange(labels.size)),
        labeled,
        resolution=resolution,
        rel_threshold=cfg.no_warmup_rel_threshold,
        min_size=min_cluster_size(int((~labeled).sum()), cfg),
        seed=seed,
        n_neighbors=cfg.n_neighbors,
    )
    return {"n_novel": len(sizes), "cluster_sizes": sizes, "space": "pca"}


def query_ood_clusters(
    ood: np.ndarray,
    cells: np.ndarray,
    domain: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    min_size: int,
    min_fraction: float = _DEFAULTS.query_min_fraction,
    min_enrichment: float = _DEFAULTS.query_min_enrichment,
    resolution: float = _DEFAULTS.query_resolution,
    seed: int = 0,
    n_neighbors: int = _DEFAULTS.n_neighbors,
) -> list[np.ndarray]:
    """Candidate novel clusters of batches without labelled cells, decided per cluster.

    In a query batch, expression shifted by the batch makes some cells of known types score
    poorly on the seen heads, while the seen heads absorb many cells of a novel type (a classifier
    of two types scores a third confidently). Cell by cell, out-of-distribution calls (``ood``)
    are noisy both ways; a cluster of the batch's cells takes a vote. All ``cells`` of each query
    batch are clustered (Leiden on the PCA of that batch's cells, ``pca_of(idx)``), which keeps
    types apart better than clustering only the out-of-distribution cells; a cluster of at least
    ``min_size`` cells is a candidate when at least ``min_fraction`` of its cells are
    out-of-distribution, or ``min_enrichment`` times the batch's overall fraction. Returns the
    index arrays of the candidates' cells.
    """
    found: list[np.ndarray] = []
    for d in np.unique(domain[cells]):  # loop over batches, not cells
        idx = cells[domain[cells] == d]
        if idx.size < min_size:
            continue
        codes = leiden(pca_of(idx), resolution, seed, n_neighbors=n_neighbors)
        overall = ood[idx].mean()
        for c in np.unique(codes):
            m = idx[codes == c]
            frac = ood[m].mean()
            if m.size >= min_size and (frac >= min_fraction or frac >= min_enrichment * overall):
                found.append(m)
    return found


# ------------------------------------------------------------------------------------------
# the stage
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Discovery:
    """What the ``discover`` stage found, over the cells it was given (indices into them).

    ``assign``: candidate novel cluster of each cell (``-1``: none), largest first; ``sizes``:
    cells per candidate; ``n_novel``: the estimated number of novel types (the number of
    candidates); ``prototypes``: initial weights ``(n_heads, D)`` of the novel heads (candidate
    means in the warmed-up embedding; random for heads beyond the candidates); ``prior``: the
    regulariser's target over seen + novel heads (``None``: uniform); ``anchor_cells`` and
    ``anchor_heads``: the core cells of coherent candidates and the head (``n_seen + j``) each is
    anchored to; ``threshold``: the out-of-distribution threshold of the best seen-head cosine
    (``None`` without a warm-up); ``notes``: where the data cannot support a call, for the user;
    ``diagnostics``: JSON-able figures for ``uns`` (see :func:`discover`).
    """

    assign: np.ndarray
    sizes: tuple[int, ...]
    n_novel: int
    prototypes: np.ndarray
    prior: np.ndarray | None
    anchor_cells: np.ndarray
    anchor_heads: np.ndarray
    diagnostics: dict[str, Any] = field(default_factory=dict)
    threshold: float | None = None
    notes: tuple[str, ...] = ()

    @property
    def n_heads(self) -> int:
        return int(self.prototypes.shape[0])

    def record(self) -> dict[str, Any]:
        """What ``uns['orca']['estimate']`` holds: the diagnostics, the threshold and the notes."""
        if self.threshold is None:  # no warm-up: no threshold, no notes
            return dict(self.diagnostics)
        return {**self.diagnostics, "threshold": self.threshold, "notes": list(self.notes)}


def calibration_split(
    labels: np.ndarray,
    fraction: float = _DEFAULTS.calibration_fraction,
    max_cells: int = _DEFAULTS.calibration_max_cells,
    seed: int = 0,
) -> np.ndarray:
    """Labelled cells held out of the warm-up to calibrate the out-of-distribution threshold
    (split conformal): ``fraction`` of each class's labelled cells, rounded, at most
    ``max_cells`` in all, and never a class's last training cell. Returns a boolean mask.
    """
    n_lab = int((labels >= 0).sum())
    frac = min(fraction, max_cells / max(n_lab, 1))
    if frac <= 0:
        return np.zeros(labels.shape[0], dtype=bool)
    return _hold_out_per_class(labels, frac, np.random.default_rng(seed))


def _hold_out_per_class(labels: np.ndarray, frac: float, rng: np.random.Generator) -> np.ndarray:
    """``frac`` of each class's labelled cells (rounded), drawn with ``rng``, never a class's last
    cell (``labels < 0``: no class). Returns a boolean mask.
    """
    held = np.zeros(labels.shape[0], dtype=bool)
    for k in np.unique(labels[labels >= 0]):  # loop over classes, not cells
        idx = np.flatnonzero(labels == k)
        n = min(int(round(frac * idx.size)), idx.size - 1)
        if n > 0:
            held[rng.choice(idx, n, replace=False)] = True
    return held


def ood_threshold(
    maxcos: np.ndarray, train: np.ndarray, calibration: np.ndarray, cfg: DiscoveryConfig
) -> tuple[float, dict[str, float]]:
    """The out-of-distribution threshold on the best cosine to a seen head: the
    ``cfg.ood_quantile`` of the labelled cells the warm-up trained on (``train``), capped at the
    ``cfg.ood_max_rate`` quantile of labelled cells held out of it (``calibration``), so that a
    known-type cell the net has not seen is called out-of-distribution at most that often.
    Returns the threshold and both candidates.
    """
    tau_train = float(np.quantile(maxcos[train], cfg.ood_quantile))
    if not calibration.any():
        return tau_train, {"threshold_in_sample": tau_train}
    tau_cal = float(np.quantile(maxcos[calibration], cfg.ood_max_rate))
    return min(tau_train, tau_cal), {
        "threshold_in_sample": tau_train,
        "threshold_held_out": tau_cal,
    }


def probe_threshold(
    maxcos: np.ndarray, train: np.ndarray, held: np.ndarray, cfg: DiscoveryConfig
) -> float:
    """Cross-fitted calibration (``cfg.calibration_probe``): the calibrated threshold
    (:func:`ood_threshold`) of a probe warm-up that did not see the ``held`` labelled cells,
    which caps the threshold of the main warm-up (trained on every label; the two are trained
    alike, so their cosines are on one scale). Carrying over a quantile level instead does not
    work: on few labels the held-out cells' ``ood_max_rate`` quantile lies below every training
    cell's cosine (level 0 on the development suite's 200-cell references), so no in-sample
    quantile can express it.
    """
    tau, _ = ood_threshold(maxcos, train, held, cfg)
    return tau


@dataclass(frozen=True)
class SelfCheckSplit:
    """The run-time self-check's data (:func:`self_check_split`): known types of the reference
    hidden as if novel, and labelled cells of the other types held out as known-type queries.
    """

    held_types: np.ndarray  # class codes treated as novel
    novel: np.ndarray  # (n,) bool: labelled cells of the held-out types
    known: np.ndarray  # (n,) bool: labelled cells of the other types, held out
    labels: np.ndarray  # (n,) the probe's labels: other types recoded 0..k-1, -1 unlabelled
    domain: np.ndarray  # (n,) the probe's batches

    def subset(self, rows: np.ndarray) -> SelfCheckSplit:
        """The split restricted to the cells ``rows``."""
        return SelfCheckSplit(
            self.held_types, self.novel[rows], self.known[rows], self.labels[rows],
            self.domain[rows],
        )  # fmt: skip


def self_check_split(
    labels: np.ndarray,
    domain: np.ndarray,
    *,
    type_fraction: float = _DEFAULTS.self_check_types,
    known_fraction: float = _DEFAULTS.self_check_known,
    min_cells: int = _DEFAULTS.n_neighbors,
    seed: int = 0,
) -> SelfCheckSplit | None:
    """Hide ``type_fraction`` of the known types (at least one; at least two stay known) and
    ``known_fraction`` of every other type's labelled cells (never its last one), as in DTC's
    probe classes (Han et al., ICCV 2019). Only types with at least ``min_cells`` labelled cells
    are hidden: a smaller group rarely forms a cluster of its own (the neighbours of the
    clustering graph), so missing it would say nothing about the rules. Where the real unlabelled
    cells are mostly in batches without labels (a separate query), the hidden cells form a batch
    of their own, so that the probe goes through the same rules as the query; otherwise they stay
    in their batches. Returns ``None`` when no type can be hidden (fewer than three known types,
    or none with ``min_cells`` cells).
    """
    classes, counts = np.unique(labels[labels >= 0], return_counts=True)
    eligible = classes[counts >= min_cells]
    if classes.size < 3 or eligible.size == 0:
        return None
    rng = np.random.default_rng(seed)
    n_held = int(
        np.clip(round(type_fraction * classes.size), 1, min(eligible.size, classes.size - 2))
    )
    held_types = np.sort(rng.choice(eligible, n_held, replace=False))
    novel = np.isin(labels, held_types)
    known = _hold_out_per_class(np.where(novel, -1, labels), known_fraction, rng)
    keep = np.setdiff1d(classes, held_types)
    recode = np.full(int(classes.max()) + 1, -1)
    recode[keep] = np.arange(keep.size)
    probe_labels = np.where((labels >= 0) & ~novel & ~known, recode[np.maximum(labels, 0)], -1)
    unl = labels < 0
    labelled_batches = np.unique(domain[labels >= 0])
    query_like = unl.any() and np.mean(~np.isin(domain[unl], labelled_batches)) > 0.5
    probe_domain = np.where(novel | known, domain.max() + 1, domain) if query_like else domain
    return SelfCheckSplit(held_types, novel, known, probe_labels, probe_domain)


def youden_threshold(novel_score: np.ndarray, known_score: np.ndarray) -> tuple[float, float]:
    """The cut ``t`` on a score (cells below ``t`` are called novel) that best tells the two
    groups apart: the maximum over ``t`` of Youden's J = (share of ``novel_score`` below ``t``)
    - (share of ``known_score`` below ``t``). Returns ``(t, J)``; ``t`` is midway between the
    two scores at the cut.
    """
    scores = np.concatenate([novel_score, known_score])
    is_novel = np.concatenate([np.ones(novel_score.size), np.zeros(known_score.size)])
    order = np.argsort(scores, kind="stable")
    s, y = scores[order], is_novel[order]
    j = np.cumsum(y) / max(novel_score.size, 1) - np.cumsum(1 - y) / max(known_score.size, 1)
    last = np.r_[s[1:] != s[:-1], True]  # only cut between distinct scores
    j = np.where(last, j, -np.inf)
    i = int(np.argmax(j))
    t = (s[i] + s[i + 1]) / 2 if i + 1 < s.size else s[i] + 1e-6
    return float(t), float(max(j[i], 0.0))


def self_check_report(
    assign: np.ndarray,
    maxcos: np.ndarray,
    threshold: float,
    labels: np.ndarray,
    split: SelfCheckSplit,
    classes: list[str],
    cfg: DiscoveryConfig = _DEFAULTS,
) -> dict[str, Any]:
    """How the discover rules did on the self-check (:func:`self_check_split`): ``assign`` is
    the probe's candidate cluster per cell (-1 none), ``maxcos`` its cells' best cosine to a
    seen head and ``threshold`` its out-of-distribution threshold; ``labels`` the true codes.

    Reports the share of hidden-type cells in candidate clusters (``novel_called``), the share
    of held-out known-type cells there (``known_called_novel``), the clustering accuracy of the
    hidden types (Hungarian, cells outside candidates wrong), the candidate clusters made mostly
    of hidden-type cells (among the hidden and held-out cells in them) against the number of
    hidden types (granularity), and the Youden cut
    of the probe's cosine (:func:`youden_threshold`) beside the threshold the rules used.
    """
    from scipy.optimize import linear_sum_assignment

    cand = assign >= 0
    nov, kno = split.novel, split.known
    held = split.held_types
    # hidden type x candidate cluster, over the hidden-type cells
    n_c = int(assign.max()) + 1 if cand.any() else 0
    t_idx = np.searchsorted(held, labels[nov & cand])
    table = np.zeros((held.size, max(n_c, 1)), dtype=np.int64)
    np.add.at(table, (t_idx, assign[nov & cand]), 1)
    r, c = linear_sum_assignment(-table)
    acc = table[r, c].sum() / max(int(nov.sum()), 1)
    # clusters made mostly of hidden-type cells, among their cells whose type is known here
    # (the probe's cells; in one batch the unlabelled cells of a hidden type join its cluster)
    probe = cand & (nov | kno)
    per_cluster = np.bincount(assign[probe], minlength=n_c)
    hidden_in = table.sum(axis=0)[:n_c] if n_c else np.zeros(0)
    n_found = int(np.sum(hidden_in > per_cluster / 2)) if n_c else 0
    t_j, j = youden_threshold(maxcos[nov], maxcos[kno])
    report = {
        "hidden_types": [classes[k] for k in held],
        "n_hidden_cells": int(nov.sum()),
        "n_known_cells": int(kno.sum()),
        "novel_called": float(cand[nov].mean()) if nov.any() else float("nan"),
        "known_called_novel": float(cand[kno].mean()) if kno.any() else float("nan"),
        "hidden_accuracy": float(acc),
        "hidden_clusters_found": n_found,
        "hidden_types_true": int(held.size),
        "threshold": float(threshold),
        "novel_below_threshold": float(np.mean(maxcos[nov] < threshold)),
        "known_below_threshold": float(np.mean(maxcos[kno] < threshold)) if kno.any() else 0.0,
        "youden_threshold": t_j,
        "youden_j": j,
    }
    hidden = ", ".join(report["hidden_types"])
    notes = []
    if kno.sum() >= 1 / cfg.ood_max_rate and report["known_called_novel"] > cfg.ood_max_rate:
        notes.append(
            f"Self-check: with {hidden} hidden, the discover rules put "
            f"{report['known_called_novel']:.0%} of held-out known-type cells into novel "
            "clusters; expect a similar share of this query's known-type cells in novel "
            "clusters (see uns['orca']['self_check'])."
        )
    if nov.any() and report["novel_called"] < 0.5:
        notes.append(
            f"Self-check: the discover rules called only {report['novel_called']:.0%} of the "
            f"cells of the hidden known types ({hidden}) novel; novel types as close to the "
            "known ones as these may be absorbed by known types."
        )
    report["notes"] = notes
    return report


def discover(
    embedding: np.ndarray,
    seen_similarity: np.ndarray,
    labels: np.ndarray,
    domain: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    calibration: np.ndarray | None = None,
    ood_cap: float | None = None,
    n_novel: int | str = "auto",
    cfg: DiscoveryConfig = _DEFAULTS,
    seed: int = 0,
    domain_names: list[str] | None = None,
) -> Discovery:
    """Candidate novel clusters after the warm-up, and the novel heads they start: clusters of
    unlabelled cells the seen heads do not explain (:func:`ood_clusters`; in batches without
    labelled cells :func:`query_ood_clusters`); with ``n_novel="auto"`` one head per candidate.

    ``embedding`` ``(n, D)``: the warmed-up embedding; ``seen_similarity`` ``(n, n_seen)``: the
    cosine to each seen head; ``labels`` (``-1`` unlabelled); ``domain``: batch codes;
    ``pca_of(idx)``: the PCA of the aligned expression of the cells ``idx``; ``calibration``:
    labelled cells the warm-up did not train on (:func:`calibration_split`) and ``ood_cap``: a
    probe's threshold (:func:`probe_threshold`), which cap the threshold (:func:`ood_threshold`).
    """
    pca_cells = _once_per_cell_set(pca_of)
    lab = labels >= 0
    maxcos = seen_similarity.max(axis=1)
    ev = _label_evidence(lab, domain, pca_cells, cfg, domain_names)
    # batches without any labelled cell (a separate query): candidates are voted per cluster
    query = ~np.isin(domain, np.unique(domain[lab]))
    min_size = min_cluster_size(int((~lab).sum()), cfg)
    # candidates are cut at the granularity of the labelled types (only where labelled and
    # unlabelled cells share a batch: query batches are voted at cfg.query_resolution)
    resolution, scores = resolve_resolution(
        labels, pca_cells, seed=seed, calibrate=bool((~lab & ~query).any()), cfg=cfg
    )
    calib = np.zeros_like(lab) if calibration is None else calibration & lab
    tau, tau_info = ood_threshold(maxcos, lab & ~calib, calib, cfg)
    if ood_cap is not None:
        tau, tau_info = min(tau, ood_cap), {**tau_info, "threshold_probe": ood_cap}
    assign, sizes, tau = ood_clusters(
        maxcos, lab, pca_cells, threshold=tau, quantile=cfg.ood_quantile,
        resolution=resolution, min_size=min_size, seed=seed, exclude=ev.supported | query,
        include=ev.desert, n_neighbors=cfg.n_neighbors,
    )  # fmt: skip
    groups = _query_candidates(maxcos < tau, query, domain, pca_cells, min_size, cfg, seed)
    assign, sizes = _rank_by_size(assign, sizes, groups)
    k = len(sizes) if n_novel == "auto" else int(n_novel)
    heads = _novel_heads(embedding, seen_similarity, labels, assign, (k, len(sizes)), pca_cells,
                         min_size, cfg, seed)  # fmt: skip
    notes = _notes(labels, seen_similarity.shape[1], int(calib.sum()), ood_cap, cfg)
    diagnostics = {
        "n_novel": len(sizes),
        "cluster_sizes": list(sizes),
        "n_supported_by_labels": int(ev.supported.sum()),
        "n_label_deserts": int(ev.desert.sum()),
        "segregated_batches": [domain_names[d] if domain_names else str(d) for d in ev.segregated],
        "resolution": resolution,
        "resolution_ari": dict(zip(map(str, cfg.resolution_grid), scores, strict=False)),
        "n_anchored": int(heads.core.sum()),
        "n_query_clusters": len(groups),
        "min_cluster_size": min_size,
        "method": _method(resolution, bool(query.any()), cfg),
        **tau_info,
        "n_calibration": int(calib.sum()),
    }
    return Discovery(
        assign=assign,
        sizes=tuple(sizes),
        n_novel=len(sizes),
        prototypes=heads.prototypes,
        prior=heads.prior,
        anchor_cells=np.flatnonzero(heads.core),
        anchor_heads=seen_similarity.shape[1] + assign[heads.core],
        diagnostics=diagnostics,
        threshold=tau,
        notes=tuple(notes),
    )


def _once_per_cell_set(pca_of: Callable[[np.ndarray], np.ndarray]):
    """``pca_of`` computed once per set of cells (on single-batch data the batch's cells and all
    cells are the same set).
    """
    pcas: dict[bytes, np.ndarray] = {}

    def pca_cells(idx: np.ndarray) -> np.ndarray:
        key = np.asarray(idx, dtype=np.int64).tobytes()
        if key not in pcas:
            pcas[key] = pca_of(idx)
        return pcas[key]

    return pca_cells


@dataclass(frozen=True)
class _LabelEvidence:
    """What the labels say about unlabelled cells that share a batch with labelled ones:
    ``supported`` (among labelled cells: of known types), ``desert`` (improbably few labelled
    neighbours: a type nobody labelled) and the ``segregated`` batches, where labelled and
    unlabelled cells are two populations and deserts say nothing.
    """

    supported: np.ndarray
    desert: np.ndarray
    segregated: list[int]


def _label_evidence(lab, domain, pca_cells, cfg: DiscoveryConfig, domain_names) -> _LabelEvidence:
    # unlabelled cells among labelled ones (same batch) are of known types, however poorly the
    # seen heads score them
    nb_frac, tested = labelled_neighbours(lab, domain, pca_cells, n_neighbors=cfg.n_neighbors)
    supported = labelled_support(
        lab, domain, nb_frac, tested, n_neighbors=cfg.n_neighbors,
        min_fraction=cfg.support_fraction, min_count=cfg.support_min,
    )  # fmt: skip
    # unlabelled cells among unlabelled ones, in batches labelled at random: a type nobody
    # labelled, even where a seen head scores it confidently
    desert = label_deserts(
        lab, domain, nb_frac, tested, n_neighbors=cfg.n_neighbors, alpha=cfg.desert_alpha
    )
    # ... but only where labels were given among the batch's cells at random: where almost no
    # unlabelled cell has labelled neighbours, labelled and unlabelled cells are two populations
    # (e.g. a reference and a query concatenated without batch_key) and a lack of labels says
    # nothing
    segregated = segregated_batches(
        lab, domain, supported, tested, min_supported=cfg.segregated_support
    )
    for d in segregated:
        desert[domain == d] = False
        where = f" of batch {domain_names[d]!r}" if domain_names and len(domain_names) > 1 else ""
        warnings.warn(
            f"The labelled and unlabelled cells{where} barely share neighbourhoods (under "
            f"{cfg.segregated_support:.0%} of the unlabelled cells have labelled neighbours). If "
            "they come from different samples or technologies, pass batch_key=... (or the "
            "reference as a separate AnnData) so that the unlabelled cells are aligned and "
            "treated as a query; as it is, known types may be reported as novel clusters.",
            stacklevel=4,
        )
    return _LabelEvidence(supported, desert, segregated)


def _query_candidates(ood, query, domain, pca_cells, min_size: int, cfg: DiscoveryConfig,
                      seed: int) -> list[np.ndarray]:  # fmt: skip
    """Candidates of the batches without labelled cells (none when there are none)."""
    if not query.any():
        return []
    return query_ood_clusters(
        ood, np.flatnonzero(query), domain, pca_cells, min_size=min_size,
        min_fraction=cfg.query_min_fraction, min_enrichment=cfg.query_min_enrichment,
        resolution=cfg.query_resolution, seed=seed, n_neighbors=cfg.n_neighbors,
    )  # fmt: skip


def _rank_by_size(
    assign: np.ndarray, sizes: list[int], groups: list[np.ndarray]
) -> tuple[np.ndarray, list[int]]:
    """The query batches' candidates ``groups`` added to ``assign``; with them, candidates
    renumbered by size, largest first.
    """
    for g in groups:
        assign[g] = len(sizes)
        sizes.append(int(g.size))
    if groups:
        order = np.argsort(-np.asarray(sizes), kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        assign = np.where(assign >= 0, rank[np.maximum(assign, 0)], -1)
        sizes = [sizes[i] for i in order]
    return assign, sizes


@dataclass(frozen=True)
class _Heads:
    prototypes: np.ndarray  # (k, D) initial weights of the novel heads
    prior: np.ndarray  # (n_seen + k,) the regulariser's target
    core: np.ndarray  # (n,) bool: cells anchored to their candidate's head


def _novel_heads(embedding, seen_similarity, labels, assign, counts_k, pca_cells, min_size,
                 cfg: DiscoveryConfig, seed: int) -> _Heads:  # fmt: skip
    """Prototypes (candidate means; random beyond the candidates), the regulariser's prior and
    the anchored core cells of the novel heads; ``counts_k``: (heads, candidates).
    """
    k, n_candidates = counts_k
    n_seen = seen_similarity.shape[1]
    lab = labels >= 0
    protos = np.random.default_rng(seed).normal(size=(k, embedding.shape[1]))
    for j in range(min(k, n_candidates)):
        protos[j] = embedding[assign == j].mean(axis=0)
    protos /= np.linalg.norm(protos, axis=1, keepdims=True)
    # prior of the regulariser = estimated composition of all cells over the heads: labelled cells
    # by their label, candidate cells by their cluster, other unlabelled cells by their best seen
    # head after the warm-up (so a known type that is rare in the reference but common in the
    # query keeps its share)
    head = np.where(lab, labels, seen_similarity.argmax(axis=1))
    in_cand = (assign >= 0) & (assign < k)
    head = np.where(in_cand, n_seen + assign, head)
    counts = np.bincount(head, minlength=n_seen + k).astype(np.float64)
    core = cluster_cores(
        np.where(in_cand, assign, -1), pca_cells(np.arange(labels.size)),
        n_neighbors=cfg.n_neighbors, min_agree=cfg.core_min_agree,
        min_core=cfg.core_min_fraction,
    )  # fmt: skip
    # novel heads without a candidate cluster (n_novel given above the estimate): no evidence of
    # any mass, so their prior is the detection limit (smallest candidate size), not an average
    # cluster; otherwise the regulariser fills them with cells of known types
    empty = counts[n_seen:] == 0
    if empty.any():
        counts[n_seen:][empty] = min_size
    return _Heads(protos, counts / counts.sum(), core)


def _notes(labels, n_seen: int, n_cal: int, ood_cap, cfg: DiscoveryConfig) -> list[str]:
    """Where the data cannot support a call: said to the user (``estimate['notes']``, log)."""
    lab = labels >= 0
    n_unl = int((~lab).sum())
    notes = []
    per_class = np.bincount(labels[lab], minlength=n_seen)
    if cfg.calibration_fraction > 0 and ood_cap is None and n_cal * cfg.ood_max_rate < 1:
        notes.append(
            f"Only {n_cal} labelled cells were held out to calibrate the out-of-distribution "
            f"threshold (fewer than 1/ood_max_rate = {1 / cfg.ood_max_rate:.0f}): the share of "
            "known-type cells called novel is not controlled; more labelled cells would "
            "tighten it."
        )
    elif cfg.calibration_fraction == 0 and np.median(per_class) < _FEW_LABELS:
        notes.append(
            f"Few labelled cells per known type (median {np.median(per_class):.0f}): the "
            "warm-up fits them closely, so cells of known types can score as unlike them and "
            "be reported as novel clusters (simulated, 17-25 labelled cells per type: 17-47% of "
            "known-type cells). Check novel clusters against uns['orca']['novel_similarity'], "
            "or calibrate the threshold on held-out cells: calibration_fraction=0.2."
        )
    if n_unl < _SMALL_QUERY:
        notes.append(
            f"Only {n_unl} unlabelled cells: a novel type of fewer than about "
            f"{cfg.n_neighbors} cells (the neighbours of the clustering graph) rarely forms a "
            "cluster of its own and may be absorbed by a known type (simulated 150-cell "
            "queries: a third of the novel-type cells were)."
        )
    return notes


def _method(resolution: float, has_query: bool, cfg: DiscoveryConfig) -> str:
    """How the candidates were found, in words (``estimate['method']``)."""
    text = (
        f"Leiden clusters (resolution {resolution:g}) of cells below the "
        f"{cfg.ood_quantile:.0%} quantile of labelled max cosine or with improbably few "
        "labelled neighbours"
    )
    if has_query:
        text += (
            f"; in batches without labels, Leiden clusters (resolution "
            f"{cfg.query_resolution:g}) of the batch with at least "
            f"{cfg.query_min_fraction:.0%} (or {cfg.query_min_enrichment:g}x the batch's share) "
            "of such cells"
        )
    return text


def discover_without_warmup(
    labels: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    dim: int,
    *,
    n_novel: int | str = "auto",
    cfg: DiscoveryConfig = _DEFAULTS,
    seed: int = 0,
) -> Discovery:
    """The paper's literal recipe (``warmup_epochs=0``): the number of novel heads is given or
    estimated from the expression alone (:func:`estimate_n_novel`); heads start at random
    ``(k, dim)`` directions and the regulariser's prior is uniform.
    """
    diagnostics: dict[str, Any] = {}
    if n_novel == "auto":
        diagnostics = estimate_n_novel(labels, pca_of, seed=seed, cfg=cfg)
        k = diagnostics["n_novel"]
    else:
        k = int(n_novel)
    protos = np.random.default_rng(seed).normal(size=(k, dim))
    protos /= np.linalg.norm(protos, axis=1, keepdims=True)
    none = np.empty(0, dtype=np.int64)
    sizes = tuple(diagnostics.get("cluster_sizes", ()))
    return Discovery(
        assign=np.full(labels.size, -1, dtype=np.int64),
        sizes=sizes,
        n_novel=diagnostics.get("n_novel", -1),
        prototypes=protos,
        prior=None,
        anchor_cells=none,
        anchor_heads=none,
        diagnostics=diagnostics,
    )


# ------------------------------------------------------------------------------------------
# after training: novel clusters that are known types, and names
# ------------------------------------------------------------------------------------------
def match_known_types(
    X: sp.csr_matrix,
    labels: np.ndarray,
    domain: np.ndarray,
    clusters: np.ndarray,
    n_clusters: int,
    n_seen: int,
    threshold: float = _DEFAULTS.merge_threshold,
) -> list[tuple[int, int, float]]:
    """Novel clusters that are a known type seen in another batch.

    A known type that is rare in the reference but common in the query (or shifted by technology)
    can come out as a novel cluster. Batch effects shift expression levels, but the genes that set
    a type apart from the other cells *of its own batch* are largely the same in every batch. So
    each group gets a within-batch marker signature: its mean expression in its main batch minus
    that batch's mean over all cells. A cluster (``clusters[i]`` for unlabelled cell ``i``,
    ``-1`` elsewhere) whose signature correlates at least ``threshold`` with a known type's is that
    type, provided no cell of the type is labelled in the cluster's batch (within one batch the
    labels already say which cells belong to the type, so no cluster is merged there).

    Returns ``[(cluster, type, correlation), ...]`` for the merged clusters.
    """
    n_domains = int(domain.max()) + 1
    all_means, _ = group_domain_means(X, np.zeros(X.shape[0], dtype=np.int64), 1, domain, n_domains)
    background = all_means[0]  # (n_domains, n_genes): mean over every cell of each batch

    def signatures(groups, n_groups):
        means, counts = group_domain_means(X, groups, n_groups, domain, n_domains)
        main = counts.argmax(axis=1)  # each group's main batch
        sig = means[np.arange(n_groups), main] - background[main]
        sig = sig - sig.mean(axis=1, keepdims=True)
        sig /= np.maximum(np.linalg.norm(sig, axis=1, keepdims=True), 1e-12)
        return sig, main, counts

    known, _, known_counts = signatures(labels, n_seen)  # -1 (unlabelled) is no group
    novel, novel_main, novel_counts = signatures(clusters, n_clusters)
    corr = novel @ known.T  # (n_clusters, n_seen) Pearson correlation of the signatures
    # a type can only absorb a cluster whose batch has none of the type's labelled cells
    corr[known_counts[:, novel_main].T > 0] = -np.inf
    corr[novel_counts.sum(axis=1) == 0] = -np.inf
    merged = []
    for j in range(n_clusters):
        k = int(np.argmax(corr[j]))
        if corr[j, k] >= threshold:
            merged.append((j, k, float(corr[j, k])))
    return merged


def match_novel_across_batches(
    X: sp.csr_matrix,
    domain: np.ndarray,
    clusters: np.ndarray,
    n_clusters: int,
    threshold: float = _DEFAULTS.merge_threshold,
) -> list[tuple[int, int, float]]:
    """Novel clusters of different batches that are one novel type (e.g. a type present in two
    queries, found in each): their within-batch marker signatures (as in
    :func:`match_known_types`) correlate at least ``threshold`` and each is the other's best
    match among the clusters of the other's batch. Returns ``[(cluster, same_as, correlation)]``
    (``same_as`` the larger of the two).
    """
    n_domains = int(domain.max()) + 1
    if n_domains < 2 or n_clusters < 2:
        return []
    all_means, _ = group_domain_means(X, np.zeros(X.shape[0], dtype=np.int64), 1, domain, n_domains)
    background = all_means[0]
    means, counts = group_domain_means(X, clusters, n_clusters, domain, n_domains)
    main = counts.argmax(axis=1)
    sig = means[np.arange(n_clusters), main] - background[main]
    sig = sig - sig.mean(axis=1, keepdims=True)
    sig /= np.maximum(np.linalg.norm(sig, axis=1, keepdims=True), 1e-12)
    corr = sig @ sig.T
    size = counts.sum(axis=1)
    corr[:, size == 0] = -np.inf
    corr[main[:, None] == main[None, :]] = -np.inf  # only clusters of different batches
    pairs = []
    for a in range(n_clusters):  # loop over clusters, not cells
        if size[a] == 0:
            continue
        b = int(np.argmax(corr[a]))
        best_of_b = int(np.argmax(np.where(main == main[a], corr[b], -np.inf)))
        if corr[a, b] >= threshold and best_of_b == a and size[a] < size[b] + (a > b):
            pairs.append((a, b, float(corr[a, b])))
    return pairs


def name_heads(
    counts: np.ndarray,
    classes: list[str],
    merged: list[tuple[int, int, float]],
    same: list[tuple[int, int, float]] = (),
) -> tuple[list[str | None], list[int]]:
    """Output name of every head: seen heads keep their class; a novel head merged into a known
    type (:func:`match_known_types`) takes the type's name; the other novel heads with cells are
    ``novel_1``, ``novel_2``, ... by size among the unlabelled cells (``counts``, per novel head),
    largest first, skipping names that are known types (a reference that is itself an annotated
    query has classes ``novel_1``, ...); heads without cells are ``None`` (pruned). Novel heads
    that are one type in several batches (``same``: :func:`match_novel_across_batches`) share
    the name of the larger, ranked by their size together. Returns the names and the novel heads
    in name order.
    """
    n_seen = len(classes)
    names: list[str | None] = list(classes) + [None] * len(counts)
    for h, k, _ in merged:
        names[n_seen + h] = classes[k]
    root = np.arange(len(counts))
    for a, b, _ in same:
        root[root == root[a]] = root[b]
    total = np.bincount(root, weights=counts, minlength=len(counts))
    order = [
        int(h)
        for h in np.argsort(-total, kind="stable")
        if root[h] == h and total[h] > 0 and names[n_seen + h] is None
    ]
    taken = set(classes)
    free = (f"novel_{i}" for i in itertools.count(1) if f"novel_{i}" not in taken)
    for h in order:
        name = next(free)
        for member in np.flatnonzero((root == h) & (counts > 0)):
            if names[n_seen + member] is None:
                names[n_seen + member] = name
    return names, order
