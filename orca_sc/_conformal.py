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

#: neighbours of the nonconformity score
SCORE_NEIGHBORS = 10
#: a p-value <= alpha puts a cell above all but ``alpha * n`` calibration scores; with fewer
#: than this many calibration cells in that tail the test has no power and says so
MIN_TAIL_CELLS = 5


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
) -> tuple[dict[str, list], list[str]]:
    """Whether the data support each novel cluster as unlike the reference: a one-sided binomial
    test that more than a share ``alpha`` of its cells have ``p <= alpha`` (what known-type
    cells exchangeable with the reference do at most), Benjamini–Hochberg over the clusters.

    ``pvalues``: the unlabelled cells'; ``clusters``: each one's novel cluster (index into
    ``names``; ``-1``: a known type). ``supported`` is ``"significant"`` (q <= alpha), ``"not significant"`` (no
    evidence either way: the test has little power where a novel type is close to a known one), or
    ``"cannot tell"`` when ``alpha * n_calibration`` (the calibration cells in the tail that a
    p-value at ``alpha`` stands on) is under :data:`MIN_TAIL_CELLS`.
    The cells' p-values share one calibration set, so the binomial level is approximate.
    Returns the table (column-wise, storable in ``uns``) and notes for the user.
    """
    from scipy.stats import binom

    n = np.bincount(clusters[clusters >= 0], minlength=len(names))
    k = np.bincount(clusters[clusters >= 0], weights=pvalues[clusters >= 0] <= alpha,
                    minlength=len(names)).astype(np.int64)  # fmt: skip
    pval = np.where(n > 0, binom.sf(k - 1, n, alpha), 1.0)
    qval = benjamini_hochberg(pval)
    can_tell = alpha * n_calibration >= MIN_TAIL_CELLS
    verdict = ["cannot tell" if not can_tell else ("significant" if q <= alpha else "not significant")
               for q in qval]  # fmt: skip
    table = {
        "cluster": list(names),
        "n_cells": n.tolist(),
        "share_p_below_alpha": np.round(k / np.maximum(n, 1), 4).tolist(),
        "pvalue": pval.tolist(),
        "qvalue": qval.tolist(),
        "supported": verdict,
    }
    notes = []
    if names and not can_tell:
        notes.append(
            f"Only {n_calibration} labelled cells calibrate the novelty test: at alpha = "
            f"{alpha:g} its tail rests on fewer than {MIN_TAIL_CELLS} of them, so the data "
            "cannot say whether the novel clusters are unlike the reference "
            "(uns['orca']['novelty_test'], supported: 'cannot tell')."
        )
    unsupported = [c for c, v in zip(names, verdict, strict=True) if v == "not significant"]
    if unsupported:
        notes.append(
            f"Novel clusters {', '.join(unsupported)}: the novelty test does not find their "
            f"cells more unlike the reference than known-type cells (alpha = {alpha:g}). That is "
            "no evidence that they are known types (the test has little power for types close "
            "to a known one), but check them: known types shifted by batch or few labels look "
            "like this too (uns['orca']['novelty_test'])."
        )
    return table, notes
