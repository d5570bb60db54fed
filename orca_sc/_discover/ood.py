"""Candidates from the seen heads: unlabelled cells whose best cosine to a seen head is below the
threshold of the labelled cells' (:func:`ood_threshold`, calibrated on held-out labelled cells
where there are enough), clustered (:func:`ood_clusters`); in batches without labels, clusters of
the batch voted by their share of such cells (:func:`query_ood_clusters`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .._ablation import DiscoveryRules
from .._notes import Note
from .graph import leiden

_DEFAULTS = DiscoveryRules()


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


def cells_for_quantile(rate: float) -> int:
    """The fewest cells whose ``rate`` quantile can fall below all of them (``1 / rate``, that
    many); thresholds read from fewer are not used.
    """
    return math.ceil(1 / rate - 1e-9)


def ood_threshold(
    maxcos: np.ndarray,
    train: np.ndarray,
    calibration: np.ndarray,
    cfg: DiscoveryRules,
    held_out: np.ndarray | None = None,
) -> tuple[float, dict[str, float]]:
    """The out-of-distribution threshold on the best cosine to a seen head: the
    ``cfg.ood_quantile`` of the labelled cells the warm-up trained on (``train``), capped at the
    ``cfg.ood_max_rate`` quantile of labelled cells held out of it (``calibration``) and at the
    same quantile of the cross-fitted cosines ``held_out`` (each labelled cell's best cosine in
    a warm-up that did not train on it; NaN where there is none), so that a known-type cell the
    net has not seen is called out-of-distribution at most that often. A cap needs at least
    ``1 / ood_max_rate`` cells. Returns the threshold and its candidates.
    """
    tau = float(np.quantile(maxcos[train], cfg.ood_quantile))
    info = {"threshold_in_sample": tau}
    min_cells = cells_for_quantile(cfg.ood_max_rate)
    if calibration.any():
        tau_cal = float(np.quantile(maxcos[calibration], cfg.ood_max_rate))
        info["threshold_held_out"] = tau_cal
        tau = min(tau, tau_cal)
    if held_out is not None:
        cf = held_out[np.isfinite(held_out)]
        info["n_cross_fitted"] = int(cf.size)
        if cf.size >= min_cells:
            tau_cf = float(np.quantile(cf, cfg.ood_max_rate))
            info["threshold_cross_fitted"] = tau_cf
            tau = min(tau, tau_cf)
    return tau, info


#: the upper quantile of a known type's best cosines matched between a query batch and its
#: held-out labelled cells to estimate the batch's shift of that type (novel cells claimed by the
#: type's head score low and sit below it; known cells make up the upper tail)
SHIFT_QUANTILE = 0.9


def batch_shift(scores: np.ndarray, held_out: np.ndarray) -> float:
    """A query batch's shift of a known type: the difference of the :data:`SHIFT_QUANTILE`
    quantiles of the batch's cosines of the type's cells (``scores``, any shape) and of the
    type's held-out cosines, never positive (a batch never raises a type's threshold).
    """
    upper = np.quantile(scores, SHIFT_QUANTILE) - np.quantile(held_out, SHIFT_QUANTILE)
    return min(0.0, float(upper))


def type_thresholds(
    maxcos: np.ndarray,
    predicted: np.ndarray,
    labels: np.ndarray,
    held_out: np.ndarray,
    query: np.ndarray,
    domain: np.ndarray,
    threshold: float,
    alpha: float,
    shift_query: bool = True,
) -> tuple[np.ndarray, dict]:
    """Every cell's out-of-distribution threshold, raised where its known type's own unseen
    cells say so and lowered where a query batch shifts the type (Mondrian conformal).

    A cell is scored against the known type whose head it scores best (``predicted``). The
    ``alpha`` quantile of that type's ``held_out`` cosines (each labelled cell's best cosine in
    a warm-up that did not train on it) is the score below which a known-type cell
    exchangeable with the type's labelled cells falls at most ``alpha`` of the time: a tight
    type's is high (a novel sibling its head claims scores below it), a broad type's low. The
    in-sample ``threshold`` stays where it is higher (the warm-up fits its labelled cells
    closely; the discovery rules after it, label support and the query votes, were built on
    it). In a batch without labelled cells (``query``) a type's cells are not exchangeable with
    its labelled cells: the threshold is lowered by the batch's shift of the type, the difference
    of the :data:`SHIFT_QUANTILE` quantiles of the batch's cosines and the held-out ones (never
    raised by it), so that known cells of a shifted type are not called novel. Where the data
    cannot support a quantile (fewer than ``1 / alpha`` held-out cells of the type, or of the
    type's cells in a query batch), that part is skipped; ``shift_query=False`` skips the shift
    (an ablation). Returns the thresholds and their record: the quantile per type (``None``:
    too few cells), the shift per query batch and type, and per query batch and type the cells
    the shift keeps known that the in-sample threshold calls out of distribution
    (``shift_kept``; :func:`shift_notes`).
    """
    min_cells = cells_for_quantile(alpha)
    thr = np.full(maxcos.shape[0], threshold)
    n_types = int(labels.max()) + 1 if (labels >= 0).any() else 0
    per_type: list[float | None] = [None] * n_types
    shift: dict[int, list[float | None]] = {
        int(d): [None] * n_types for d in np.unique(domain[query])
    }
    kept: dict[int, list[int]] = {d: [0] * n_types for d in shift}
    for t in range(n_types):  # loop over known types, not cells
        ht = held_out[(labels == t) & np.isfinite(held_out)]
        if ht.size < min_cells:
            continue
        q = float(np.quantile(ht, alpha))
        per_type[t] = q
        claimed = predicted == t
        thr[claimed & ~query] = q = max(q, threshold)
        for d in shift if shift_query else ():  # loop over query batches
            cells = claimed & query & (domain == d)
            if cells.sum() < min_cells:
                continue
            delta = batch_shift(maxcos[cells], ht)
            shift[d][t] = delta
            thr[cells] = q + delta
            # cells the shift keeps known that the in-sample threshold calls out of distribution
            kept[d][t] = int((cells & (maxcos < threshold) & (maxcos >= thr)).sum())
    return thr, {"type_thresholds": per_type, "query_shift": shift, "shift_kept": kept}


#: a query batch's shift of one known type is noted from this much (cosine) ...
SHIFT_NOTED = -0.05
#: ... and this many times the median shift of the batch's other types
SHIFT_NOTED_RATIO = 2.0


def shift_notes(record: dict, batch_names: list[str], class_names: list[str] | None,
                min_cells: int) -> list[str]:  # fmt: skip
    """Where a query batch's shift of a known type (:func:`type_thresholds`) keeps at least
    ``min_cells`` cells known that the in-sample threshold calls out of distribution: the cosines
    cannot tell a type the batch shifts from a novel type the head absorbs where the known type
    itself is absent from the batch, so the user is told which, and how many cells. Said only
    of a shift that stands out: at least :data:`SHIFT_NOTED` in cosine and
    :data:`SHIFT_NOTED_RATIO` times the median shift of the batch's other types (a batch that
    shifts every type alike is a batch effect).
    """
    notes = []
    for d, kept in record["shift_kept"].items():  # loop over query batches and types
        for t, n in enumerate(kept):
            delta = record["query_shift"][d][t]
            others = [v for u, v in enumerate(record["query_shift"][d]) if u != t and v is not None]
            typical = float(np.median(others)) if others else 0.0
            if n < min_cells or delta > SHIFT_NOTED or delta > SHIFT_NOTED_RATIO * typical:
                continue
            name = class_names[t] if class_names is not None else f"known type {t}"
            rest = f" (the batch's other types: {typical:+.2f})" if others else ""
            notes.append(
                Note(
                    f"Query batch '{batch_names[d]}': {n} cells of '{name}' kept known as a shift "
                    f"({delta:+.2f}); they may be a type it lacks "
                    "(uns['orca']['estimate']['shift_kept']).",
                    f"In query batch '{batch_names[d]}', the cells that '{name}' claims score "
                    f"{delta:+.2f} against its labelled cells{rest}; taken as "
                    f"a shift of the batch, this keeps {n} of them known that the in-sample "
                    f"threshold calls out of distribution. If '{name}' is absent from that batch, "
                    f"they may be a novel type its head absorbs: check their markers, or compare "
                    f"with cross_fit_threshold='none' (uns['orca']['estimate']['shift_kept']).",
                )
            )
    return notes


def ood_clusters(
    maxcos: np.ndarray,
    labeled: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    quantile: float = _DEFAULTS.ood_quantile,
    resolution: float = 1.0,
    seed: int = 0,
    exclude: np.ndarray | None = None,
    include: np.ndarray | None = None,
    threshold: float | None = None,
    n_neighbors: int = _DEFAULTS.n_neighbors,
    cell_threshold: np.ndarray | None = None,
) -> tuple[np.ndarray, list[int], float]:
    """Candidate novel clusters from the cells the seen heads do not explain.

    An unlabelled cell is out-of-distribution when its highest cosine similarity to a seen-class
    head is below ``threshold`` (default: the ``quantile`` of that similarity over labelled
    cells; see :func:`ood_threshold`); cells in ``include`` (e.g. :func:`label_deserts`) are
    treated as OOD however well they are scored. The OOD cells are clustered (Leiden on the PCA
    of their own expression, ``pca_of(idx)``) and the clusters are the candidates (the anchors,
    :func:`cluster_cores`, later drop incoherent ones); cells in ``exclude`` (e.g.
    :func:`labelled_support`) never are. ``cell_threshold``: each cell's own threshold
    (:func:`type_thresholds`) in place of the one. Returns ``(assign, sizes, threshold)`` with
    ``assign[i]`` the candidate index of cell ``i`` (``-1`` outside candidates), largest first.
    """
    tau = float(np.quantile(maxcos[labeled], quantile)) if threshold is None else threshold
    ood = ~labeled & (maxcos < (tau if cell_threshold is None else cell_threshold))
    if include is not None:
        ood |= include & ~labeled
    if exclude is not None:
        ood &= ~exclude
    ood = np.flatnonzero(ood)
    assign = np.full(maxcos.shape[0], -1, dtype=np.int64)
    if ood.size < 2:  # one cell is not clustered (no PCA, no neighbours): no candidate
        return assign, [], tau
    codes = leiden(pca_of(ood), resolution, seed, n_neighbors=n_neighbors)
    counts = np.bincount(codes)
    keep = [c for c in np.argsort(-counts, kind="stable") if counts[c] > 0]
    for rank, c in enumerate(keep):
        assign[ood[codes == c]] = rank
    return assign, [int(counts[c]) for c in keep], tau
