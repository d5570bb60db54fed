"""Where a selected expression matrix lives when it is built from chunks: arrays allocated once
at their final size (or appended to as the chunks come) in unlinked, memory-mapped scratch files
in the temporary folder, so that the system keeps in memory what room allows and the matrix is
never held twice. Used by data preparation and by prediction on data read from disk.
"""

from __future__ import annotations

import logging
import os
import tempfile

import numpy as np
import scipy.sparse as sp

logger = logging.getLogger(__name__)


def fill_csr(blocks, n_rows: int, n_cols: int, nnz: int, scratch: bool = True) -> sp.csr_matrix:
    """The CSR matrix of the row ``blocks`` (in order; ``nnz`` stored values in all), written
    into arrays allocated once at their final size instead of joined at the end (which held the
    matrix twice). With ``scratch`` the arrays live in a scratch file, memory-mapped
    (:func:`scratch_array`): the system keeps in memory what room allows, so the selected
    matrix need not fit in it; without, in memory.
    """
    idx = index_dtype(nnz, n_rows, n_cols)
    alloc = scratch_array if scratch else np.empty
    data = alloc(nnz, np.float32)
    indices = alloc(nnz, idx)
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
    return csr_over(data, indices, indptr, n_cols)


def spill_csr(blocks, n_cols: int) -> sp.csr_matrix:
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
    idx = index_dtype(nnz, counts.size, n_cols)
    if idx is np.int64:  # 2**31 stored values or more: scipy wants indices as wide as indptr
        wide = scratch_array(nnz, np.int64)
        for lo in range(0, nnz, 1 << 26):
            wide[lo : lo + (1 << 26)] = indices[lo : lo + (1 << 26)]
        indices = wide
    indptr = np.zeros(counts.size + 1, dtype=idx)
    np.cumsum(counts, out=indptr[1:])
    return csr_over(data, indices, indptr, n_cols)


def index_dtype(*sizes: int):
    """The index dtype of a CSR matrix with these sizes (stored values, rows, columns):
    ``int32`` while they fit in it, as scipy would choose.
    """
    return np.int32 if max(sizes) < np.iinfo(np.int32).max else np.int64


def csr_over(data, indices, indptr, n_cols: int) -> sp.csr_matrix:
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


def scratch_array(n: int, dtype) -> np.ndarray:
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
