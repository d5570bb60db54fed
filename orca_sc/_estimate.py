"""Candidate novel clusters and the number of novel types (``n_novel="auto"``).

Default (after the supervised warm-up), :func:`ood_clusters`: unlabelled cells whose best cosine
similarity to a seen head is below the 1% quantile of the labelled cells', and, in batches with
labelled cells, cells with improbably few labelled neighbours (:func:`label_deserts`), are
clustered with Leiden on the PCA of their own expression, at the resolution that matches the
granularity of the labelled types (:func:`calibrate_resolution`); clusters of at least
:func:`min_cluster_size` cells are the candidates, and their number is the estimate. In a batch without labelled cells (a separate
query) :func:`query_ood_clusters` decides per cluster of the batch instead, by majority vote.

Without a warm-up (``warmup_epochs=0``), :func:`estimate_n_novel`: Leiden on the PCA of all cells;
a cluster counts as novel when its fraction of labelled cells is below ``rel_threshold`` times the
overall labelled fraction (clusters of known types mix labelled and unlabelled cells).

Leiden runs on an exact kNN graph from scikit-learn, on at most 50,000 cells.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import scipy.sparse as sp

_MAX_CELLS = 50_000
_CHUNK = 8192


def subsample_rows(n: int, seed: int) -> np.ndarray:
    """All row indices, or a sorted random subset of ``_MAX_CELLS`` of them for large data."""
    rng = np.random.default_rng(seed)
    return np.arange(n) if n <= _MAX_CELLS else np.sort(rng.choice(n, _MAX_CELLS, replace=False))


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
    pca.fit(_dense(X, domain, scale, offset, fit_rows))
    out = np.empty((rows.size, n_comps), dtype=np.float32)
    for start in range(0, rows.size, _CHUNK):
        r = rows[start : start + _CHUNK]
        out[start : start + r.size] = pca.transform(_dense(X, domain, scale, offset, r))
    return out


def _dense(X, domain, scale, offset, rows) -> np.ndarray:
    d = domain[rows]
    return X[rows].toarray() * scale[d] + offset[d]


def knn_graph(emb: np.ndarray, n_neighbors: int = 15) -> sp.csr_matrix:
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


def leiden(
    emb: np.ndarray,
    resolution: float = 1.0,
    seed: int = 0,
    adjacency: sp.csr_matrix | None = None,
) -> np.ndarray:
    """Leiden cluster codes of the rows of ``emb`` (15-NN graph, igraph flavour, seeded).

    ``adjacency``: the graph of :func:`knn_graph` when already built (to cluster one set of
    cells at several resolutions).
    """
    import anndata as ad
    import scanpy as sc

    if emb.shape[0] < 3:
        return np.zeros(emb.shape[0], dtype=np.int64)
    tmp = ad.AnnData(X=sp.csr_matrix((emb.shape[0], 1), dtype=np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sc.tl.leiden(
            tmp,
            adjacency=knn_graph(emb) if adjacency is None else adjacency,
            resolution=resolution,
            flavor="igraph",
            n_iterations=2,
            directed=False,
            random_state=seed,
        )
    return tmp.obs["leiden"].cat.codes.to_numpy().astype(np.int64)


#: resolutions tried by :func:`calibrate_resolution`, and the one used when it cannot be
#: calibrated (fewer than two labelled classes)
RESOLUTION_GRID = (0.1, 0.25, 0.5, 1.0)
FALLBACK_RESOLUTION = 0.5
_CALIBRATION_CELLS = 10_000


def calibrate_resolution(
    labels: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    grid: tuple[float, ...] = RESOLUTION_GRID,
    seed: int = 0,
) -> tuple[float, list[float]]:
    """The Leiden resolution at which clusters match the granularity of the given annotation.

    What counts as one cell type is the annotator's choice: one atlas splits neurons into many
    types, another keeps broad classes made of distinct sub-populations. The labelled cells show
    which: they (at most 10,000 of them, at random) are clustered at each resolution of ``grid``
    (Leiden on the PCA of their own expression, ``pca_of(idx)``, one kNN graph) and the
    resolution whose clusters agree best with their labels (adjusted Rand index; ties go to the
    coarser) is returned, with the scores. Candidate novel clusters are then cut at the same
    granularity as the known types. ``labels``: class codes, ``-1`` for unlabelled cells.
    With fewer than two labelled classes, returns ``FALLBACK_RESOLUTION`` and no scores.
    """
    from sklearn.metrics import adjusted_rand_score

    idx = np.flatnonzero(labels >= 0)
    if np.unique(labels[idx]).size < 2 or idx.size < 3:
        return FALLBACK_RESOLUTION, []
    if idx.size > _CALIBRATION_CELLS:
        rng = np.random.default_rng(seed)
        idx = np.sort(rng.choice(idx, _CALIBRATION_CELLS, replace=False))
    emb = pca_of(idx)
    graph = knn_graph(emb)
    scores = [
        float(adjusted_rand_score(labels[idx], leiden(emb, r, seed, adjacency=graph))) for r in grid
    ]
    return float(grid[int(np.argmax(scores))]), scores


def resolve_resolution(
    resolution: float | str,
    labels: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    seed: int = 0,
    calibrate: bool = True,
) -> tuple[float, list[float]]:
    """The Leiden resolution to use for ``OrcaConfig.resolution``, with its calibration scores:
    a number is used as given; ``"auto"`` is :func:`calibrate_resolution` on ``labels``, or
    ``FALLBACK_RESOLUTION`` when ``calibrate`` is False (nothing to calibrate against).
    """
    if resolution != "auto":
        return float(resolution), []
    if not calibrate:
        return FALLBACK_RESOLUTION, []
    return calibrate_resolution(labels, pca_of, seed=seed)


def min_cluster_size(n_unlabeled: int) -> int:
    """Smallest candidate novel cluster: 5 cells or 0.5% of the unlabelled cells."""
    return max(5, int(np.ceil(0.005 * n_unlabeled)))


def labelled_neighbours(
    labeled: np.ndarray,
    domain: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    n_neighbors: int = 15,
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
    n_neighbors: int = 15,
    min_agree: float = 0.5,
    min_core: float = 2 / 3,
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
    labeled: np.ndarray, domain: np.ndarray, frac: np.ndarray, tested: np.ndarray
) -> np.ndarray:
    """Unlabelled cells that sit among labelled cells, so are not of a novel type.

    In a batch where cells were labelled at random, a cell of a known type has about a fraction
    ``f`` of labelled cells among its nearest neighbours (``frac``, from
    :func:`labelled_neighbours`), while a cell of a type nobody labelled has few or none. ``f`` is
    measured around the batch's labelled cells (their neighbours are cells of their own type). An
    unlabelled cell with at least half that fraction (and at least 2 labelled neighbours of 15) is
    supported by labels: the seen heads may score it poorly (a small class fitted to its few
    labelled cells) or a wrong seen head may have absorbed it, but it is no novel type. Untested
    cells (batches without labels) are never supported. Returns a boolean mask.
    """
    supported = np.zeros(labeled.shape[0], dtype=bool)
    for idx, expected in _tested_batches(labeled, domain, frac, tested):
        supported[idx] = ~labeled[idx] & (frac[idx] >= max(2 / 15, 0.5 * expected))
    return supported


def _tested_batches(labeled, domain, frac, tested):
    """For each batch with tested cells (:func:`labelled_neighbours`): its tested cells and the
    labelled fraction ``f`` expected around a cell of a known type, measured around its labelled
    cells.
    """
    for d in np.unique(domain[tested]):  # loop over batches, not cells
        idx = np.flatnonzero((domain == d) & tested)
        yield idx, frac[idx][labeled[idx]].mean()


#: :func:`label_deserts`: one-sided binomial level below which a cell has too few labelled
#: neighbours for a known type
DESERT_ALPHA = 0.01


def label_deserts(
    labeled: np.ndarray,
    domain: np.ndarray,
    frac: np.ndarray,
    tested: np.ndarray,
    *,
    n_neighbors: int = 15,
    alpha: float = DESERT_ALPHA,
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


#: :func:`segregated_batches`: a batch whose unlabelled cells have labelled neighbours (are
#: supported, :func:`labelled_support`) less often than this was not labelled at random
SEGREGATED_SUPPORT = 0.1


def segregated_batches(
    labeled: np.ndarray,
    domain: np.ndarray,
    supported: np.ndarray,
    tested: np.ndarray,
    *,
    min_supported: float = SEGREGATED_SUPPORT,
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
    quantile: float = 0.01,
    resolution: float = 1.0,
    seed: int = 0,
    exclude: np.ndarray | None = None,
    include: np.ndarray | None = None,
) -> tuple[np.ndarray, list[int], float]:
    """Candidate novel clusters from the cells the seen heads do not explain.

    An unlabelled cell is out-of-distribution when its highest cosine similarity to a seen-class
    head is below the ``quantile`` of that similarity over labelled cells; cells in ``include``
    (e.g. :func:`label_deserts`) are treated as OOD however well they are scored. The OOD cells
    are clustered (Leiden on the PCA of their own expression, ``pca_of(idx)``); clusters of at
    least :func:`min_cluster_size` cells are the candidates; cells in ``exclude`` (e.g.
    :func:`labelled_support`) never are. Returns ``(assign, sizes, threshold)`` with
    ``assign[i]`` the candidate index of cell ``i`` (``-1`` outside candidates), largest first.
    """
    tau = float(np.quantile(maxcos[labeled], quantile))
    ood = ~labeled & (maxcos < tau)
    if include is not None:
        ood |= include & ~labeled
    if exclude is not None:
        ood &= ~exclude
    ood = np.flatnonzero(ood)
    min_size = min_cluster_size(int((~labeled).sum()))
    assign = np.full(maxcos.shape[0], -1, dtype=np.int64)
    if ood.size < min_size:
        return assign, [], tau
    codes = leiden(pca_of(ood), resolution, seed)
    counts = np.bincount(codes)
    keep = [c for c in np.argsort(-counts, kind="stable") if counts[c] >= min_size]
    for rank, c in enumerate(keep):
        assign[ood[codes == c]] = rank
    return assign, [int(counts[c]) for c in keep], tau


def hidden_novel_clusters(
    head: np.ndarray,
    labels: np.ndarray,
    same_batch: np.ndarray,
    n_seen: int,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    min_size: int,
    resolution: float = 0.5,
    alpha: float = 1e-3,
    max_rel_fraction: float = 0.25,
    seed: int = 0,
    class_fraction: np.ndarray | None = None,
    exclude: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Novel types hiding inside seen heads, found from where labelled cells are missing.

    Within a batch where cells were labelled at random (the same distribution as the unlabelled
    ones), every sub-population of a known type carries its share of labelled cells. For each
    seen class ``k``, the cells of those batches that belong to it (labelled ``k``, or unlabelled
    with ``head == k``) are clustered (Leiden on the PCA of their own expression, ``pca_of(idx)``);
    a sub-cluster of at least ``min_size`` unlabelled cells whose labelled fraction is below
    ``max_rel_fraction`` times the class's and improbably low under a binomial draw at the
    class's fraction (one-sided p < ``alpha``) is a novel type the seen head absorbed (e.g. two
    related epithelial types of which only one is labelled). Cells of batches without labelled
    cells (a separate query) are not tested: there a missing label says nothing.

    The class's labelled fraction is measured over its members, or given as ``class_fraction``
    (better: the members include cells the head absorbed, which dilute it; see
    :func:`labelled_neighbours`). Cells in ``exclude`` (e.g. cells of another known type that
    the head absorbed, which lack its labels too: :func:`labelled_support`) are left out.

    ``head``: the seen head of each unlabelled cell (ignored for labelled cells). Returns the
    index arrays (into the given cells) of the unlabelled members of each such sub-cluster.
    """
    from scipy.stats import binom

    lab = labels >= 0
    found: list[np.ndarray] = []
    for k in range(n_seen):  # loop over classes, not cells
        members = np.flatnonzero(same_batch & ((lab & (labels == k)) | (~lab & (head == k))))
        n_lab = int(lab[members].sum())
        n_unl = members.size - n_lab
        if n_lab < 2 or n_unl < min_size:
            continue
        frac = n_lab / members.size if class_fraction is None else class_fraction[k]
        codes = leiden(pca_of(members), resolution, seed)
        for c in np.unique(codes):
            in_c = members[codes == c]
            c_lab = int(lab[in_c].sum())
            c_unl = in_c.size - c_lab
            if c_unl < min_size or c_lab / in_c.size >= max_rel_fraction * frac:
                continue
            if binom.cdf(c_lab, in_c.size, frac) < alpha:
                cells = in_c[~lab[in_c]]
                if exclude is not None:
                    cells = cells[~exclude[cells]]
                if cells.size >= min_size:
                    found.append(cells)
    return found


def novel_clusters(
    emb: np.ndarray,
    labeled: np.ndarray,
    *,
    resolution: float = 1.0,
    rel_threshold: float = 0.1,
    min_size: int | None = None,
    seed: int = 0,
) -> list[int]:
    """Sizes (unlabelled cells, largest first) of the Leiden clusters of ``emb`` that look like
    novel types: at least ``min_size`` unlabelled cells and a labelled fraction below
    ``rel_threshold`` times the overall one.
    """
    clusters = leiden(emb, resolution, seed)
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
    X: sp.csr_matrix,
    labels: np.ndarray,
    domain: np.ndarray,
    scale: np.ndarray,
    offset: np.ndarray,
    *,
    seed: int = 0,
    **kwargs,
) -> dict:
    """Estimate the number of novel types from the (aligned) expression: PCA, then
    :func:`novel_clusters`. At most 50,000 cells (a random subset) are clustered.
    """
    rows = subsample_rows(X.shape[0], seed)
    emb = pca_embedding(X, domain, scale, offset, seed=seed, rows=rows)
    sizes = novel_clusters(emb, labels[rows] >= 0, seed=seed, **kwargs)
    return {"n_novel": len(sizes), "cluster_sizes": sizes, "space": "pca"}


#: :func:`query_ood_clusters`: a query cluster is a candidate when at least this fraction of its
#: cells is out-of-distribution, or this many times the batch's overall fraction
QUERY_MIN_FRACTION = 0.5
QUERY_MIN_ENRICHMENT = 2.5
#: Leiden resolution of :func:`query_ood_clusters` (0.5 and 2.0 were worse on the cross-batch
#: tasks)
QUERY_RESOLUTION = 1.0


def query_ood_clusters(
    ood: np.ndarray,
    cells: np.ndarray,
    domain: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    min_size: int,
    min_fraction: float = QUERY_MIN_FRACTION,
    min_enrichment: float = QUERY_MIN_ENRICHMENT,
    resolution: float = QUERY_RESOLUTION,
    seed: int = 0,
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
        codes = leiden(pca_of(idx), resolution, seed)
        overall = ood[idx].mean()
        for c in np.unique(codes):
            m = idx[codes == c]
            frac = ood[m].mean()
            if m.size >= min_size and (frac >= min_fraction or frac >= min_enrichment * overall):
                found.append(m)
    return found
