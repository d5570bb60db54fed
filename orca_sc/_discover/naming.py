"""After training: novel clusters that are a known type of another batch (:func:`match_known_types`),
novel clusters of several queries that are one type (:func:`match_novel_across_batches`), and
names (:func:`name_heads`).
"""

from __future__ import annotations

import itertools

import numpy as np
import scipy.sparse as sp

from .._align import group_domain_means, group_domain_sums
from .._config import DiscoveryConfig

_DEFAULTS = DiscoveryConfig()


def batch_background(X: sp.csr_matrix, domain: np.ndarray) -> np.ndarray:
    """Mean expression over every cell of each batch, ``(n_domains, n_genes)``: the background
    that the within-batch marker signatures of :func:`match_known_types` and
    :func:`match_novel_across_batches` are taken against (computed once for both).
    """
    n_domains = int(domain.max()) + 1
    zeros = np.zeros(X.shape[0], dtype=np.int64)
    return group_domain_means(X, zeros, 1, domain, n_domains)[0][0]


def naming_means(
    X: sp.csr_matrix,
    labels: np.ndarray,
    domain: np.ndarray,
    clusters: np.ndarray,
    n_clusters: int,
    n_seen: int,
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """What :func:`match_known_types` and :func:`match_novel_across_batches` read, from one
    pass over ``X``: each batch's background, the clusters' and the labelled types' per-batch
    means and counts (``labels``/``clusters``: ``-1`` for none; a cell is in at most one).
    """
    n_domains = int(domain.max()) + 1
    rest = n_seen + n_clusters  # every other cell, for the background
    groups = np.where(labels >= 0, labels, np.where(clusters >= 0, n_seen + clusters, rest))
    sums, counts = group_domain_sums(X, groups, rest + 1, domain, n_domains)
    background = sums.sum(axis=0) / np.maximum(counts.sum(axis=0), 1)[:, None]
    means = sums / np.maximum(counts, 1)[..., None]
    known = (means[:n_seen], counts[:n_seen])
    return background, (means[n_seen:rest], counts[n_seen:rest]), known


def _signatures(means, counts, background):
    """Each group's within-batch marker signature (its mean in its main batch minus that batch's
    ``background``, centred and L2-normalised), its main batch and its counts.
    """
    n_groups = means.shape[0]
    main = counts.argmax(axis=1)  # each group's main batch
    sig = means[np.arange(n_groups), main] - background[main]
    sig = sig - sig.mean(axis=1, keepdims=True)
    sig /= np.maximum(np.linalg.norm(sig, axis=1, keepdims=True), 1e-12)
    return sig, main, counts


def match_known_types(
    X: sp.csr_matrix,
    labels: np.ndarray,
    domain: np.ndarray,
    clusters: np.ndarray,
    n_clusters: int,
    n_seen: int,
    threshold: float = _DEFAULTS.merge_threshold,
    *,
    background: np.ndarray | None = None,
    cluster_means: tuple[np.ndarray, np.ndarray] | None = None,
    known_means: tuple[np.ndarray, np.ndarray] | None = None,
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

    ``background`` (:func:`batch_background`), ``cluster_means`` (the clusters'
    :func:`group_domain_means`) and ``known_means`` (the labelled types'), where the caller has
    them (:func:`naming_means`), are not computed again.

    Returns ``[(cluster, type, correlation), ...]`` for the merged clusters.
    """
    n_domains = int(domain.max()) + 1
    if background is None:
        background = batch_background(X, domain)
    if cluster_means is None:
        cluster_means = group_domain_means(X, clusters, n_clusters, domain, n_domains)
    if known_means is None:  # -1 (unlabelled) is no group
        known_means = group_domain_means(X, labels, n_seen, domain, n_domains)
    known, _, known_counts = _signatures(*known_means, background)
    novel, novel_main, novel_counts = _signatures(*cluster_means, background)
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
    *,
    background: np.ndarray | None = None,
    cluster_means: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[tuple[int, int, float]]:
    """Novel clusters of different batches that are one novel type (e.g. a type present in two
    queries, found in each): their within-batch marker signatures (as in
    :func:`match_known_types`) correlate at least ``threshold`` and each is the other's best
    match among the clusters of the other's batch. ``background`` and ``cluster_means`` as in
    :func:`match_known_types`. Returns ``[(cluster, same_as, correlation)]`` (``same_as`` the
    larger of the two).
    """
    n_domains = int(domain.max()) + 1
    if n_domains < 2 or n_clusters < 2:
        return []
    if background is None:
        background = batch_background(X, domain)
    if cluster_means is None:
        cluster_means = group_domain_means(X, clusters, n_clusters, domain, n_domains)
    sig, main, counts = _signatures(*cluster_means, background)
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
