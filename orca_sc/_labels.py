"""The labels of a run: which cells are labelled (missing values, the user's unlabelled
categories), the known types in their order, their codes, and the checks that the labels can
train a model.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pandas as pd

from ._errors import ConfigError, OrcaInputError


def _labels_column(adata: Any, labels_key: str, what: str) -> pd.Series:
    if labels_key not in adata.obs.columns:
        cols = ", ".join(map(repr, adata.obs.columns)) or "none"
        msg = f"labels_key {labels_key!r} is not a column of the {what}'s obs; columns: {cols}."
        raise OrcaInputError(msg)
    return adata.obs[labels_key]


#: above this many classes, a label column where most labelled cells are alone in their class
#: is taken for a per-cell value (an identifier, a score), not cell types
_ID_MIN_CLASSES = 50


def _check_label_values(adata: Any, col: pd.Series, unlabeled: np.ndarray, labels_key: str,
                        what: str) -> None:  # fmt: skip
    """Refuse a label column that holds per-cell values rather than cell types: non-integer
    numbers (a score, a QC metric), or mostly one-cell classes (an identifier).
    """
    values = col[~unlabeled]
    numeric = pd.api.types.is_numeric_dtype(values.dtype) and not pd.api.types.is_bool_dtype(
        values.dtype
    )
    counts = values.astype(str).value_counts()
    if numeric and values.size and not np.all(np.mod(values.to_numpy(dtype=float), 1) == 0):
        kind = f"continuous numbers (e.g. {', '.join(f'{v:g}' for v in values.iloc[:3])})"
    elif counts.size > _ID_MIN_CLASSES and (counts == 1).sum() > values.size / 2:
        kind = f"a value per cell ({counts.size} distinct values among {values.size} cells)"
    else:
        return
    obs = adata.obs
    named = [c for c in obs.columns if c != labels_key and not pd.api.types.is_numeric_dtype(
        obs[c].dtype) and 1 < obs[c].nunique() <= max(2, obs.shape[0] // 2)]  # fmt: skip
    hint = f" Columns that could hold them: {', '.join(map(repr, named[:5]))}." if named else ""
    msg = (
        f"obs[{labels_key!r}] of the {what} holds {kind}, not cell types; labels_key must name "
        f"the column of cell-type names (or integer codes).{hint}"
    )
    raise OrcaInputError(msg)


#: label values read as missing whatever ``unlabeled_category`` says (how a NaN or None looks
#: once a label column has been turned into strings, e.g. by ``astype(str)`` or a CSV round trip)
MISSING_LABELS = ("", "nan", "none", "null", "<na>")


def _is_unlabeled(col: pd.Series, unlabeled_category: tuple[str, ...]) -> np.ndarray:
    values = col.astype(object)
    text = values.astype(str)
    missing = text.str.strip().str.lower().isin(MISSING_LABELS)
    return (values.isna() | missing | text.isin(unlabeled_category)).to_numpy()


def _class_order(col: pd.Series, keep: np.ndarray) -> list[str]:
    present = pd.unique(col[keep].astype(str))
    if isinstance(col.dtype, pd.CategoricalDtype):
        order = [str(c) for c in col.cat.categories if str(c) in set(present)]
    else:
        order = sorted(present)
    return order


def _encode(col: pd.Series, unlabeled: np.ndarray, classes: list[str]) -> np.ndarray:
    codes = pd.Categorical(col.astype(str), categories=classes).codes.astype(np.int64)
    codes[unlabeled] = -1
    return codes


def _check_labels(labels: np.ndarray, classes: list[str], labels_key: str) -> None:
    counts = np.bincount(labels[labels >= 0], minlength=len(classes))
    if len(classes) < 2:
        msg = (
            f"obs[{labels_key!r}] has {len(classes)} labelled class(es) {classes}; ORCA needs at "
            "least 2 known cell types in the reference."
        )
        raise OrcaInputError(msg)
    if not (labels < 0).any():
        msg = (
            "There are no unlabelled cells to annotate: every cell has a label. Pass a query "
            "AnnData (reference=...) or mark the cells to annotate as NaN / 'Unknown'."
        )
        raise OrcaInputError(msg)
    single = [c for c, n in zip(classes, counts, strict=True) if n == 1]
    if single:
        warnings.warn(
            f"{len(single)} labelled class(es) have a single cell ({single[:5]}); they are kept, "
            "but ORCA cannot learn much about them.",
            UserWarning,
            stacklevel=4,
        )


def _check_n_novel(n_novel: int | str, n_unlabeled: int, min_cells: int = 5) -> None:
    """Refuse more novel types than unlabelled cells (each head would be allocated anyway: a
    billion heads is a MemoryError after the warm-up); warn when there are fewer than
    ``min_cells`` cells per novel type (a head of so few cells is rarely anchored).
    """
    if n_novel == "auto":
        return
    if n_novel > n_unlabeled:
        expected = f"at most {n_unlabeled} (the number of cells to annotate), or 'auto'"
        raise ConfigError("n_novel", n_novel, expected)
    if n_novel * min_cells > n_unlabeled:
        warnings.warn(
            f"n_novel={n_novel} novel types among {n_unlabeled} cells to annotate leaves fewer than "
            f"{min_cells} cells per type; most heads will stay empty and be dropped. Consider "
            "n_novel='auto'.",
            UserWarning,
            stacklevel=4,
        )
