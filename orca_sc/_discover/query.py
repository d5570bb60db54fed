"""The query vote: in a batch without labelled cells (a separate query), Leiden clusters of the
whole batch become candidates by their share of out-of-distribution cells (the share vote and
its test), where their cells score below the cross-fitted cosines of the known type that
claims them and below that type's other cells in the batch (the contrast vote), or where that
type's labelled cells lack the state that sets the cluster apart from the type's other cells in
the batch (the absence vote).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

from .._ablation import DiscoveryRules
from .._conformal import CrossConformal
from .._notes import Note
from .graph import leiden
from .ood import cells_for_quantile

_DEFAULTS = DiscoveryRules()


def spread_notes(votes: list[dict], batch_names: list[str],
                 class_names: list[str] | None) -> list[str]:  # fmt: skip
    """Where the share vote's test left out clusters of a query batch
    (``votes`` of :func:`query_ood_clusters`: taken by the share vote, no candidate): many of
    their cells sit below their type's threshold, but as a whole they score like its labelled
    cells, as a known type that a condition or stimulation spreads does. They stay known; the user is told
    which, so that a type the reference lacks and a known type absorbs can be checked.
    """
    notes = []
    for d in sorted({v["batch"] for v in votes}):  # loop over query batches
        # a share-vote cluster is no candidate only where its test left it out
        left = [v for v in votes if v["batch"] == d and v["share"] and not v["candidate"]]
        if not left:
            continue
        parts = [
            f"{v['cells']} cells"
            + (
                ""
                if v["type"] is None or class_names is None
                else f" of '{class_names[v['type']]}'"
            )
            + f" ({v['flagged']:.0%} below the threshold, mean p {v['mean_p']:.2f})"
            for v in left
        ]
        notes.append(
            Note(
                f"Query batch '{batch_names[d]}': {len(left)} spread cluster(s) of "
                f"{sum(v['cells'] for v in left):,} cells kept known; check their markers "
                "(uns['orca']['estimate']['query_votes']).",
                f"In query batch '{batch_names[d]}', {len(left)} cluster(s) had many cells below "
                f"their type's threshold but score like its labelled cells as a whole: "
                f"{'; '.join(parts)}. They stay known (a condition or stimulation that spreads a "
                f"known type looks like this); if one is a type the reference lacks, check its "
                f"markers (uns['orca']['estimate']['query_votes']).",
            )
        )
    return notes


#: the conformal vote: a query cluster is a candidate when its cells' mean conformal p-value is
#: at most this, i.e. they score below the unseen labelled cells of the types that claim them
#: with at least a medium effect (AUROC 0.64, Cohen's d = 0.5 between normal scores) ...
QUERY_MEAN_P = 0.36


#: ... and the mean is below 1/2, its value for exchangeable cells, by a one-sided z-test at
#: this level, Bonferroni-corrected over the batch's clusters (a few cells cannot show it)
QUERY_LEVEL = 0.01


def query_pvalues(
    maxcos: np.ndarray,
    predicted: np.ndarray,
    labels: np.ndarray,
    held_out: np.ndarray,
    domain: np.ndarray,
    cells: np.ndarray,
    shift: dict[int, list[float | None]],
    min_cells: int,
) -> np.ndarray:
    """Each of ``cells``' conformal p-value of novelty: the share of the held-out cosines of the
    known type whose head scores it best (``predicted``) at or below its own best cosine, raised
    by its batch's shift of that type (:func:`type_thresholds`), ``(1 + k) / (m + 1)``. Uniform
    for a cell exchangeable with that type's labelled cells; low for a cell that scores below
    them. NaN where the type has fewer than ``min_cells`` held-out cosines, and outside ``cells``.
    Returns an array over all cells.
    """
    p = np.full(maxcos.shape[0], np.nan)
    claimed, batch = predicted[cells], domain[cells]
    for t in np.unique(claimed):  # loop over known types, not cells
        ht = held_out[(labels == t) & np.isfinite(held_out)]
        if ht.size < min_cells:
            continue
        for d in np.unique(batch):  # loop over batches
            rows = cells[(claimed == t) & (batch == d)]
            # nonconformity = minus the cosine: p = (1 + #{held-out <= the cell's}) / (m + 1)
            counts = CrossConformal(rows.size)
            counts.add(-ht, -(maxcos[rows] - (shift[int(d)][t] or 0.0)))
            p[rows] = counts.pvalues()
    return p


#: the share vote's test reads a cluster with at least this many conformal p-values: with fewer
#: the exact test cannot confirm a cluster of novel cells (at level 0.05 it needs a mean p below
#: 0.16 from 2 values, below 0.29 from 5; the novel clusters' cells score 0.01-0.2)
SHARE_TEST_MIN_VALUES = 5


#: from this many p-values on, the test of their mean is the normal approximation
MEAN_TEST_NORMAL_FROM = 20


@functools.cache
def _irwin_hall(n: int):
    """The distribution of the sum of ``n`` independent uniforms on [0, 1]."""
    from scipy.stats import irwinhall

    return irwinhall(n)


def mean_p_below_half(p: np.ndarray) -> float:
    """One-sided test that the conformal p-values ``p`` (:func:`query_pvalues`) have a mean
    below 1/2, their mean for cells exchangeable with the labelled cells: under that null
    their sum is at least as large as that of as many independent uniforms (the p-values are
    super-uniform), whose distribution is the Irwin-Hall's. Exact below
    :data:`MEAN_TEST_NORMAL_FROM` values (``scipy.stats.irwinhall``), its normal approximation
    (a z-test, standard deviation of a uniform 1/sqrt(12)) from there. Returns the p-value.
    """
    if p.size < MEAN_TEST_NORMAL_FROM:
        return float(_irwin_hall(p.size).cdf(float(p.sum())))
    z = (0.5 - float(p.mean())) * math.sqrt(12 * p.size)
    return 0.5 * math.erfc(z / math.sqrt(2))


def conformal_vote(p: np.ndarray, n_clusters: int) -> tuple[bool, float]:
    """Whether a cluster whose cells have the conformal p-values ``p`` (:func:`query_pvalues`)
    scores below the labelled cells: mean p at most :data:`QUERY_MEAN_P` and below 1/2 by
    :func:`mean_p_below_half` at :data:`QUERY_LEVEL` / ``n_clusters``. Returns the decision
    and the mean.
    """
    mean = float(p.mean())
    pval = mean_p_below_half(p)
    return bool(mean <= QUERY_MEAN_P and pval <= QUERY_LEVEL / max(n_clusters, 1)), mean


def _mode(values: np.ndarray) -> int:
    """The most common value (the smallest of those tied)."""
    types, counts = np.unique(values, return_counts=True)
    return int(types[np.argmax(counts)])


def _auc_below(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """The probability that an ``x`` is above a ``y`` (ties count half) and the one-sided
    Mann-Whitney p-value that the ``x`` are lower.
    """
    from scipy.stats import mannwhitneyu

    res = mannwhitneyu(x, y, alternative="less")
    return float(res.statistic) / (x.size * y.size), float(res.pvalue)


def contrast_vote(
    p: np.ndarray,
    claimed: np.ndarray,
    inside: np.ndarray,
    outside: np.ndarray,
    n_clusters: int,
    min_cells: int,
) -> tuple[bool, float | None]:
    """Whether a cluster's cells score below the batch's other cells of the known type that
    claims most of them: the conformal p-values ``p`` (:func:`query_pvalues`, finite) of the
    cluster's cells (``inside``) claimed by that type are lower than those of the type's cells
    in ``outside`` (the query vote passes the cells of the clusters that the conformal vote
    does not flag, so that other novel clusters under the same head are not the comparison), by a one-sided Mann-Whitney test at :data:`QUERY_LEVEL` /
    ``n_clusters`` with at least a medium effect (the probability that a cluster cell's p is
    above an outside cell's at most :data:`QUERY_MEAN_P`). A known type whose cells the batch
    shifts as a whole scores below its labelled cells but not below itself; a novel type that a
    known type's head claims scores below that type's own cells in the batch. Where the type
    has fewer than ``min_cells`` cells on either side there is nothing to compare with: no.
    Returns the decision and the probability (``None``: not compared).
    """
    t = _mode(claimed[inside])
    x, y = p[inside & (claimed == t)], p[outside & ~inside & (claimed == t)]
    if x.size < min_cells or y.size < min_cells:
        return False, None
    auc, pval = _auc_below(x, y)
    return bool(auc <= QUERY_MEAN_P and pval <= QUERY_LEVEL / max(n_clusters, 1)), auc


#: the absence vote's null: the labelled cells of the known type that claims a query cluster hold
#: the cluster's state at least this many times as often as the type's cells in the batch do (a
#: reference may hold one of its type's states four times less often than a query does)
ABSENCE_COMPOSITION = 0.25


def absence_pvalue(inside: np.ndarray, outside: np.ndarray, labelled: np.ndarray) -> float | None:
    """The absence vote's p-value: that the labelled cells of the known type that claims a query
    cluster hold the state that sets the cluster apart from the type's other cells in the
    batch. ``inside``: the cluster's cells the type claims, ``outside``: the batch's other cells
    it claims, ``labelled``: the type's labelled cells, rows of one PCA of the labelled cells
    and the batch. On the axis from the outside cells' centre to the inside cells', a labelled
    cell past the midpoint has the cluster's state. Null: the cluster is a state of the type,
    which a share of its labelled cells holds of at least :data:`ABSENCE_COMPOSITION` times the
    cluster's share of the type's cells in the batch; the p-value is the exact binomial test's
    of the labelled cells past the midpoint. A shift of the batch across the axis does not move a cell
    along it (one along it as large as half the distance does); a novel type that a known
    type's head claims sits past the midpoint with no labelled cell of that type, a piece of
    the type with some. Only a cluster that is the smaller part of the type's cells in the batch
    is read (the larger part is taken to be the type itself). ``None``: not read.
    """
    n_in, n_out, n_lab = inside.shape[0], outside.shape[0], labelled.shape[0]
    if n_in < 2 or n_out < n_in or n_lab == 0:
        return None
    centre = outside.mean(axis=0)
    axis = inside.mean(axis=0) - centre
    length = float(axis @ axis)
    if length <= 0:
        return None
    past = int(((labelled - centre) @ axis > 0.5 * length).sum())
    from scipy.stats import binom

    return float(binom.cdf(past, n_lab, ABSENCE_COMPOSITION * n_in / (n_in + n_out)))


def sampled_clusters(
    emb: np.ndarray,
    resolution: float,
    seed: int,
    n_neighbors: int,
    max_cells: int | None,
    stream: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Leiden cluster codes of the rows of ``emb`` cut on at most ``max_cells`` of them: a batch
    of more rows is clustered on a random sample of ``max_cells`` rows (drawn from the run's
    ``seed`` and the batch's ``stream``), and every other row takes the cluster most of its
    ``n_neighbors`` nearest sample rows hold (the smallest code of those tied). A fixed
    resolution cuts more clusters the more cells carry the same types; cut on a sample of fixed
    size, the clusters are those of a batch of that size. Returns the codes of every row and
    the mask of the sample's rows (the rows that vote; all of them when ``max_cells`` is
    ``None`` or not exceeded).
    """
    n = emb.shape[0]
    if max_cells is None or n <= max_cells:
        return leiden(emb, resolution, seed, n_neighbors=n_neighbors), np.ones(n, dtype=bool)
    from sklearn.neighbors import NearestNeighbors

    rng = np.random.default_rng([seed, stream, 0x51])
    voters = np.zeros(n, dtype=bool)
    voters[rng.choice(n, max_cells, replace=False)] = True
    sample = np.flatnonzero(voters)
    codes = np.empty(n, dtype=np.int64)
    codes[sample] = leiden(emb[sample], resolution, seed, n_neighbors=n_neighbors)
    rest = np.flatnonzero(~voters)
    nb = NearestNeighbors(n_neighbors=n_neighbors).fit(emb[sample])
    k = int(codes[sample].max()) + 1
    for lo in range(0, rest.size, 8192):  # chunks of rows: a (chunk, k) count table each
        rows = rest[lo : lo + 8192]
        near = codes[sample][nb.kneighbors(emb[rows], return_distance=False)]
        flat = (np.arange(rows.size)[:, None] * k + near).ravel()
        codes[rows] = np.bincount(flat, minlength=rows.size * k).reshape(rows.size, k).argmax(1)
    return codes, voters


def query_ood_clusters(
    ood: np.ndarray,
    cells: np.ndarray,
    domain: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    min_fraction: float = _DEFAULTS.query_min_fraction,
    min_enrichment: float = _DEFAULTS.query_min_enrichment,
    resolution: float | dict[int, float] = _DEFAULTS.query_resolution,
    seed: int = 0,
    n_neighbors: int = _DEFAULTS.n_neighbors,
    pvalues: np.ndarray | None = None,
    min_cells: int = cells_for_quantile(_DEFAULTS.novelty_alpha),
    votes: list[dict] | None = None,
    claimed: np.ndarray | None = None,
    share_level: float | None = None,
    max_cells: int | None = _DEFAULTS.query_vote_cells,
    drop: tuple[str, ...] = (),
    joint_pca: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
    labelled_types: np.ndarray | None = None,
    absence_level: float = _DEFAULTS.novelty_alpha,
) -> list[np.ndarray]:
    """Candidate novel clusters of batches without labelled cells, decided per cluster.

    In a query batch, expression shifted by the batch makes some cells of known types score
    poorly on the seen heads, while the seen heads absorb many cells of a novel type (a classifier
    of two types scores a third confidently). Cell by cell, out-of-distribution calls are noisy
    both ways; a cluster of the batch's cells takes a vote. All ``cells`` of each query batch are
    clustered (Leiden on the PCA of that batch's cells, ``pca_of(idx)``), which keeps types
    apart better than clustering only the out-of-distribution cells. A cluster is a candidate
    when at least ``min_fraction`` of its cells are out-of-distribution (``ood``), or
    ``min_enrichment`` times the batch's overall fraction (the share vote); with ``pvalues``
    (every cell's conformal p-value, :func:`query_pvalues`; NaN where it has none), a cluster
    with at least ``min_cells`` of them is also one when :func:`conformal_vote` says its cells
    score below the labelled cells. The share vote reads a threshold that follows how closely
    the warm-up fitted its labelled cells, which falls as the data grow; the conformal vote
    reads the cells' scores against labelled cells no net trained on, so it does not. Such a
    cluster must also (the contrast vote; ``claimed``, each cell's best seen head, is then
    required) score below the cells of the type that claims it in the batch's clusters the
    conformal vote does not flag (:func:`contrast_vote`). With ``share_level``, a cluster the
    share vote takes that has p-values (at least :data:`SHARE_TEST_MIN_VALUES`) must also have
    their mean below 1/2 (:func:`mean_p_below_half`) at that level: the share vote counts the
    cells in the tail below the threshold, which a known type whose cosines the batch spreads
    fills too, while its cells as a whole score like the labelled cells. ``votes``: a list to
    which each cluster's size, mean p-value (``None``: under :data:`SHARE_TEST_MIN_VALUES` of
    them), contrast probability (``None``: not compared), the share vote's decision, its
    test's p-value (``None``: not tested) and the decision are appended. With ``max_cells``, a larger batch is clustered on a sample of that many cells
    (:func:`sampled_clusters`) and each cluster is voted on its sample cells alone: every vote
    then reads as many cells as in a batch of ``max_cells``, and a candidate holds all the cells
    its cluster took. With ``joint_pca`` (the rows of one PCA of the labelled cells and of the
    given cells of a batch: those of the batch's cells, those of the labelled cells) and
    ``labelled_types`` (the labelled cells' types, in its order), a cluster the other votes
    leave, of a known type they give no candidate in the batch, is also a candidate when that
    type, which claims most of its cells, lacks its state in its labelled cells (the absence
    vote, :func:`absence_pvalue` at ``absence_level`` over the clusters it reads;
    ``claimed`` is then required). ``drop`` (an ablation) switches off ``"share_vote"`` or
    ``"contrast_vote"`` (the conformal and contrast votes). ``resolution``: one for every
    batch, or each batch's. Returns the index arrays of the candidates' cells.
    """
    if (pvalues is not None or joint_pca is not None) and claimed is None:
        msg = "the contrast and absence votes compare a cluster with its type's cells: pass claimed"
        raise ValueError(msg)
    absence = joint_pca is not None
    found: list[np.ndarray] = []
    for d in np.unique(domain[cells]):  # loop over batches, not cells
        idx = cells[domain[cells] == d]
        if idx.size < 2:  # a batch of one cell is not clustered
            continue
        res = resolution[int(d)] if isinstance(resolution, dict) else resolution
        codes, voters = sampled_clusters(pca_of(idx), res, seed, n_neighbors, max_cells,
                                         stream=int(d))  # fmt: skip
        members = idx  # every cell of the batch, by cluster; the votes read the sample's cells
        idx, codes_all, codes = idx[voters], codes, codes[voters]
        overall = ood[idx].mean()
        clusters = np.unique(codes)
        # the conformal vote of each cluster first: the contrast compares a flagged cluster
        # with its type's cells in the clusters this vote leaves
        conformal, below_half, means = {}, {}, {}
        for c in clusters:
            pc = None if pvalues is None else pvalues[idx[codes == c]]
            if pc is None:
                continue
            pc = pc[np.isfinite(pc)]
            if pc.size >= min_cells:
                conformal[c] = conformal_vote(pc, clusters.size)[0]
            if pc.size >= min(min_cells, SHARE_TEST_MIN_VALUES):
                below_half[c], means[c] = mean_p_below_half(pc), float(pc.mean())
        if conformal:  # the contrast reads the finite p-values only
            fin = np.isfinite(pvalues[idx])
            p_fin, claimed_fin, codes_fin = pvalues[idx][fin], claimed[idx][fin], codes[fin]
            leaves = ~np.isin(codes_fin, [c for c, low in conformal.items() if low])
        batch_votes = []
        for c in clusters:
            m = idx[codes == c]  # the cluster's voters
            frac = ood[m].mean()
            # the share vote: enough of its cells below their threshold ...
            share = bool(frac >= min_fraction or frac >= min_enrichment * overall)
            share = share and "share_vote" not in drop
            # ... and, where they have p-values, scoring below the labelled cells as a whole
            share_p = below_half.get(c) if share and share_level is not None else None
            share_test = share_p is None or share_p <= share_level
            # the conformal vote: its cells score below the labelled cells of their type
            conformal_low, mean = conformal.get(c, False), means.get(c)
            conformal_low = conformal_low and "contrast_vote" not in drop
            # the contrast: below that type's cells in the batch's other clusters
            contrast_low, auc = True, None
            if conformal_low:
                contrast_low, auc = contrast_vote(
                    p_fin, claimed_fin, codes_fin == c, leaves, clusters.size, min_cells
                )
            take = (share and share_test) or (conformal_low and contrast_low)
            batch_votes.append({"batch": int(d), "cells": int((codes_all == c).sum()),
                                "voters": int(m.size), "mean_p": mean,
                                "contrast_auc": auc, "share": share,
                                "share_test_p": share_p, "absence_p": None,
                                "candidate": take, "flagged": float(frac),
                                "type": None if claimed is None else _mode(claimed[m])})  # fmt: skip
        if absence:  # after the other votes, one PCA of the labelled cells and the voters
            _absence_votes(batch_votes, clusters, codes, claimed[idx], *joint_pca(idx),
                           labelled_types, absence_level)  # fmt: skip
        for c, vote in zip(clusters, batch_votes, strict=True):
            if votes is not None:
                votes.append(vote)
            if vote["candidate"]:
                found.append(members[codes_all == c])
    return found


def _absence_votes(batch_votes: list[dict], clusters: np.ndarray, codes: np.ndarray,
                   claimed: np.ndarray, z_batch: np.ndarray, z_labelled: np.ndarray,
                   labelled_types: np.ndarray, level: float) -> None:  # fmt: skip
    """The absence vote of each of a batch's clusters (``codes`` and ``claimed`` of its voters,
    rows of ``z_batch``) that the other votes left, where they gave no cluster of the type that
    claims it a candidate (a type's novel head started at one candidate wins that candidate's
    neighbours in the fit; a second head for another piece of the same novel type would split
    it): :func:`absence_pvalue` at ``level`` over the clusters it reads (Bonferroni).
    ``batch_votes`` (in the order of ``clusters``) are updated in place.
    """
    headed = {v["type"] for v in batch_votes if v["candidate"]}
    for c, vote in zip(clusters, batch_votes, strict=True):
        t = vote["type"]
        if not vote["candidate"] and t not in headed:
            mine = claimed == t
            vote["absence_p"] = absence_pvalue(
                z_batch[mine & (codes == c)], z_batch[mine & (codes != c)],
                z_labelled[labelled_types == t],
            )  # fmt: skip
    read = [v for v in batch_votes if v["absence_p"] is not None]
    for vote in read:
        vote["candidate"] = vote["absence_p"] <= level / len(read)


def _query_candidates(ood, query, domain, pca_cells, cfg: DiscoveryRules, seed: int,
                      pvalues=None, votes=None, claimed=None, resolution=None,
                      labels=None) -> list[np.ndarray]:  # fmt: skip
    """Candidates of the batches without labelled cells (none when there are none); with
    ``cfg.absence_vote``, ``labels`` (every cell's, -1: unlabelled) and ``claimed``, the absence
    vote reads the labelled cells.
    """
    if not query.any():
        return []
    joint_pca, labelled_types = None, None
    if cfg.absence_vote and labels is not None and claimed is not None:
        lab = np.flatnonzero(labels >= 0)
        labelled_types = labels[lab]

        def joint_pca(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            z = pca_cells(np.concatenate([lab, idx]))
            return z[lab.size :], z[: lab.size]

    return query_ood_clusters(
        ood, np.flatnonzero(query), domain, pca_cells,
        min_fraction=cfg.query_min_fraction, min_enrichment=cfg.query_min_enrichment,
        resolution=cfg.query_resolution if resolution is None else resolution, seed=seed,
        n_neighbors=cfg.n_neighbors, pvalues=pvalues,
        min_cells=cells_for_quantile(cfg.novelty_alpha), votes=votes, claimed=claimed,
        share_level=None if "share_test" in cfg.drop else cfg.novelty_alpha,
        max_cells=cfg.query_vote_cells, drop=cfg.drop, joint_pca=joint_pca,
        labelled_types=labelled_types, absence_level=cfg.novelty_alpha,
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
