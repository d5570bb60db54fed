"""Reading expression matrices: ``.X`` or a layer, checked (finite, non-negative, numbers),
its value scale detected (raw counts or log-normalised), counts normalised (``target_sum`` per
cell + ``log1p``). :func:`open_matrix` gives a reader of a matrix in memory or on disk alike:
chunks of cells, each checked and log-normalised, CSR float32; the caller's matrix is never
modified.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import scipy.sparse as sp

from ._errors import OrcaInputError
from ._store import csr_over


def get_matrix(adata: Any, layer: str | None, what: str) -> sp.csr_matrix:
    """The expression matrix of ``adata`` (``.X`` or a layer) as CSR float32, checked."""
    X, source = _source_matrix(adata, layer, what)
    if hasattr(X, "to_memory"):  # backed / lazy arrays
        X = X.to_memory()
    X = _checked_csr(X, f"{what} {source}")
    if X.nnz == 0:
        raise only_zeros(f"{what} {source}")
    return X


def only_zeros(where: str) -> OrcaInputError:
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

    on_disk = True

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
        #: the counts per cell of the chunk last given out (``None``: not counts)
        self.last_totals: np.ndarray | None = None

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
            self.last_totals = None
            if self.scale in (None, "counts"):
                self.n_empty += int((np.diff(m.indptr) == 0).sum())
                totals = np.asarray(m.sum(axis=1)).ravel()  # in the matrix's own dtype
                self.last_totals = totals.astype(np.float64)
                m = log_normalize(m, self.target_sum, warn=False, totals=totals)
            yield start, stop, m
        self.nnz = nnz
        if nnz == 0 and self.require_values:
            raise only_zeros(where)
        if self.scale is None:
            self.scale = "counts"


class MemoryReader:
    """A matrix held in memory read as :class:`ChunkReader` reads one on disk: checked and its
    value scale detected once on the whole matrix, then given out in chunks of ``CHUNK_CELLS``
    cells, each normalised as it is given out (a normalised copy of the whole matrix would
    double its memory: 100,000 cells at 43% non-zeros peaked 0.6 GiB above the budget).
    """

    on_disk = False

    def __init__(self, adata: Any, layer: str | None, what: str, target_sum: float) -> None:
        X = get_matrix(adata, layer, what)
        self.scale = detect_scale(X)
        self.n_empty = 0
        if self.scale == "counts":
            self.n_empty = int((np.diff(X.indptr) == 0).sum())
        self.X = X
        self.target_sum = target_sum
        self.nnz = X.nnz
        self.n_obs = X.shape[0]
        self.last_totals: np.ndarray | None = None

    def __iter__(self):
        """``(start, stop, chunk)``, as :meth:`ChunkReader.__iter__`."""
        for start in range(0, self.n_obs, CHUNK_CELLS):
            stop = min(self.n_obs, start + CHUNK_CELLS)
            self.last_totals = None
            if self.scale == "counts":  # normalised into a copy: the rows are read in place
                m = _row_view(self.X, start, stop)
                totals = np.asarray(m.sum(axis=1)).ravel()  # in the matrix's own dtype
                self.last_totals = totals.astype(np.float64)
                m = log_normalize(m, self.target_sum, warn=False, totals=totals)
            else:  # a copy: later steps sort its indices in place
                m = self.X[start:stop]
            yield start, stop, m


def _row_view(X: sp.csr_matrix, start: int, stop: int) -> sp.csr_matrix:
    """The rows ``start:stop`` of the canonical float32 ``X`` as a CSR matrix over ``X``'s own
    arrays (:func:`orca_sc._store.csr_over`: no copy, no format check; not to be modified).
    """
    lo, hi = X.indptr[start], X.indptr[stop]
    return csr_over(X.data[lo:hi], X.indices[lo:hi], X.indptr[start : stop + 1] - lo, X.shape[1])


def open_matrix(
    adata: Any, layer: str | None, what: str, target_sum: float
) -> ChunkReader | MemoryReader:
    """A reader of the expression matrix of ``adata``: chunks of log-normalised cells, from disk
    (:class:`ChunkReader`) or from memory (:class:`MemoryReader`).
    """
    if on_disk(adata, layer):
        return ChunkReader(adata, layer, what, target_sum)
    return MemoryReader(adata, layer, what, target_sum)


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


def log_normalize(
    X: sp.csr_matrix, target_sum: float, warn: bool = True, totals: np.ndarray | None = None
) -> sp.csr_matrix:
    """Counts -> ``log1p(target_sum * x / total)`` per cell; sparse in, sparse out. ``totals``:
    the cells' counts where the caller has summed them already.
    """
    totals = np.asarray(X.sum(axis=1)).ravel() if totals is None else totals
    n_empty = int((totals == 0).sum())
    if n_empty and warn:
        warn_empty(n_empty)
    factors = np.divide(target_sum, totals, out=np.zeros_like(totals), where=totals > 0)
    Y = sp.csr_matrix(X, dtype=np.float32, copy=True)
    Y.data *= np.repeat(factors.astype(np.float32), np.diff(Y.indptr))
    np.log1p(Y.data, out=Y.data)
    return Y


def warn_empty(n_empty: int, stacklevel: int = 5) -> None:
    warnings.warn(
        f"{n_empty} cells have no counts; they stay all-zero after normalisation. "
        "Filter them out (sc.pp.filter_cells(adata, min_counts=1)) for cleaner results.",
        UserWarning,
        stacklevel=stacklevel,
    )


def to_log_normalized(X: sp.csr_matrix, target_sum: float) -> tuple[sp.csr_matrix, str]:
    scale = detect_scale(X)
    if scale == "counts":
        return log_normalize(X, target_sum), scale
    return X, scale
