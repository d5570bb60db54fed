"""Data preparation: AnnData in, plain arrays out. AnnData is never used past this layer.

Steps: read ``.X`` or a layer, check and detect the value scale of each input separately, normalise
counts (``target_sum`` per cell + ``log1p``), align genes by name, select highly variable genes on
reference and query together (batch-aware) and encode labels (``-1`` = unlabelled). The matrix stays
CSR float32 throughout.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from ._config import OrcaConfig

logger = logging.getLogger(__name__)


class OrcaInputError(ValueError):
    """Input data that cannot be used, with a message saying how to fix it."""


@dataclass
class PreparedData:
    """Arrays ready for training; rows are reference cells (if any) followed by query cells."""

    X: sp.csr_matrix  # (n_cells, n_genes) float32, log-normalised
    genes: list[str]
    labels: np.ndarray  # (n_cells,) int64, -1 = unlabelled
    classes: list[str]  # seen classes, index = label code
    domain: np.ndarray  # (n_cells,) int64 batch code
    domain_names: list[str]
    output_rows: np.ndarray  # rows belonging to the AnnData that receives the results
    input_scale: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def n_cells(self) -> int:
        return self.X.shape[0]

    @property
    def labeled(self) -> np.ndarray:
        return self.labels >= 0


# --------------------------------------------------------------------------------------------
# expression matrices
# --------------------------------------------------------------------------------------------
def get_matrix(adata: Any, layer: str | None, what: str) -> sp.csr_matrix:
    """The expression matrix of ``adata`` (``.X`` or a layer) as CSR float32, checked."""
    if adata.n_obs == 0:
        msg = f"The {what} has no cells (n_obs = 0); pass an AnnData with at least one cell."
        raise OrcaInputError(msg)
    if adata.n_vars == 0:
        msg = f"The {what} has no genes (n_vars = 0); pass an AnnData with expression values."
        raise OrcaInputError(msg)
    if layer is None:
        X = adata.X
        source = ".X"
        if X is None:
            msg = f"The {what} has no .X; pass layer= naming the layer with expression values."
            raise OrcaInputError(msg)
    else:
        if layer not in adata.layers:
            avail = ", ".join(map(repr, adata.layers.keys())) or "none"
            msg = f"Layer {layer!r} not found in the {what}; available layers: {avail}."
            raise OrcaInputError(msg)
        X = adata.layers[layer]
        source = f".layers[{layer!r}]"
    if hasattr(X, "to_memory"):  # backed / lazy arrays
        X = X.to_memory()
    if sp.issparse(X):
        X = sp.csr_matrix(X, dtype=np.float32)
    else:
        X = sp.csr_matrix(np.asarray(X, dtype=np.float32))
    X.sum_duplicates()
    _check_values(X.data, f"{what} {source}")
    return X


def _check_values(data: np.ndarray, where: str) -> None:
    if not np.isfinite(data).all():
        n = int((~np.isfinite(data)).sum())
        msg = (
            f"{where} contains {n} NaN or infinite values; expression must be finite. "
            "Remove or impute them (e.g. np.nan_to_num) before running orca_sc."
        )
        raise OrcaInputError(msg)
    if data.size and data.min() < 0:
        msg = (
            f"{where} contains negative values (min {data.min():.3g}); orca_sc needs raw counts or "
            "log-normalised values, not scaled data. Pass the counts or log-normalised layer "
            "(layer=...) or adata.raw.to_adata()."
        )
        raise OrcaInputError(msg)


def detect_scale(X: sp.csr_matrix) -> str:
    """``"counts"`` for non-negative integers, ``"log-normalized"`` for already log-scaled values."""
    data = X.data
    if data.size == 0 or np.all(data == np.floor(data)):
        return "counts"
    if data.max() > 50:
        msg = (
            f"The values look normalised but not log-transformed (max {data.max():.4g}, not "
            "integers); pass raw counts, or log-normalised values (run sc.pp.log1p first)."
        )
        raise OrcaInputError(msg)
    return "log-normalized"


def log_normalize(X: sp.csr_matrix, target_sum: float) -> sp.csr_matrix:
    """Counts -> ``log1p(target_sum * x / total)`` per cell; sparse in, sparse out."""
    totals = np.asarray(X.sum(axis=1)).ravel()
    n_empty = int((totals == 0).sum())
    if n_empty:
        warnings.warn(
            f"{n_empty} cells have no counts; they stay all-zero after normalisation. "
            "Filter them out (sc.pp.filter_cells(adata, min_counts=1)) for cleaner results.",
            UserWarning,
            stacklevel=4,
        )
    factors = np.divide(target_sum, totals, out=np.zeros_like(totals), where=totals > 0)
    Y = sp.csr_matrix(X, dtype=np.float32, copy=True)
    Y.data *= np.repeat(factors, np.diff(Y.indptr)).astype(np.float32)
    np.log1p(Y.data, out=Y.data)
    return Y


def to_log_normalized(X: sp.csr_matrix, target_sum: float) -> tuple[sp.csr_matrix, str]:
    scale = detect_scale(X)
    if scale == "counts":
        return log_normalize(X, target_sum), scale
    return X, scale


# --------------------------------------------------------------------------------------------
# genes and labels
# --------------------------------------------------------------------------------------------
def check_unique_genes(var_names: pd.Index, what: str) -> None:
    if not var_names.is_unique:
        dups = var_names[var_names.duplicated()].unique()[:5].tolist()
        msg = (
            f"The {what} has duplicate gene names, e.g. {dups}; make them unique with "
            "adata.var_names_make_unique() or aggregate the duplicates."
        )
        raise OrcaInputError(msg)


def shared_genes(ref_genes: pd.Index, query_genes: pd.Index, min_shared: int) -> list[str]:
    """Genes present in both, in the reference's order."""
    in_query = ref_genes.isin(query_genes)
    shared = ref_genes[in_query].tolist()
    if len(shared) < min_shared:
        ex_ref = ref_genes[~in_query][:3].tolist()
        ex_q = query_genes[~query_genes.isin(ref_genes)][:3].tolist()
        msg = (
            f"Only {len(shared)} genes are shared between reference and query (need at least "
            f"{min_shared}). Unmatched examples: reference {ex_ref}, query {ex_q}. Use the same "
            "gene identifiers (symbols or Ensembl IDs) in both, e.g. via adata.var_names = "
            "adata.var['gene_symbols']."
        )
        raise OrcaInputError(msg)
    frac = len(shared) / len(ref_genes)
    if frac < 0.5:
        warnings.warn(
            f"Only {len(shared)} of the reference's {len(ref_genes)} genes ({frac:.0%}) are found "
            "in the query; check that both use the same gene identifiers.",
            UserWarning,
            stacklevel=4,
        )
    return shared


def _labels_column(adata: Any, labels_key: str, what: str) -> pd.Series:
    if labels_key not in adata.obs.columns:
        cols = ", ".join(map(repr, adata.obs.columns)) or "none"
        msg = f"labels_key {labels_key!r} is not a column of the {what}'s obs; columns: {cols}."
        raise OrcaInputError(msg)
    return adata.obs[labels_key]


def _is_unlabeled(col: pd.Series, unlabeled_category: tuple[str, ...]) -> np.ndarray:
    values = col.astype(object)
    return (values.isna() | values.astype(str).isin(unlabeled_category)).to_numpy()


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


def select_genes(
    X: sp.csr_matrix, genes: list[str], batches: np.ndarray, n_genes: int | None
) -> np.ndarray:
    """Indices of ``n_genes`` highly variable genes (scanpy's seurat flavour, batch-aware)."""
    if n_genes is None or n_genes >= X.shape[1]:
        return np.arange(X.shape[1])
    import anndata as ad
    import scanpy as sc

    tmp = ad.AnnData(X=X, var=pd.DataFrame(index=genes))
    tmp.obs["batch"] = pd.Categorical(batches.astype(str))
    use_batch = tmp.obs["batch"].nunique() > 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sc.pp.highly_variable_genes(
            tmp,
            n_top_genes=n_genes,
            flavor="seurat",
            batch_key="batch" if use_batch else None,
            subset=False,
        )
    hv = tmp.var["highly_variable"].to_numpy()
    return np.flatnonzero(hv)


# --------------------------------------------------------------------------------------------
# the entry point
# --------------------------------------------------------------------------------------------
def prepare(
    adata: Any,
    reference: Any | None,
    labels_key: str,
    config: OrcaConfig,
) -> PreparedData:
    """Turn (query, reference) AnnData into :class:`PreparedData`.

    Without ``reference`` the labelled cells of ``adata`` (``obs[labels_key]`` not NaN and not one
    of ``config.unlabeled_category``) are the reference and the other cells the query.
    """
    what_q = "query" if reference is not None else "AnnData"
    for obj, what in ((reference, "reference"), (adata, what_q)):
        if obj is not None and obj.n_obs == 0:
            msg = f"The {what} has no cells (n_obs = 0); pass an AnnData with at least one cell."
            raise OrcaInputError(msg)
    check_unique_genes(adata.var_names, what_q)
    Xq = get_matrix(adata, config.layer, what_q)
    Xq, scale_q = to_log_normalized(Xq, config.target_sum)
    input_scale = {what_q: scale_q}

    if reference is None:
        col = _labels_column(adata, labels_key, what_q)
        unl = _is_unlabeled(col, config.unlabeled_category)
        classes = _class_order(col, ~unl)
        labels = _encode(col, unl, classes)
        X = Xq
        genes = adata.var_names.astype(str).tolist()
        if config.batch_key is not None:
            domain_raw = batch_column(adata, config.batch_key, what_q)
        else:
            domain_raw = np.full(adata.n_obs, "data", dtype=object)
        output_rows = np.arange(adata.n_obs)
        n_shared = len(genes)
    else:
        check_unique_genes(reference.var_names, "reference")
        col = _labels_column(reference, labels_key, "reference")
        unl = _is_unlabeled(col, config.unlabeled_category)
        if unl.all():
            msg = (
                f"The reference has no labelled cells in obs[{labels_key!r}] (all NaN or one of "
                f"{list(config.unlabeled_category)}); pass a labelled reference."
            )
            raise OrcaInputError(msg)
        Xr = get_matrix(reference, config.layer, "reference")
        Xr, scale_r = to_log_normalized(Xr, config.target_sum)
        input_scale["reference"] = scale_r
        if unl.any():
            logger.info("Dropping %d unlabelled reference cells.", int(unl.sum()))
        keep = np.flatnonzero(~unl)
        classes = _class_order(col, ~unl)
        ref_labels = _encode(col, unl, classes)[keep]
        genes = shared_genes(
            reference.var_names.astype(str), adata.var_names.astype(str), config.min_shared_genes
        )
        n_shared = len(genes)
        r_idx = reference.var_names.get_indexer(genes)
        q_idx = adata.var_names.get_indexer(genes)
        X = sp.vstack([Xr[keep][:, r_idx], Xq[:, q_idx]], format="csr", dtype=np.float32)
        labels = np.concatenate([ref_labels, np.full(adata.n_obs, -1, dtype=np.int64)])
        if config.batch_key is not None:
            domain_raw = np.concatenate(
                [
                    batch_column(reference, config.batch_key, "reference")[keep],
                    batch_column(adata, config.batch_key, what_q),
                ]
            )
        else:
            domain_raw = np.array(["reference"] * len(keep) + ["query"] * adata.n_obs, dtype=object)
        output_rows = np.arange(len(keep), X.shape[0])

    _check_labels(labels, classes, labels_key)
    domain_names, domain = np.unique(domain_raw.astype(str), return_inverse=True)
    hv = select_genes(X, genes, domain, config.n_genes)
    X = X[:, hv].tocsr()
    X.sort_indices()
    genes = [genes[i] for i in hv]
    info = {
        "n_shared_genes": n_shared,
        "n_genes_used": len(genes),
        "n_labeled": int((labels >= 0).sum()),
        "n_unlabeled": int((labels < 0).sum()),
    }
    return PreparedData(
        X=X,
        genes=genes,
        labels=labels,
        classes=classes,
        domain=domain.astype(np.int64),
        domain_names=[str(d) for d in domain_names],
        output_rows=output_rows,
        input_scale=input_scale,
        info=info,
    )


def batch_column(adata: Any, batch_key: str, what: str) -> np.ndarray:
    if batch_key not in adata.obs.columns:
        cols = ", ".join(map(repr, adata.obs.columns)) or "none"
        msg = f"batch_key {batch_key!r} is not a column of the {what}'s obs; columns: {cols}."
        raise OrcaInputError(msg)
    col = adata.obs[batch_key]
    if col.isna().any():
        msg = f"obs[{batch_key!r}] of the {what} has missing values; fill them in first."
        raise OrcaInputError(msg)
    return col.astype(str).to_numpy(dtype=object)


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
