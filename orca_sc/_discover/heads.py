"""From candidates to novel heads: prototypes, the regulariser's prior, and the core cells anchored
to their candidate's head (:func:`cluster_cores`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components

from .._ablation import DiscoveryRules
from .._conformal import benjamini_hochberg
from .compute import kneighbors

_DEFAULTS = DiscoveryRules()


def cluster_cores(
    assign: np.ndarray,
    feats: np.ndarray,
    *,
    n_neighbors: int = _DEFAULTS.n_neighbors,
    min_agree: float = _DEFAULTS.core_min_agree,
    min_core: float = _DEFAULTS.core_min_fraction,
    link: bool = True,
) -> np.ndarray:
    """Cells at the core of a coherent candidate cluster.

    A cell is at the core of its cluster (``assign >= 0``; ``-1``: no cluster) when at least
    ``min_agree`` of its ``n_neighbors`` nearest neighbours (itself excluded) among all cells
    (``feats``, e.g. PCA coordinates) are in the same cluster. A cluster that is a whole novel
    type is nearly all core; a cluster that swept up poorly scored cells of several known types
    (their neighbours are mostly cells of their own, non-candidate type) is not coherent: when
    less than ``min_core`` of its cells are core, none of them is kept. Returns a boolean mask.

    With ``link`` (the default), candidates whose cells have at least as many neighbours in
    another candidate as in their own are pieces of one population with it
    (:func:`_one_population`); where no piece of a population is coherent alone, a neighbour in
    any piece agrees. A novel type present in several query batches is voted batch by batch,
    one candidate per batch, and its cells' neighbours lie in all of them: without the link no
    piece is coherent, none is anchored, and training can hand the whole type to a known head.
    Each candidate's share of core cells is still its own (why and what it changed:
    docs/discovery.md). ``link=False``: each candidate on its own.
    """
    core = np.zeros(assign.shape[0], dtype=bool)
    cand = np.flatnonzero(assign >= 0)
    if cand.size == 0 or assign.shape[0] <= n_neighbors:
        return core
    idx = kneighbors(feats, n_neighbors + 1, feats[cand])[:, 1:]  # drop the cell itself
    own, nb = assign[cand], assign[idx]
    n = np.bincount(own)
    core[cand] = (nb == own[:, None]).mean(axis=1) >= min_agree
    frac = np.bincount(own, weights=core[cand]) / np.maximum(n, 1)
    same = _one_population(own, nb, n.size) if link else None
    if same is not None:
        # a population none of whose pieces is coherent alone: are its pieces together?
        bare = ~(same & (frac >= min_core)[None, :]).any(axis=1)  # (n,) no coherent piece
        agree = (same[own[:, None], np.maximum(nb, 0)] & (nb >= 0)).mean(axis=1)
        core[cand] = np.where(bare[own], agree >= min_agree, core[cand])
        frac = np.bincount(own, weights=core[cand]) / np.maximum(n, 1)
    return core & (assign >= 0) & (frac[np.maximum(assign, 0)] >= min_core)


def significant_cells(pvalues: np.ndarray, query: np.ndarray, alpha: float) -> np.ndarray:
    """Cells of ``query`` whose conformal novelty p-value is significant at false discovery
    rate ``alpha`` (Benjamini-Hochberg over all the query cells, a cell without a p-value, NaN,
    counted as p = 1): of the cells it returns, at most a share ``alpha`` is expected to be
    known-type cells exchangeable with the reference. Returns a boolean mask.
    """
    out = np.zeros(pvalues.shape[0], dtype=bool)
    rows = np.flatnonzero(query)
    if rows.size:
        p = np.where(np.isfinite(pvalues[rows]), pvalues[rows], 1.0)
        out[rows] = benjamini_hochberg(p) <= alpha
    return out


def _one_population(own: np.ndarray, nb: np.ndarray, n: int) -> np.ndarray | None:
    """``(n, n)`` boolean: candidates ``i`` and ``j`` are pieces of one population (connected
    by links, a link from ``i`` to ``j`` where ``i``'s cells have at least as many neighbours in
    ``j`` as in ``i`` itself); ``None`` when no candidate has such a link. ``own`` ``(m,)``:
    each candidate cell's candidate; ``nb`` ``(m, k)``: the candidates of its neighbours
    (``-1``: none).
    """
    if n < 2:
        return None
    inside = nb >= 0
    pairs = np.broadcast_to(own[:, None], nb.shape)[inside] * n + nb[inside]
    counts = np.bincount(pairs, minlength=n * n).reshape(n, n)
    links = (counts >= np.diag(counts)[:, None]) & (counts > 0)
    np.fill_diagonal(links, False)
    if not links.any():
        return None
    _, comp = connected_components(sp.csr_matrix(links), directed=True, connection="weak")
    return comp[:, None] == comp[None, :]


@dataclass(frozen=True)
class _Heads:
    prototypes: np.ndarray  # (k, D) initial weights of the novel heads
    prior: np.ndarray  # (n_seen + k,) the regulariser's target
    core: np.ndarray  # (n,) bool: cells anchored to their candidate's head
    n_significant: int  # of them, cells anchored for a significant p-value and not core


def _novel_heads(embedding, seen_similarity, labels, assign, counts_k, pca_cells,
                 cfg: DiscoveryRules, seed: int,
                 significant: np.ndarray | None = None) -> _Heads:  # fmt: skip
    """Prototypes (candidate means; random beyond the candidates), the regulariser's prior and
    the anchored cells of the novel heads: the core cells (:func:`cluster_cores`) and, with
    ``significant`` (a mask, :func:`significant_cells`), every candidate cell it holds;
    ``counts_k``: (heads, candidates).
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
    # any mass, so their prior is one cell, not an average cluster; otherwise the regulariser
    # fills them with cells of known types
    counts[n_seen:][counts[n_seen:] == 0] = 1
    extra = np.zeros_like(core) if significant is None else in_cand & ~core & significant
    return _Heads(protos, counts / counts.sum(), core | extra, int(extra.sum()))
