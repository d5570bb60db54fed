"""Data preparation: AnnData in, plain arrays out. AnnData is never used past this layer.

Steps: read ``.X`` or a layer, check and detect the value scale of each input separately, normalise
counts (``target_sum`` per cell + ``log1p``), align genes by name, select highly variable genes on
reference and query together (batch-aware) and encode labels (``-1`` = unlabelled). The matrix stays
CSR float32 throughout.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from ._config import OrcaConfig
from ._errors import ConfigError, OrcaInputError

__all__ = ["OrcaInputError", "PreparedData", "prepare"]

logger = logging.getLogger(__name__)


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
    X, source = _source_matrix(adata, layer, what)
    if hasattr(X, "to_memory"):  # backed / lazy arrays
        X = X.to_memory()
    X = _checked_csr(X, f"{what} {source}")
    if X.nnz == 0:
        raise _only_zeros(f"{what} {source}")
    return X


def _only_zeros(where: str) -> OrcaInputError:
    return OrcaInputError(
        f"The {where} holds only zeros; pass the layer with its counts or "
        "log-normalised expression (layer=...)."
    )


def _checked_csr(X: Any, where: str) -> sp.csr_matrix:
    """``X`` (sparse or dense) as canonical CSR float32 after :func:`_check_values`.

    Checked in the caller's dtype (a float64 1e39 would become inf in float32); the caller's
    matrix is never modified: converting or canonicalising (sorting indices, summing
    duplicates) works on a copy.
    """
    if sp.issparse(X):
        X = sp.csr_matrix(X)  # shares the caller's arrays when X is CSR already
        _check_values(X.data, where)
        X = X.astype(np.float32, copy=False)
        if not X.has_canonical_format:
            X = X.copy()
            X.sum_duplicates()
        return X
    arr = np.asarray(X)
    _check_values(arr.ravel(), where)
    return sp.csr_matrix(arr, dtype=np.float32)


#: cells read, checked and normalised at a time from a matrix on disk (backed h5ad, zarr): the
#: host memory of one chunk is about ``CHUNK_CELLS`` x genes x non-zero share x 12 bytes
CHUNK_CELLS = 10_000


def _source_matrix(adata: Any, layer: str | None, what: str) -> tuple[Any, str]:
    """``.X`` or a layer, as stored (in memory, or a backed / lazy array), and where it is."""
    if adata.n_obs == 0:
        msg = f"The {what} has no cells (n_obs = 0); pass an AnnData with at least one cell."
        raise OrcaInputError(msg)
    if adata.n_vars == 0:
        msg = f"The {what} has no genes (n_vars = 0); pass an AnnData with expression values."
        raise OrcaInputError(msg)
    if layer is None:
        if adata.X is None:
            msg = f"The {what} has no .X; pass layer= naming the layer with expression values."
            raise OrcaInputError(msg)
        return adata.X, ".X"
    if layer not in adata.layers:
        avail = ", ".join(map(repr, adata.layers.keys())) or "none"
        msg = f"Layer {layer!r} not found in the {what}; available layers: {avail}."
        raise OrcaInputError(msg)
    return adata.layers[layer], f".layers[{layer!r}]"


def on_disk(adata: Any, layer: str | None = None) -> bool:
    """Whether the expression matrix of ``adata`` is read from disk on access (a backed h5ad,
    a zarr store opened with :func:`orca_sc.read_lazy`): it is then streamed in chunks.
    """
    X = adata.X if layer is None else adata.layers.get(layer) if layer in adata.layers else None
    return X is not None and not isinstance(X, np.ndarray) and not sp.issparse(X)


class ChunkReader:
    """The expression matrix of ``adata`` (or its rows ``rows``, sorted) read ``CHUNK_CELLS``
    cells at a time, each chunk checked like :func:`get_matrix` and log-normalised (counts) or
    kept (already log-normalised). The value scale is told from the first chunk; a later chunk
    of counts with non-integer values is an error. Never holds more than one chunk.
    """

    def __init__(
        self,
        adata: Any,
        layer: str | None,
        what: str,
        target_sum: float,
        chunk: int | None = None,
        rows: np.ndarray | None = None,
        require_values: bool = True,
    ) -> None:
        self.X, self.source = _source_matrix(adata, layer, what)
        self.what = what
        self.rows = rows
        self.require_values = require_values  # an all-zero matrix is an error
        self.nnz = 0
        self.n_obs = adata.n_obs if rows is None else rows.size
        self.target_sum = target_sum
        self.chunk = chunk or CHUNK_CELLS
        self.scale: str | None = None
        self.n_empty = 0

    def __iter__(self):
        """``(start, stop, chunk)`` with the chunk a log-normalised CSR float32 matrix
        (``start:stop``: positions in ``rows`` when given).
        """
        where = f"{self.what} {self.source}"
        nnz = 0
        self.n_empty = 0
        for start in range(0, self.n_obs, self.chunk):
            stop = min(self.n_obs, start + self.chunk)
            sel = slice(start, stop) if self.rows is None else _as_slice(self.rows[start:stop])
            m = _checked_csr(self.X[sel], where)
            nnz += m.nnz
            if self.scale is None:
                self.scale = detect_scale(m) if m.nnz else None
            elif self.scale == "counts" and not np.all(m.data == np.floor(m.data)):
                msg = (
                    f"The {where} holds integer counts in its first cells but non-integer values "
                    f"in cells {start}-{stop - 1}; pass one kind of values (all counts, or all "
                    "log-normalised)."
                )
                raise OrcaInputError(msg)
            if self.scale in (None, "counts"):
                self.n_empty += int((np.diff(m.indptr) == 0).sum())
                m = log_normalize(m, self.target_sum, warn=False)
            yield start, stop, m
        self.nnz = nnz
        if nnz == 0 and self.require_values:
            raise _only_zeros(where)
        if self.scale is None:
            self.scale = "counts"


def _as_slice(rows: np.ndarray) -> slice | np.ndarray:
    """Consecutive row numbers as a slice (a backed matrix reads a slice in one go)."""
    if rows.size and rows[-1] - rows[0] + 1 == rows.size and np.all(np.diff(rows) == 1):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows


def _check_values(data: np.ndarray, where: str) -> None:
    if data.dtype.kind not in "biuf":
        msg = (
            f"{where} has dtype {data.dtype}; expression values must be numbers. Convert them, "
            "e.g. adata.X = adata.X.astype('float32')."
        )
        raise OrcaInputError(msg)
    if not np.isfinite(data).all():
        n = int((~np.isfinite(data)).sum())
        msg = (
            f"{where} contains {n} NaN or infinite values; expression must be finite. "
            "Remove or impute them (e.g. np.nan_to_num) before running orca_sc."
        )
        raise OrcaInputError(msg)
    big = np.finfo(np.float32).max
    if data.size and np.abs(data).max() > big:
        msg = (
            f"{where} contains values up to {np.abs(data).max():.3g}, beyond what float32 can hold "
            f"({big:.3g}); these are not expression values. Check how the matrix was made."
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
    if data.max() > 50 or _linear_not_log(X):
        msg = (
            f"The values look normalised but not log-transformed (not integers, max "
            f"{data.max():.4g}, and within each cell proportional to integer counts); pass raw "
            "counts, or log-normalised values (run sc.pp.log1p(adata) after sc.pp.normalize_total)."
        )
        raise OrcaInputError(msg)
    return "log-normalized"


def _linear_not_log(X: sp.csr_matrix, max_cells: int = 500) -> bool:
    """Whether non-integer values are counts scaled per cell (``normalize_total`` without
    ``log1p``) rather than log-normalised.

    Within one cell, normalised counts are ``c * f`` and log-normalised ones ``log1p(c * f)``
    for integer counts ``c``; dividing by the cell's smallest value (almost always a count of 1)
    gives integers on the linear scale for the first and after ``expm1`` for the second. The
    scale whose ratios are integers to float precision wins; when the two cannot be told apart
    (``f`` so small that ``log1p(x)`` is ``x``) the data count as log-normalised.
    """
    rows = np.flatnonzero(np.diff(X.indptr) >= 2)
    rows = rows[np.linspace(0, rows.size - 1, min(max_cells, rows.size)).astype(np.int64)]
    sub = X[rows]
    sub.eliminate_zeros()  # explicitly stored zeros
    sub = sub[np.diff(sub.indptr) >= 2]
    if sub.shape[0] == 0:
        return False
    starts = sub.indptr[:-1]
    v = sub.data.astype(np.float64)
    per_row = np.diff(sub.indptr)
    m = np.repeat(np.minimum.reduceat(v, starts), per_row)

    def off_integer(r: np.ndarray) -> float:
        keep = r <= 100  # large ratios lose the precision to tell
        return float(np.abs(r[keep] - np.round(r[keep])).mean())

    linear = off_integer(v / m)
    logged = off_integer(np.expm1(v) / np.expm1(m))
    return linear < 1e-3 and logged > max(10 * linear, 1e-3)


def log_normalize(X: sp.csr_matrix, target_sum: float, warn: bool = True) -> sp.csr_matrix:
    """Counts -> ``log1p(target_sum * x / total)`` per cell; sparse in, sparse out."""
    totals = np.asarray(X.sum(axis=1)).ravel()
    n_empty = int((totals == 0).sum())
    if n_empty and warn:
        _warn_empty(n_empty)
    factors = np.divide(target_sum, totals, out=np.zeros_like(totals), where=totals > 0)
    Y = sp.csr_matrix(X, dtype=np.float32, copy=True)
    Y.data *= np.repeat(factors, np.diff(Y.indptr)).astype(np.float32)
    np.log1p(Y.data, out=Y.data)
    return Y


def _warn_empty(n_empty: int) -> None:
    warnings.warn(
        f"{n_empty} cells have no counts; they stay all-zero after normalisation. "
        "Filter them out (sc.pp.filter_cells(adata, min_counts=1)) for cleaner results.",
        UserWarning,
        stacklevel=5,
    )


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


def select_genes(
    X: sp.csr_matrix, genes: list[str], batches: np.ndarray, n_genes: int | None
) -> np.ndarray:
    """Indices of ``n_genes`` highly variable genes (scanpy's seurat flavour, batch-aware).

    Batches of one cell have no dispersion and take no part in the ranking (scanpy's per-batch
    ranking fails on them). Where scanpy cannot rank the genes at all (every dispersion
    undefined, e.g. a handful of identical cells) the genes of highest variance are used.
    """
    if n_genes is None or n_genes >= X.shape[1]:
        return np.arange(X.shape[1])
    import anndata as ad
    import scanpy as sc

    _, codes, sizes = np.unique(batches, return_inverse=True, return_counts=True)
    rows = sizes[codes] >= 2
    if rows.all() or not rows.any():
        rows = slice(None)
    tmp = ad.AnnData(X=X[rows], var=pd.DataFrame(index=genes))
    tmp.obs["batch"] = pd.Categorical(batches[rows].astype(str))
    use_batch = tmp.obs["batch"].nunique() > 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sc.pp.highly_variable_genes(
                tmp,
                n_top_genes=n_genes,
                flavor="seurat",
                batch_key="batch" if use_batch else None,
                subset=False,
            )
    except (ValueError, IndexError):  # no gene has a defined dispersion
        mean = np.asarray(X.mean(axis=0)).ravel()
        var = np.asarray(X.multiply(X).mean(axis=0)).ravel() - mean**2
        return np.sort(np.argsort(-var, kind="stable")[:n_genes])
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
    comm: Any = None,
) -> PreparedData:
    """Turn (query, reference) AnnData into :class:`PreparedData`.

    Without ``reference`` the labelled cells of ``adata`` (``obs[labels_key]`` not NaN and not one
    of ``config.unlabeled_category``) are the reference and the other cells the query.

    ``comm`` (:class:`orca_sc._dist.Comm`, several processes): input on disk is read by each
    rank for its share of the cells, the gene statistics are summed over the ranks, and every
    rank ends with the whole selected matrix. Input in memory is prepared by every rank alike.
    """
    what_q = "query" if reference is not None else "AnnData"
    # everything that can be checked without the matrices first: no work (and no warning about
    # the values) before an error about the labels, genes, batches or options
    for obj, what in ((reference, "reference"), (adata, what_q)):
        if obj is not None and obj.n_obs == 0:
            msg = f"The {what} has no cells (n_obs = 0); pass an AnnData with at least one cell."
            raise OrcaInputError(msg)
    check_unique_genes(adata.var_names, what_q)
    if reference is None:
        col = _labels_column(adata, labels_key, what_q)
        unl = _is_unlabeled(col, config.unlabeled_category)
        classes = _class_order(col, ~unl)
        labels = _encode(col, unl, classes)
        genes = adata.var_names.astype(str).tolist()
        if len(genes) < config.min_shared_genes:
            msg = (
                f"The {what_q} has {len(genes)} gene(s); ORCA needs at least "
                f"{config.min_shared_genes} (min_shared_genes) to tell cell types apart. Pass the "
                "full expression matrix."
            )
            raise OrcaInputError(msg)
        if config.batch_key is not None:
            domain_raw = batch_column(adata, config.batch_key, what_q)
        else:
            domain_raw = np.full(adata.n_obs, "data", dtype=object)
        output_rows = np.arange(adata.n_obs)
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
        keep = np.flatnonzero(~unl)
        classes = _class_order(col, ~unl)
        ref_labels = _encode(col, unl, classes)[keep]
        labels = np.concatenate([ref_labels, np.full(adata.n_obs, -1, dtype=np.int64)])
        genes = shared_genes(
            reference.var_names.astype(str), adata.var_names.astype(str), config.min_shared_genes
        )
        if config.batch_key is not None:
            domain_raw = np.concatenate(
                [
                    batch_column(reference, config.batch_key, "reference")[keep],
                    batch_column(adata, config.batch_key, what_q),
                ]
            )
        else:
            domain_raw = np.array(["reference"] * len(keep) + ["query"] * adata.n_obs, dtype=object)
        output_rows = np.arange(len(keep), len(labels))
    _check_labels(labels, classes, labels_key)
    _check_n_novel(config.n_novel, int((labels < 0).sum()), config.discovery.min_cluster_cells)
    n_shared = len(genes)

    domain_names, domain = np.unique(domain_raw.astype(str), return_inverse=True)
    if reference is not None and unl.any():
        logger.info("Dropping %d unlabelled reference cells.", int(unl.sum()))
    streamed = on_disk(adata, config.layer) or (
        reference is not None and on_disk(reference, config.layer)
    )
    if streamed:  # read from disk chunk by chunk; only the selected genes are held
        parts = [(adata, what_q, None, adata.var_names.get_indexer(genes))]
        if reference is not None:
            parts.insert(0, (reference, "reference", keep, reference.var_names.get_indexer(genes)))
        X, hv, input_scale = _read_streamed(parts, domain, domain_names, config, comm)
    else:
        Xq = get_matrix(adata, config.layer, what_q)
        Xq, scale_q = to_log_normalized(Xq, config.target_sum)
        input_scale = {what_q: scale_q}
        if reference is None:
            X = Xq
        else:
            Xr = get_matrix(reference, config.layer, "reference")
            Xr, scale_r = to_log_normalized(Xr, config.target_sum)
            input_scale["reference"] = scale_r
            r_idx = reference.var_names.get_indexer(genes)
            q_idx = adata.var_names.get_indexer(genes)
            X = sp.vstack([Xr[keep][:, r_idx], Xq[:, q_idx]], format="csr", dtype=np.float32)
        _check_expressed(np.diff(X.indptr), domain, domain_names, config.batch_key, X.shape[1])
        hv = select_genes(X, genes, domain, config.n_genes)
        X = X[:, hv].tocsr()
    X.sort_indices()
    genes = [genes[i] for i in hv]
    info = {
        "streamed": bool(streamed),
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


def _read_streamed(
    parts, domain: np.ndarray, domain_names: np.ndarray, config: OrcaConfig, comm: Any = None
):
    """The streamed counterpart of reading, normalising, joining and selecting genes in
    :func:`prepare`, for inputs on disk. ``parts``: ``(adata, what, rows kept or None, column of
    each shared gene)`` in row order. Two passes over each input: the first accumulates the
    per-batch gene statistics of the highly variable gene selection
    (:class:`orca_sc._hvg.GeneStats`, same genes as scanpy on the whole matrix), the second
    writes the selected genes into the final arrays (:func:`_fill_csr`, a memory-mapped scratch
    file). Peak memory: one chunk of all genes. Returns ``(X, selected gene indices, input
    scales)``.

    With several processes (``comm``) each rank reads its share of each input's rows; the
    statistics are summed over the ranks and the selected rows gathered.
    """
    from ._hvg import GeneStats, select_from_stats

    multi = comm is not None and comm.active
    n_shared, n_domains = len(parts[0][3]), len(domain_names)
    stats = GeneStats(n_domains, n_shared)
    # stored values per gene, the size of the selected matrix (counted by one process only:
    # with several, each rank's blocks are gathered as they are)
    stored = np.zeros(n_shared, dtype=np.int64)
    n_rows = 0
    readers, spans, starts, first = [], [], [], 0
    for adata, what, keep, _ in parts:
        span = comm.share(adata.n_obs) if multi else np.arange(adata.n_obs)
        reader = ChunkReader(
            adata, config.layer, what, config.target_sum, rows=span if multi else None,
            require_values=not multi,
        )  # fmt: skip
        readers.append(reader)
        spans.append(span)
        starts.append(first)
        first += adata.n_obs if keep is None else keep.size

    def first_pass() -> None:
        nonlocal n_rows
        for reader, span, start0, (_, _, keep, cols) in zip(
            readers, spans, starts, parts, strict=True
        ):
            for start, stop, m in reader:
                lo = int(span[start]) if span.size else 0
                rows = _kept_rows(keep, lo, lo + stop - start)
                pos = start0 + (rows if keep is None else np.searchsorted(keep, rows))
                sub = m[rows - lo][:, cols]
                stats.add(sub, domain[pos])
                if not multi:
                    stored[:] += np.bincount(sub.indices, minlength=n_shared)
                n_rows += rows.size

    if not multi:
        first_pass()
    else:
        comm.agree(first_pass)
        stats.apply(comm.sum)
        _agree_on_reading(readers, comm)
    for reader in readers:
        if reader.n_empty and (not multi or comm.main):
            _warn_empty(reader.n_empty)
    per_batch = stats.nnz.sum(axis=1)
    _check_expressed(per_batch, np.arange(n_domains), domain_names, config.batch_key, n_shared)
    hv = select_from_stats(stats, config.n_genes)

    def selected(i: int):  # the second pass: input i's selected rows, chunk by chunk
        (_, _, keep, cols), span = parts[i], spans[i]
        for start, stop, m in readers[i]:
            lo = int(span[start]) if span.size else 0
            yield m[_kept_rows(keep, lo, lo + stop - start) - lo][:, cols[hv]]

    if multi:  # every rank gets each input's whole selected matrix, in row order
        blocks = []
        for i in range(len(parts)):
            empty = sp.csr_matrix((0, hv.size), dtype=np.float32)
            blocks.extend(comm.gather_objects(sp.vstack([empty, *selected(i)], format="csr")))
        X = sp.vstack(blocks, format="csr", dtype=np.float32)
    else:
        chunks = (b for i in range(len(parts)) for b in selected(i))
        X = _fill_csr(chunks, n_rows, hv.size, int(stored[hv].sum()))
    return (
        X,
        hv,
        {what: reader.scale for reader, (_, what, _, _) in zip(readers, parts, strict=True)},
    )


def _fill_csr(blocks, n_rows: int, n_cols: int, nnz: int) -> sp.csr_matrix:
    """The CSR matrix of the row ``blocks`` (in order; ``nnz`` stored values in all), written
    into arrays allocated once at their final size instead of joined at the end (which held the
    matrix twice). The arrays live in a scratch file, memory-mapped (:func:`_scratch_array`):
    the system keeps in memory what room allows, so the selected matrix need not fit in it.
    """
    idx = _index_dtype(nnz, n_rows, n_cols)
    data = _scratch_array(nnz, np.float32)
    indices = _scratch_array(nnz, idx)
    indptr = np.zeros(n_rows + 1, dtype=idx)
    row = pos = 0
    for b in blocks:
        b.sort_indices()
        k = b.nnz
        if pos + k > nnz or row + b.shape[0] > n_rows:
            raise RuntimeError("the input changed between two passes over it")
        data[pos : pos + k] = b.data
        indices[pos : pos + k] = b.indices
        indptr[row + 1 : row + 1 + b.shape[0]] = b.indptr[1:] + pos
        row, pos = row + b.shape[0], pos + k
    if (row, pos) != (n_rows, nnz):
        raise RuntimeError("the input changed between two passes over it")
    return _csr_over(data, indices, indptr, n_cols)


def _spill_csr(blocks, n_cols: int) -> sp.csr_matrix:
    """The CSR matrix of the row ``blocks`` (in order) when their number of stored values is
    not known before the one pass over them: values and column indices are appended to two
    unlinked scratch files in the temporary folder and memory-mapped at the end, so the matrix
    is never held twice (joining the blocks held it twice). Where the folder has no room, what
    was written is read back and the rest kept in memory.
    """
    kinds = (np.float32, np.int32)  # values, column indices
    parts: list[tuple[list, list]] | None = None  # (values, indices) in memory, if no room
    files = []
    try:
        files = [tempfile.TemporaryFile(prefix="orca_sc-") for _ in range(2)]
    except OSError as e:
        logger.info("No scratch file (%s); the matrix is kept in memory.", e)
        parts = ([], [])
    row_counts, nnz = [], 0
    try:
        for b in blocks:
            b.sort_indices()
            values = np.ascontiguousarray(b.data, dtype=kinds[0])
            cols = np.ascontiguousarray(b.indices, dtype=kinds[1])
            if parts is None:
                try:
                    _append(files[0], values)
                    _append(files[1], cols)
                except OSError as e:
                    logger.info("No room for the scratch file (%s); kept in memory.", e)
                    parts = tuple(
                        [_read_back(f, dt, nnz)] for f, dt in zip(files, kinds, strict=True)
                    )
            if parts is not None:
                parts[0].append(values)
                parts[1].append(cols)
            row_counts.append(np.diff(b.indptr))
            nnz += b.nnz
        if parts is None:
            data, indices = (_mapped(f, dt, nnz) for f, dt in zip(files, kinds, strict=True))
        else:
            data, indices = (
                np.concatenate([np.empty(0, dt), *p]) for p, dt in zip(parts, kinds, strict=True)
            )
    finally:
        for f in files:
            f.close()  # a mapped file lives on in its mapping
    counts = np.concatenate([np.empty(0, np.int64), *row_counts])
    idx = _index_dtype(nnz, counts.size, n_cols)
    if idx is np.int64:  # 2**31 stored values or more: scipy wants indices as wide as indptr
        wide = _scratch_array(nnz, np.int64)
        for lo in range(0, nnz, 1 << 26):
            wide[lo : lo + (1 << 26)] = indices[lo : lo + (1 << 26)]
        indices = wide
    indptr = np.zeros(counts.size + 1, dtype=idx)
    np.cumsum(counts, out=indptr[1:])
    return _csr_over(data, indices, indptr, n_cols)


def _index_dtype(*sizes: int):
    """The index dtype of a CSR matrix with these sizes (stored values, rows, columns):
    ``int32`` while they fit in it, as scipy would choose.
    """
    return np.int32 if max(sizes) < np.iinfo(np.int32).max else np.int64


def _csr_over(data, indices, indptr, n_cols: int) -> sp.csr_matrix:
    """A float32 CSR matrix over the given arrays (sorted columns in each row) as they are:
    no format check, which would copy memory-mapped arrays into memory.
    """
    X = sp.csr_matrix((indptr.size - 1, n_cols), dtype=np.float32)
    X.data, X.indices, X.indptr = data, indices, indptr
    X.has_sorted_indices = True
    return X


def _append(f, values: np.ndarray) -> None:
    f.write(memoryview(values).cast("B"))


def _read_back(f, dtype, n: int) -> np.ndarray:
    f.flush()
    f.seek(0)
    return np.fromfile(f, dtype=dtype, count=n)


def _mapped(f, dtype, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, dtype=dtype)
    f.flush()
    return np.memmap(f, dtype=dtype, mode="r+", shape=(n,))


def _scratch_array(n: int, dtype) -> np.ndarray:
    """A zero-filled array of ``n`` values of ``dtype`` in a memory-mapped file in the temporary
    folder (``TMPDIR``), unlinked at once (its space is freed when the array is); in memory
    when the folder lacks the space (the space is reserved first, so that a full disk is an
    error here and not a crash on a later write).
    """
    size = n * np.dtype(dtype).itemsize
    if size == 0:
        return np.zeros(n, dtype=dtype)
    fd, path = tempfile.mkstemp(prefix="orca_sc-", suffix=".bin")
    try:
        os.unlink(path)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
        with open(fd, "r+b", closefd=False) as f:
            return np.memmap(f, dtype=dtype, mode="r+", shape=(n,))
    except OSError as e:
        logger.info("No room for a %.1f GiB scratch file (%s); kept in memory.", size / 2**30, e)
        return np.zeros(n, dtype=dtype)
    finally:
        os.close(fd)


def _agree_on_reading(readers: list, comm: Any) -> None:
    """After a sharded first pass: the checks one process makes on a whole input, made on the
    ranks' sums (an input of only zeros; counts in some cells and log values in others), and
    the value scale and number of empty cells of each input set alike on every rank.
    """
    seen = comm.gather_objects([(r.scale, r.nnz, r.n_empty) for r in readers])
    for i, reader in enumerate(readers):
        scales = [s[i][0] for s in seen if s[i][0] is not None]
        where = f"{reader.what} {reader.source}"
        if sum(s[i][1] for s in seen) == 0:
            raise _only_zeros(where)
        if len(set(scales)) > 1:
            msg = (
                f"The {where} holds integer counts in some cells but non-integer values in "
                "others; pass one kind of values (all counts, or all log-normalised)."
            )
            raise OrcaInputError(msg)
        reader.scale = scales[0] if scales else "counts"
        reader.n_empty = sum(s[i][2] for s in seen)


def _kept_rows(keep: np.ndarray | None, start: int, stop: int) -> np.ndarray:
    """The rows of ``start:stop`` that ``keep`` (sorted; ``None``: all) keeps."""
    if keep is None:
        return np.arange(start, stop)
    return keep[np.searchsorted(keep, start) : np.searchsorted(keep, stop)]


def _check_expressed(
    nnz_per_cell: np.ndarray,
    domain: np.ndarray,
    names: np.ndarray,
    batch_key: str | None,
    n_genes: int,
) -> None:
    """Every batch (the reference and the query without ``batch_key``) must express some of the
    genes used; an all-zero batch has nothing to align or annotate. ``nnz_per_cell``: stored
    values per cell (``domain``: its batch), or per batch with ``domain = arange``.
    """
    nnz = np.bincount(domain, weights=nnz_per_cell, minlength=len(names))
    for name, n in zip(names, nnz, strict=True):
        if n == 0:
            what = f"batch {name!r} of obs[{batch_key!r}]" if batch_key else f"the {name}"
            msg = (
                f"The cells of {what} have no non-zero values in the {n_genes} genes used; "
                "check that the matrix holds expression and that gene names match."
            )
            raise OrcaInputError(msg)


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


def _check_n_novel(n_novel: int | str, n_unlabeled: int, min_cells: int) -> None:
    """Refuse more novel types than unlabelled cells (each head would be allocated anyway: a
    billion heads is a MemoryError after the warm-up); warn when there are fewer than
    ``min_cells`` (the smallest novel cluster discovery reports) cells per novel type.
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
