"""Calibrated confidence: ``obs['orca_confidence']`` of a cell labelled a known type is the
probability that the label is right.

The final net has trained on every labelled cell, so its own softmax is near 1 on almost every
cell and says nothing. The cross-fitted warm-ups of the novelty test (one without each fold of
the labelled cells, :func:`orca_sc._crossfit.cross_fit`) give what is missing: each held-out
labelled cell's probability of its predicted type under a net that never saw it, and whether
that prediction is right. An isotonic regression of right/wrong on that probability is the
calibration map. A cell labelled known type ``t`` gets the mean over the fold nets of the
calibrated probability of ``t`` (a labelled cell, the one of the net it was held out of).

The premise is that the query's known-type cells look like the reference's; a batch shift or a
novel type absorbed by a known one makes the query's labels less often right than the map says
(measured in ``docs/discovery.md``). Arrays in, arrays out.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

#: bins of the expected calibration error
ECE_BINS = 10


def expected_calibration_error(
    confidence: np.ndarray, correct: np.ndarray, n_bins: int = ECE_BINS
) -> float:
    """Expected calibration error: over ``n_bins`` equal-width bins of confidence, the mean
    absolute gap between accuracy and mean confidence, weighted by the bin's share of cells.
    """
    if np.size(confidence) == 0:
        return float("nan")
    n, right, conf = calibration_bins(confidence, correct, n_bins)
    return float(np.abs(right - conf).sum() / n.sum())


def calibration_bins(
    confidence: np.ndarray, correct: np.ndarray, n_bins: int = ECE_BINS
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per equal-width bin of confidence: the cells, the sum of ``correct`` and the sum of
    confidence (what the expected calibration error and the reliability diagram are made of).
    """
    confidence = np.asarray(confidence, dtype=np.float64)
    correct = np.asarray(correct, dtype=np.float64)
    b = np.minimum((confidence * n_bins).astype(np.int64), n_bins - 1)
    return (
        np.bincount(b, minlength=n_bins),
        np.bincount(b, correct, minlength=n_bins),
        np.bincount(b, confidence, minlength=n_bins),
    )


def _isotonic(prob: np.ndarray, correct: np.ndarray):
    from sklearn.isotonic import IsotonicRegression

    return IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit(prob, correct)


@dataclass(frozen=True)
class FoldPredictions:
    """What the fold nets of the cross-fitted warm-ups say, for calibration: ``held_prob`` and
    ``held_correct``: each labelled cell's probability of its predicted type under the net it was
    held out of, and whether that type is its label; ``fold``: every cell's fold (``-1``
    unlabelled); ``label_prob`` ``(n_folds, n)``: every cell's probability, under each fold net,
    of the known type the final net gives it (``seen_top``).
    """

    held_prob: np.ndarray
    held_correct: np.ndarray
    fold: np.ndarray
    label_prob: np.ndarray


@dataclass(frozen=True)
class Calibration:
    """Every cell's calibrated probability that its known-type label is right (``confidence``),
    the map from the final net's maximum probability to it for cells labelled later
    (``transfer``: isotonic knots ``(x, y)``, used by ``predict``), and the record for ``uns``.
    """

    confidence: np.ndarray
    transfer: tuple[list[float], list[float]]
    record: dict[str, Any]


def calibrate(pred: FoldPredictions, final_prob: np.ndarray, known: np.ndarray) -> Calibration:
    """The calibrated confidence of every cell from the fold nets' predictions ``pred``;
    ``final_prob``: the final net's maximum probability of every cell, ``known``: cells labelled
    a known type by a seen head (the others keep ``final_prob``).
    """
    iso = _isotonic(pred.held_prob, pred.held_correct)
    n_folds, n = pred.label_prob.shape
    # a fold with no labelled cell (a tiny reference) trained no net: its row is NaN
    cal = np.full(pred.label_prob.shape, np.nan)
    ran = ~np.isnan(pred.label_prob)
    cal[ran] = iso.predict(pred.label_prob[ran])
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # mean of no fold: NaN, replaced below
        conf = np.nanmean(cal, axis=0)
    conf = np.where(np.isnan(conf), final_prob, conf)
    lab = pred.fold >= 0  # a labelled cell: the net it was held out of
    conf[lab] = cal[pred.fold[lab], np.flatnonzero(lab)]
    conf = np.where(known, conf, final_prob)
    # the map's own check, cross-fitted: fitted without a fold, scored on it
    held_fold = pred.fold[lab]
    out_of_fold = np.empty(pred.held_prob.size)
    for f in np.unique(held_fold):  # loop over folds, not cells
        m = held_fold == f
        if (~m).any():
            out_of_fold[m] = _isotonic(pred.held_prob[~m], pred.held_correct[~m]).predict(
                pred.held_prob[m]
            )
        else:
            out_of_fold[m] = pred.held_prob[m]
    transfer = _transfer(final_prob[known], conf[known])
    record = {
        "method": "isotonic regression on held-out labelled cells (cross-fitted warm-ups)",
        "n_calibration": int(pred.held_prob.size),
        "heldout_accuracy": float(np.mean(pred.held_correct)),
        "ece_heldout": expected_calibration_error(out_of_fold, pred.held_correct),
        "ece_heldout_uncalibrated": expected_calibration_error(pred.held_prob, pred.held_correct),
    }
    return Calibration(conf.astype(np.float32), transfer, record)


def _transfer(final_prob: np.ndarray, conf: np.ndarray) -> tuple[list[float], list[float]]:
    """Isotonic knots from the final net's maximum probability to the calibrated confidence,
    over the cells labelled a known type (empty without any).
    """
    if final_prob.size == 0:
        return [], []
    iso = _isotonic(final_prob, conf)
    return [float(x) for x in iso.X_thresholds_], [float(y) for y in iso.y_thresholds_]


def apply_transfer(transfer: tuple[list[float], list[float]], final_prob: np.ndarray) -> np.ndarray:
    """A saved model's calibrated confidence of new cells from their maximum probability
    (``final_prob`` as is where the model has no map).
    """
    x, y = transfer
    if not x:
        return final_prob
    return np.interp(final_prob, x, y).astype(np.float32)
