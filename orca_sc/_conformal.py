"""Novelty with a stated error rate: cross-fitted conformal p-values and Benjamini–Hochberg.

A cell's nonconformity score is its mean cosine distance to its ``k`` nearest labelled cells in
an embedding trained on labelled cells. Scored against the cells a net was trained on, labelled
cells look closer than new cells of their type ever do, so the scores of labelled cells are
*cross-fitted*: the labelled cells are split into ``K`` folds (stratified by type), a net is
trained without each fold, and the cells of that fold are scored in it against the labelled
cells it was trained on. Every labelled cell is then a calibration cell and none is lost to
training. A query cell is scored in each fold's net against the same labelled cells, and its
p-value is the cross-conformal one (Vovk, Ann. Math. Artif. Intell. 2015)::

    p(x) = (1 + #{fold f, cell i in f : s_f(i) >= s_f(x)}) / (n_labelled + 1)

When a query cell and the labelled cells of its type are exchangeable, ``P(p <= a) <= a`` (up to
the small slack of cross-conformal prediction), so calling cells novel at ``p <= a`` calls at
most a share ``a`` of known-type cells novel; :func:`benjamini_hochberg` controls the false
discovery rate of the novel calls over the query. Arrays in, arrays out: no torch, no AnnData.
"""

from __future__ import annotations

import numpy as np

from ._notes import Note

#: neighbours of the nonconformity score
SCORE_NEIGHBORS = 10
#: a p-value <= alpha puts a cell above all but ``alpha * n`` calibration scores; with fewer
#: than this many calibration cells in that tail the test has no power and says so
MIN_TAIL_CELLS = 5


def tail_supported(alpha: float, n_calibration: int) -> bool:
    """Whether the calibration cells in the tail that a p-value at ``alpha`` stands on
    (``alpha * n_calibration``) are at least :data:`MIN_TAIL_CELLS`: else the test cannot tell.
    """
    return alpha * n_calibration >= MIN_TAIL_CELLS


def exchangeable_bound(alpha: float) -> float:
    """The most share of cells exchangeable with the labelled ones that get ``p <= alpha``
    from cross-fitted p-values: ``2 * alpha`` (Barber et al., Ann. Stat. 2021), at most 1.
    """
    return min(2 * alpha, 1.0)


def excess_pvalue(k: int, n: int, alpha: float) -> float:
    """One-sided binomial test that more than :func:`exchangeable_bound` of ``n`` cells have
    ``p <= alpha`` when ``k`` of them do: its p-value (1 where there are no cells).
    """
    from scipy.stats import binom

    return float(binom.sf(k - 1, n, exchangeable_bound(alpha))) if n else 1.0


def fold_ids(labels: np.ndarray, n_folds: int, seed: int = 0) -> np.ndarray:
    """Fold (``0 .. n_folds-1``) of every labelled cell, ``-1`` for unlabelled ones: each type's
    cells are shuffled and dealt round-robin, starting where the previous type stopped, so that
    folds have nearly equal sizes and every type is spread over as many folds as it has cells.
    """
    rng = np.random.default_rng(seed)
    folds = np.full(labels.shape[0], -1, dtype=np.int64)
    start = 0
    for k in np.unique(labels[labels >= 0]):  # loop over types, not cells
        idx = rng.permutation(np.flatnonzero(labels == k))
        folds[idx] = (start + np.arange(idx.size)) % n_folds
        start = (start + idx.size) % n_folds
    return folds


class CrossConformal:
    """Accumulates the cross-conformal counts fold by fold (:meth:`add`), then gives p-values
    (:meth:`pvalues`): the nets need not be kept.
    """

    def __init__(self, n_test: int) -> None:
        self.greater_equal = np.zeros(n_test, dtype=np.int64)
        self.n_calibration = 0

    def add(self, calibration: np.ndarray, test: np.ndarray) -> None:
        """One fold: the scores of its held-out labelled cells and of the test cells."""
        ordered = np.sort(calibration)
        self.greater_equal += ordered.size - np.searchsorted(ordered, test, side="left")
        self.n_calibration += ordered.size

    def pvalues(self) -> np.ndarray:
        return (1.0 + self.greater_equal) / (self.n_calibration + 1.0)


def benjamini_hochberg(pvalues: np.ndarray) -> np.ndarray:
    """Benjamini–Hochberg adjusted p-values (q-values): the cells with ``q <= alpha`` are the
    discoveries at false discovery rate ``alpha``.
    """
    p = np.asarray(pvalues, dtype=np.float64)
    if p.size == 0:
        return p.copy()
    order = np.argsort(p, kind="stable")
    ranked = p[order] * p.size / np.arange(1, p.size + 1)
    q = np.minimum.accumulate(ranked[::-1])[::-1]
    out = np.empty_like(p)
    out[order] = np.minimum(q, 1.0)
    return out


def cluster_support(
    pvalues: np.ndarray,
    clusters: np.ndarray,
    names: list[str],
    alpha: float,
    n_calibration: int,
    baseline: list[tuple[int, int] | None] | None = None,
) -> tuple[dict[str, list], list[str]]:
    """Whether the data support each novel cluster as unlike the reference: a one-sided binomial
    test that more than a share ``alpha`` of its cells have ``p <= alpha`` (what known-type
    cells exchangeable with the reference do at most), Benjamini–Hochberg over the clusters.
    ``baseline`` (per cluster, ``None`` or the counts ``(k, n)`` of cells labelled a known type
    with ``p <= alpha`` in its batch): where that batch's known cells score unlike the reference
    too (:func:`premise_check` fails), the cluster is compared with them instead, by Fisher's
    exact test (one-sided: a larger share than theirs); ``compared_with`` says which.

    ``pvalues``: the unlabelled cells'; ``clusters``: each one's novel cluster (index into
    ``names``; ``-1``: a known type). ``supported`` is ``"significant"`` (q <= alpha), ``"not significant"`` (no
    evidence either way: the test has little power where a novel type is close to a known one), or
    ``"cannot tell"`` when ``alpha * n_calibration`` (the calibration cells in the tail that a
    p-value at ``alpha`` stands on) is under :data:`MIN_TAIL_CELLS`.
    The cells' p-values share one calibration set, so the binomial level is approximate.
    Returns the table (column-wise, storable in ``uns``) and notes for the user.
    """
    from scipy.stats import binom, fisher_exact

    n = np.bincount(clusters[clusters >= 0], minlength=len(names))
    k = np.bincount(clusters[clusters >= 0], weights=pvalues[clusters >= 0] <= alpha,
                    minlength=len(names)).astype(np.int64)  # fmt: skip
    pval = np.where(n > 0, binom.sf(k - 1, n, alpha), 1.0)
    compared = ["alpha"] * len(names)
    for j, base in enumerate(baseline or []):  # loop over clusters
        if base is not None and n[j] > 0:
            k0, n0 = base
            table0 = [[int(k[j]), int(n[j] - k[j])], [int(k0), int(n0 - k0)]]
            pval[j] = fisher_exact(table0, alternative="greater").pvalue
            compared[j] = "known cells of its batch"
    qval = benjamini_hochberg(pval)
    can_tell = tail_supported(alpha, n_calibration)
    verdict = ["cannot tell" if not can_tell else ("significant" if q <= alpha else "not significant")
               for q in qval]  # fmt: skip
    table = {
        "cluster": list(names),
        "n_cells": n.tolist(),
        "share_p_below_alpha": np.round(k / np.maximum(n, 1), 4).tolist(),
        "pvalue": pval.tolist(),
        "qvalue": qval.tolist(),
        "compared_with": compared,
        "supported": verdict,
    }
    notes = []
    if names and not can_tell:
        notes.append(
            Note(
                f"Only {n_calibration} labelled cells calibrate the novelty test: it cannot tell "
                "(uns['orca']['novelty_test']).",
                f"Only {n_calibration} labelled cells calibrate the novelty test: at alpha = "
                f"{alpha:g} its tail rests on fewer than {MIN_TAIL_CELLS} of them, so the data "
                "cannot say whether the novel clusters are unlike the reference "
                "(uns['orca']['novelty_test'], supported: 'cannot tell').",
            )
        )
    unsupported = [c for c, v in zip(names, verdict, strict=True) if v == "not significant"]
    if unsupported:
        notes.append(
            Note(
                f"Novelty test not significant for {', '.join(unsupported)}: no evidence either "
                "way (uns['orca']['novelty_test']).",
                f"Novel clusters {', '.join(unsupported)}: the novelty test does not find their "
                f"cells more unlike the reference than known-type cells (alpha = {alpha:g}). That is "
                "no evidence that they are known types (the test has little power for types close "
                "to a known one), but check them: known types shifted by batch or few labels look "
                "like this too (uns['orca']['novelty_test']).",
            )
        )
    return table, notes


def premise_check(
    pvalues: np.ndarray,
    known: np.ndarray,
    batch: np.ndarray,
    batch_names: list[str],
    alpha: float,
    n_calibration: int,
) -> tuple[dict[str, list], list[str], dict[int, tuple[int, int]]]:
    """Whether the test's premise holds in each batch of unlabelled cells: that the cells the
    run labels a known type are exchangeable with that type's labelled cells, so that about a
    share ``alpha`` of them, and never more than ``2 * alpha`` (the bound cross-fitted
    conformal p-values keep under exchangeability; Barber et al., Ann. Stat. 2021), have
    ``p <= alpha``. A one-sided binomial test of more than ``2 * alpha``, per batch, at level
    ``alpha`` (Bonferroni over the batches); the cells called novel are left out, which can only
    lower the share. Where it fails, the query's known types do not look like the reference's
    (a batch, technology or condition shift), or known labels hold cells of a type the
    reference lacks: either way the test's error rate does not hold there.

    ``pvalues``, ``known`` (labelled a known type) and ``batch`` (code into ``batch_names``):
    the unlabelled cells'. ``holds`` is ``"holds"``, ``"fails"`` or ``"cannot tell"`` (too few
    calibration cells for the tail, as in :func:`cluster_support`, or no cell labelled a known
    type). The cells' p-values share one calibration set, so the binomial level is approximate.
    Returns the table (column-wise, storable in ``uns``), notes for the user, and per batch
    code where it fails the counts ``(k, n)`` of its known-labelled cells with ``p <= alpha``
    and in all (the ``baseline`` of :func:`cluster_support`).
    """
    bound = exchangeable_bound(alpha)
    codes = np.unique(batch)
    failing: dict[int, tuple[int, int]] = {}
    can_tell = tail_supported(alpha, n_calibration)
    table: dict[str, list] = {k: [] for k in ("batch", "n_known", "share_p_below_alpha",
                                              "pvalue", "holds")}  # fmt: skip
    for d in codes:  # loop over batches, not cells
        cells = known & (batch == d)
        n, k = int(cells.sum()), int((pvalues[cells] <= alpha).sum())
        pval = excess_pvalue(k, n, alpha)
        holds = "cannot tell" if not (can_tell and n) else (
            "fails" if pval <= alpha / codes.size else "holds")  # fmt: skip
        if holds == "fails":
            failing[int(d)] = (k, n)
        for key, v in zip(table, (batch_names[d], n, round(k / max(n, 1), 4), pval, holds),
                          strict=True):  # fmt: skip
            table[key].append(v)
    failed = [i for i, h in enumerate(table["holds"]) if h == "fails"]
    notes = []
    if failed:
        where = ", ".join(
            f"'{table['batch'][i]}' ({table['share_p_below_alpha'][i]:.0%} of "
            f"{table['n_known'][i]:,})"
            for i in failed
        )
        notes.append(
            Note(
                f"The novelty test's premise fails in batch(es) {where}: read its p-values as a "
                "ranking (uns['orca']['novelty_test']['premise']).",
                f"The novelty test's premise fails in batch(es) {where}: that share of the cells "
                f"labelled a known type have p <= {alpha:g}, more than cells that look like the "
                f"reference's labelled cells ever do (at most {bound:.0%}; binomial test). There the "
                "query's known types are shifted from the reference's (batch, technology, condition) "
                "or known labels hold cells of a type the reference lacks, so the test's error rate "
                "does not hold: read its p-values and verdicts as a ranking "
                "(uns['orca']['novelty_test']['premise']).",
            )
        )
    return table, notes, failing


def cell_calls(
    pvalues: np.ndarray, qvalues: np.ndarray, alpha: float, n_calibration: int
) -> tuple[dict[str, float | int], list[str]]:
    """What the per-cell q-values call, and a note where they cannot single out cells the
    p-values say are there: more unlabelled cells have ``p <= alpha`` than cells like the
    labelled ones ever give (a one-sided binomial test of more than ``2 * alpha``, the bound of
    cross-fitted p-values, at level ``alpha``) but no cell has ``q <= alpha``. A p-value is at
    least ``1 / (n_calibration + 1)``, and Benjamini-Hochberg calls a cell among ``m`` only at
    ``p <= alpha * r / m`` (``r`` the cells called): new cells must score above all but a few
    labelled cells, which labelled cells of rare types and a type's outliers often outscore.

    ``pvalues``, ``qvalues``: the unlabelled cells'. Returns the counts for the record and the
    notes for the user.
    """
    m = int(pvalues.size)
    k = int((pvalues <= alpha).sum())
    called = int((qvalues <= alpha).sum())
    smallest = float(qvalues.min()) if m else 1.0
    record = {"n_called": called, "smallest_qvalue": smallest}
    bound = exchangeable_bound(alpha)
    excess = excess_pvalue(k, m, alpha) <= alpha
    if called or not excess or not tail_supported(alpha, n_calibration):
        return record, []
    share = k / m
    note = Note(
        f"No cell is novel on its own at q <= {alpha:g} (smallest q {smallest:.2f}), though "
        f"{share:.0%} of the unlabelled cells have p <= {alpha:g}: read the clusters' verdicts "
        "(uns['orca']['novelty_test']).",
        f"{share:.0%} of the unlabelled cells have a novelty p-value <= {alpha:g}, more than "
        f"cells like the reference's labelled ones ever give (at most {bound:.0%}; "
        f"binomial test), but the Benjamini-Hochberg q-values single out none of them "
        f"(smallest q {smallest:.2f}). With {n_calibration:,} labelled cells a p-value is at "
        f"least 1/{n_calibration + 1:,}, and among {m:,} cells a cell is called only when it "
        "scores above all but a few labelled cells; labelled cells of rare types and a type's "
        "outliers score as high as new cells do. So obs['orca_novelty_qvalue'] calls nothing "
        "here: read obs['orca_novelty_pvalue'] as a ranking and the novel clusters' verdicts "
        "(uns['orca']['novelty_test']['clusters'], uns['orca']['novel_evidence']).",
    )
    return record, [note]
