"""Open-world evaluation metrics, following the paper's protocol (Appendix B).

* seen accuracy: plain accuracy on cells whose true type is a seen (reference) class;
* novel accuracy: accuracy on cells of novel types after the best one-to-one matching (Hungarian)
  of predicted labels to true novel types;
* novel NMI: normalised mutual information between predictions and truth on novel-type cells;
* all accuracy: accuracy on all cells after Hungarian matching over all classes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import linear_sum_assignment
from sklearn.metrics import normalized_mutual_info_score

from ._annotation import RunRecord

__all__ = [
    "all_accuracy",
    "hungarian_match",
    "novel_accuracy",
    "novel_nmi",
    "per_class_recall",
    "report",
    "seen_accuracy",
]


def _as_str(a: Any) -> np.ndarray:
    return np.asarray(pd.Series(a).astype(str).to_numpy(), dtype=object)


def hungarian_match(y_true: Any, y_pred: Any) -> dict[str, str]:
    """Best one-to-one mapping predicted label -> true label (maximises matched cells)."""
    t, p = _as_str(y_true), _as_str(y_pred)
    tu, ti = np.unique(t, return_inverse=True)
    pu, pi = np.unique(p, return_inverse=True)
    w = np.zeros((pu.size, tu.size), dtype=np.int64)
    np.add.at(w, (pi, ti), 1)
    rows, cols = linear_sum_assignment(w, maximize=True)
    return {pu[r]: tu[c] for r, c in zip(rows, cols, strict=True) if w[r, c] > 0}


def _cluster_accuracy(y_true: Any, y_pred: Any) -> float:
    t, p = _as_str(y_true), _as_str(y_pred)
    if t.size == 0:
        return float("nan")
    mapping = hungarian_match(t, p)
    mapped = np.array([mapping.get(x, None) for x in p], dtype=object)
    return float(np.mean(mapped == t))


def seen_accuracy(y_true: Any, y_pred: Any, seen_classes: Any) -> float:
    """Plain accuracy over cells whose true label is in ``seen_classes`` (NaN if none)."""
    t, p = _as_str(y_true), _as_str(y_pred)
    mask = np.isin(t, _as_str(list(seen_classes)))
    return float(np.mean(t[mask] == p[mask])) if mask.any() else float("nan")


def novel_accuracy(y_true: Any, y_pred: Any, seen_classes: Any) -> float:
    """Hungarian-matched accuracy over cells whose true label is not seen (NaN if none)."""
    t, p = _as_str(y_true), _as_str(y_pred)
    mask = ~np.isin(t, _as_str(list(seen_classes)))
    return _cluster_accuracy(t[mask], p[mask])


def novel_nmi(y_true: Any, y_pred: Any, seen_classes: Any) -> float:
    """NMI between prediction and truth over cells of novel types (NaN if none)."""
    t, p = _as_str(y_true), _as_str(y_pred)
    mask = ~np.isin(t, _as_str(list(seen_classes)))
    if not mask.any():
        return float("nan")
    return float(normalized_mutual_info_score(t[mask], p[mask]))


def all_accuracy(y_true: Any, y_pred: Any) -> float:
    """Hungarian-matched accuracy over all cells and all classes."""
    return _cluster_accuracy(y_true, y_pred)


def per_class_recall(y_true: Any, y_pred: Any, seen_classes: Any) -> pd.DataFrame:
    """Per true class: size, the label it is matched to and the fraction of its cells given it.

    Seen classes are matched to their own name; novel classes to the predicted label chosen by the
    Hungarian matching on novel-type cells.
    """
    t, p = _as_str(y_true), _as_str(y_pred)
    seen = set(_as_str(list(seen_classes)))
    novel_mask = ~np.isin(t, list(seen))
    inv = {v: k for k, v in hungarian_match(t[novel_mask], p[novel_mask]).items()}
    rows = []
    for c in pd.unique(t):
        m = t == c
        target = c if c in seen else inv.get(c)
        rows.append(
            {
                "class": c,
                "seen": c in seen,
                "n_cells": int(m.sum()),
                "matched_label": target,
                "recall": float(np.mean(p[m] == target)) if target is not None else 0.0,
            }
        )
    return pd.DataFrame(rows).sort_values("n_cells", ascending=False).reset_index(drop=True)


def report(
    adata: Any,
    truth_key: str,
    *,
    key_added: str = "orca",
    seen_classes: Any | None = None,
) -> dict[str, Any]:
    """The paper's metrics for an AnnData annotated by :func:`orca_sc.tl.annotate`.

    Cells that were labelled during training (single-AnnData mode) are excluded, as in the paper;
    cells with a missing truth are ignored. ``seen_classes`` defaults to the model's classes.
    Returns a dict with ``seen_accuracy``, ``novel_accuracy``, ``novel_nmi``, ``all_accuracy``,
    the cell counts and ``per_class`` (a list of records).
    """
    label_col = f"{key_added}_label"
    if label_col not in adata.obs.columns:
        msg = f"obs[{label_col!r}] not found; run orca_sc.tl.annotate(..., key_added={key_added!r}) first."
        raise KeyError(msg)
    if truth_key not in adata.obs.columns:
        cols = ", ".join(map(repr, adata.obs.columns))
        msg = f"truth_key {truth_key!r} is not an obs column; columns: {cols}."
        raise KeyError(msg)
    record = RunRecord.from_uns(adata.uns.get(key_added))
    if seen_classes is None:
        seen_classes = list(record.seen_classes)
    mask = adata.obs[truth_key].notna().to_numpy()
    if record.mode == "single":
        params = record.params
        lab_col = adata.obs[params["labels_key"]].astype(object)
        unl = lab_col.isna() | lab_col.astype(str).isin(list(params["unlabeled_category"]))
        mask = mask & unl.to_numpy()  # a new array: to_numpy() may be read-only (pandas CoW)
    t = _as_str(adata.obs[truth_key][mask])
    p = _as_str(adata.obs[label_col][mask])
    seen_mask = np.isin(t, _as_str(list(seen_classes)))
    return {
        "seen_accuracy": seen_accuracy(t, p, seen_classes),
        "novel_accuracy": novel_accuracy(t, p, seen_classes),
        "novel_nmi": novel_nmi(t, p, seen_classes),
        "all_accuracy": all_accuracy(t, p),
        "n_cells": int(mask.sum()),
        "n_seen_cells": int(seen_mask.sum()),
        "n_novel_cells": int((~seen_mask).sum()),
        "n_novel_true": int(np.unique(t[~seen_mask]).size),
        "n_novel_found": len(record.novel_cluster_sizes),
        "per_class": per_class_recall(t, p, seen_classes).to_dict(orient="records"),
    }
