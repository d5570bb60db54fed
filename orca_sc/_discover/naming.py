"""After training: novel clusters that are a known type of another batch (:func:`match_known_types`),
novel clusters of several queries that are one type (:func:`match_novel_across_batches`), and
names (:func:`name_heads`).
"""

from __future__ import annotations

import itertools

import numpy as np
import scipy.sparse as sp

from .._ablation import DiscoveryRules
from .._align import group_domain_means, group_domain_sums

_DEFAULTS = DiscoveryRules()


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


def _centred_unit(sig: np.ndarray) -> np.ndarray:
    """Rows of ``sig`` (mean minus background) centred and L2-normalised: a row's dot product
    with another is then their Pearson correlation.
    """
    sig = sig - sig.mean(axis=1, keepdims=True)
    sig /= np.maximum(np.linalg.norm(sig, axis=1, keepdims=True), 1e-12)
    return sig


def _signatures(means, counts, background):
    """Each group's within-batch marker signature (its mean in its main batch minus that batch's
    ``background``, :func:`_centred_unit`), its main batch and its counts.
    """
    n_groups = means.shape[0]
    main = counts.argmax(axis=1)  # each group's main batch
    return _centred_unit(means[np.arange(n_groups), main] - background[main]), main, counts


def _split_signatures(
    rows: np.ndarray, order: np.ndarray, m: int, background: np.ndarray
) -> np.ndarray:
    """Signatures (:func:`_centred_unit` of the mean minus ``background``) of both groups of
    each split of the dense ``rows``: split ``s`` puts ``rows[order[s, :m]]`` in its first
    group and the rest in its second. ``(n_splits, 2, n_genes)``, from one BLAS product.
    """
    n_splits, n = order.shape
    weight = np.where(np.arange(n) < m, 1.0 / m, 1.0 / (n - m))  # by position in the split
    pick = np.zeros((n_splits, 2, n))
    side = (np.arange(n) >= m)[None, :].astype(np.int64)
    pick[np.arange(n_splits)[:, None], side, order] = weight[None, :]
    sig = _centred_unit(pick.reshape(-1, n) @ rows - background[None, :])
    return sig.reshape(n_splits, 2, -1)


#: random halvings of a group by :func:`signature_reliability`
RELIABILITY_SPLITS = 20
#: at most this many cells of a group enter :func:`signature_reliability` (a larger group's
#: reliability is stepped up from theirs by the Spearman-Brown formula)
RELIABILITY_CELLS = 2000


def signature_reliability(
    X: sp.csr_matrix, rows: np.ndarray, background: np.ndarray, rng: np.random.Generator
) -> float:
    """How reproducible a group's within-batch marker signature (:func:`_signatures`) is: the
    split-half reliability of its mean. The group's cells (``rows`` of ``X``, one batch with
    mean ``background``) are halved at random :data:`RELIABILITY_SPLITS` times; the mean
    correlation ``r`` of the two halves' signatures is stepped up to the whole group by the
    Spearman-Brown formula ``2r / (1 + r)`` (and from at most :data:`RELIABILITY_CELLS` drawn
    cells to all of them). A signature of few cells is noisy and correlates less with any other
    than its type's true signature does; dividing an observed correlation by the square root
    of the two reliabilities undoes that attenuation (Spearman's correction). ``nan`` where the
    group has fewer than 4 cells or the halves do not correlate positively (no correction).
    """
    n_all = rows.size
    if n_all < 4:
        return float("nan")
    if n_all > RELIABILITY_CELLS:
        rows = np.sort(rng.choice(rows, RELIABILITY_CELLS, replace=False))
    dense = X[rows].toarray().astype(np.float64)
    n = dense.shape[0]
    order = np.stack([rng.permutation(n) for _ in range(RELIABILITY_SPLITS)])
    sig = _split_signatures(dense, order, n // 2, background)
    r = float(np.mean(np.einsum("sg,sg->s", sig[:, 0], sig[:, 1])))
    if not r > 0:
        return float("nan")
    rel = 2 * r / (1 + r)  # the half's reliability stepped up to the n drawn cells
    m = n_all / n  # and to every cell of the group
    return float(m * rel / (1 + (m - 1) * rel))


def group_reliabilities(
    X: sp.csr_matrix,
    groups: np.ndarray,
    n_groups: int,
    domain: np.ndarray,
    main: np.ndarray,
    background: np.ndarray,
    seed: int,
) -> np.ndarray:
    """:func:`signature_reliability` of each group (``groups``: ``-1`` for none) over its cells
    in its main batch ``main[g]``, ``(n_groups,)``; ``seed`` draws the cells of large groups.
    """
    rng = np.random.default_rng([seed, 0x5B2E1])
    out = np.full(n_groups, np.nan)
    for g in range(n_groups):  # loop over groups, not cells
        rows = np.flatnonzero((groups == g) & (domain == main[g]))
        out[g] = signature_reliability(X, rows, background[main[g]], rng)
    return out


def cluster_reliabilities(
    X: sp.csr_matrix,
    domain: np.ndarray,
    clusters: np.ndarray,
    cluster_means: tuple[np.ndarray, np.ndarray],
    background: np.ndarray,
    seed: int,
) -> np.ndarray:
    """:func:`group_reliabilities` of the novel clusters over their cells in their main batch
    (``cluster_means``: their :func:`group_domain_means`), once for both
    :func:`match_known_types` and :func:`match_novel_across_batches`.
    """
    means, counts = cluster_means
    main = counts.argmax(axis=1)
    return group_reliabilities(X, clusters, means.shape[0], domain, main, background, seed)


def disattenuate(corr: np.ndarray, rel_a: np.ndarray, rel_b: np.ndarray) -> np.ndarray:
    """``corr[i, j]`` divided by ``sqrt(rel_a[i] * rel_b[j])`` (Spearman's correction for
    attenuation), at most 1; where a reliability is ``nan`` that side is taken as reliable.
    """
    a = np.sqrt(np.where(np.isfinite(rel_a), rel_a, 1.0))
    b = np.sqrt(np.where(np.isfinite(rel_b), rel_b, 1.0))
    out = corr / (a[:, None] * b[None, :])
    return np.where(np.isfinite(corr), np.minimum(out, 1.0), corr)


#: random subsets drawn by :func:`set_apart_from_kept_cells`'s permutation test
MERGE_PERMUTATIONS = 199
#: at most this many cells of a cluster, and of a type's kept query cells, enter that test
MERGE_TEST_CELLS = 2000


def set_apart_from_kept_cells(
    X: sp.csr_matrix,
    cluster_cells: np.ndarray,
    kept_cells: np.ndarray,
    type_signature: np.ndarray,
    background: np.ndarray,
    alpha: float,
    seed: int,
) -> tuple[bool, float]:
    """Whether a novel cluster matches a known type's signature less well than the query cells
    the type's head kept in the cluster's batch do: a permutation test.

    ``cluster_cells`` and ``kept_cells`` (rows of ``X``, one batch; at most
    :data:`MERGE_TEST_CELLS` of each, drawn at random, enter), ``type_signature`` the type's
    within-batch marker signature (:func:`_signatures`), ``background`` the batch's mean. The
    statistic is the correlation of the cluster's signature with the type's minus that of the
    kept cells' signature. Under the null the cluster and the kept cells are one population
    split at random (a known type whose query cells the fit cut in two): the statistic is then
    that of a random split of the pooled cells into groups of the same two sizes. The p-value
    is the share of :data:`MERGE_PERMUTATIONS` such splits (and the observed one) whose
    statistic is no higher (a smaller group's signature is noisier and correlates less; the
    same sizes in every split account for that). The cluster is set apart when the p-value is
    at most ``alpha`` *and* it matches the type less well than the kept cells outright. The fit
    picked the cluster's cells for looking unlike the known types, so a random split is a
    lenient null: a part of a known type that the fit split off is set apart as often as a
    novel sibling is (development suite: the p-value was at its floor for both), which is why
    :func:`match_known_types` only records the verdict. Returns ``(set apart, p-value)``.
    """
    rng = np.random.default_rng([seed, 0x3E26E])
    if cluster_cells.size > MERGE_TEST_CELLS:
        cluster_cells = np.sort(rng.choice(cluster_cells, MERGE_TEST_CELLS, replace=False))
    if kept_cells.size > MERGE_TEST_CELLS:
        kept_cells = np.sort(rng.choice(kept_cells, MERGE_TEST_CELLS, replace=False))
    if kept_cells.size == 0 or cluster_cells.size == 0:
        return False, 1.0
    pool = np.concatenate([cluster_cells, kept_cells])
    m, n = cluster_cells.size, pool.size
    order = np.stack(
        [np.arange(n)] + [rng.permutation(n) for _ in range(MERGE_PERMUTATIONS)]
    )  # (B + 1, n): the observed split first
    # the pooled rows (at most 2 x MERGE_TEST_CELLS) densified for one BLAS product
    sig = _split_signatures(X[pool].toarray().astype(np.float64), order, m, background)
    r = (sig.reshape(-1, sig.shape[2]) @ type_signature).reshape(-1, 2)
    stat = r[:, 0] - r[:, 1]  # the cluster's match minus the kept cells'
    p = float((stat[1:] <= stat[0]).sum() + 1) / stat.size
    # the fit chose the cluster's cells for looking unlike the type, so a random split is a
    # lenient null; the cluster must also match the type worse than the kept cells outright
    return bool(p <= alpha and stat[0] < 0), p


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
    kept: np.ndarray | None = None,
    alpha: float = _DEFAULTS.novelty_alpha,
    seed: int = 0,
    tested: list | None = None,
    cluster_reliability: np.ndarray | None = None,
) -> list[tuple[int, int, float]]:
    """Novel clusters that are a known type seen in another batch.

    A known type that is rare in the reference but common in the query (or shifted by technology)
    can come out as a novel cluster. Batch effects shift expression levels, but the genes that set
    a type apart from the other cells *of its own batch* are largely the same in every batch. So
    each group gets a within-batch marker signature: its mean expression in its main batch minus
    that batch's mean over all cells. A cluster (``clusters[i]`` for unlabelled cell ``i``,
    ``-1`` elsewhere) whose signature correlates at least ``threshold`` with a known type's (the
    correlation corrected for the noise of the few cells behind either signature:
    :func:`signature_reliability`, :func:`disattenuate`) is that type, provided no cell of the
    type is labelled in the cluster's batch (within one batch the labels already say which cells
    belong to the type, so no cluster is merged there).

    ``background`` (:func:`batch_background`), ``cluster_means`` (the clusters'
    :func:`group_domain_means`) and ``known_means`` (the labelled types'), where the caller has
    them (:func:`naming_means`), are not computed again.

    ``kept`` (``(n_cells,)``: the known type whose head an unlabelled cell outside the
    clusters is assigned to, ``-1`` elsewhere): each merge is also tested against the query
    cells the type's head kept in the cluster's batch (:func:`set_apart_from_kept_cells` at
    ``alpha``), and ``tested`` (a list) receives one record per merge: ``n_kept`` and the
    ``p_value``, and ``set_apart`` where the cluster matches the type less well than they do
    (a novel sibling of the type, or a part of the type that the fit chose for looking unlike
    it: the test cannot tell these apart, so it decides nothing and the merge stands); also the
    correlation before the correction (``raw``) and the labelled cells behind the type's
    signature in its main batch (``n_labelled``).

    ``cluster_reliability`` (:func:`cluster_reliabilities`), where the caller has it, is not
    computed again.

    Returns ``[(cluster, type, correlation), ...]`` for the merged clusters.
    """
    n_domains = int(domain.max()) + 1
    if background is None:
        background = batch_background(X, domain)
    if cluster_means is None:
        cluster_means = group_domain_means(X, clusters, n_clusters, domain, n_domains)
    if known_means is None:  # -1 (unlabelled) is no group
        known_means = group_domain_means(X, labels, n_seen, domain, n_domains)
    known, known_main, known_counts = _signatures(*known_means, background)
    novel, novel_main, novel_counts = _signatures(*cluster_means, background)
    corr = novel @ known.T  # (n_clusters, n_seen) Pearson correlation of the signatures
    raw = corr.copy()
    # as if both signatures were of many cells: few cells behind one attenuate the correlation
    if cluster_reliability is None:
        cluster_reliability = group_reliabilities(
            X, clusters, n_clusters, domain, novel_main, background, seed
        )
    corr = disattenuate(
        corr,
        cluster_reliability,
        group_reliabilities(X, labels, n_seen, domain, known_main, background, seed + 1),
    )
    # a type can only absorb a cluster whose batch has none of the type's labelled cells
    corr[known_counts[:, novel_main].T > 0] = -np.inf
    corr[novel_counts.sum(axis=1) == 0] = -np.inf
    merged = []
    for j in range(n_clusters):  # loop over clusters, not cells
        k = int(np.argmax(corr[j]))
        if corr[j, k] < threshold:
            continue
        merged.append((j, k, float(corr[j, k])))
        if kept is not None and tested is not None:
            b = novel_main[j]
            in_b, own = domain == b, kept == k
            apart, p = set_apart_from_kept_cells(
                X, np.flatnonzero((clusters == j) & in_b), np.flatnonzero(own & in_b),
                known[k], background[b], alpha, seed + j,
            )  # fmt: skip
            tested.append({
                "n_kept": int((own & in_b).sum()), "p_value": p, "set_apart": apart,
                "raw": float(raw[j, k]), "n_labelled": int(known_counts[k, known_main[k]]),
            })  # fmt: skip
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
    seed: int = 0,
    cluster_reliability: np.ndarray | None = None,
) -> list[tuple[int, int, float]]:
    """Novel clusters of different batches that are one novel type (e.g. a type present in two
    queries, found in each): their within-batch marker signatures (as in
    :func:`match_known_types`, the correlation corrected the same way) correlate at least
    ``threshold`` and each is the other's best match among the clusters of the other's batch.
    ``background``, ``cluster_means`` and ``cluster_reliability`` as in
    :func:`match_known_types`; ``seed`` draws the cells of large clusters for their
    reliability. Returns ``[(cluster, same_as, correlation)]`` (``same_as`` the larger of the
    two).
    """
    n_domains = int(domain.max()) + 1
    if n_domains < 2 or n_clusters < 2:
        return []
    if background is None:
        background = batch_background(X, domain)
    if cluster_means is None:
        cluster_means = group_domain_means(X, clusters, n_clusters, domain, n_domains)
    sig, main, counts = _signatures(*cluster_means, background)
    rel = cluster_reliability
    if rel is None:
        rel = group_reliabilities(X, clusters, n_clusters, domain, main, background, seed)
    corr = disattenuate(sig @ sig.T, rel, rel)
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


def too_few_cells(counts: np.ndarray, min_cells: int) -> np.ndarray:
    """The pruning rule: a novel head that won fewer than ``min_cells`` unlabelled cells
    (``counts``, per novel head) is no cluster the data can support; its cells take their next
    most probable head. Returns the mask of the heads pruned.
    """
    return np.asarray(counts) < min_cells
