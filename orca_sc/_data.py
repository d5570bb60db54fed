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
from ._errors import OrcaInputError
from ._hvg import GeneStats, select_from_stats
from ._labels import (
    _check_label_values,
    _check_labels,
    _check_n_novel,
    _class_order,
    _encode,
    _is_unlabeled,
    _labels_column,
)
from ._read import ChunkReader, on_disk, only_zeros, open_matrix, warn_empty
from ._store import fill_csr

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
    rep: np.ndarray | None = None  # (n_cells, d) float32: the user's embedding (use_rep)
    #: (n_cells,) each cell's counts over all its genes where the input held counts, else NaN
    totals: np.ndarray | None = None

    @property
    def n_cells(self) -> int:
        return self.X.shape[0]

    @property
    def labeled(self) -> np.ndarray:
        return self.labels >= 0


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


# --------------------------------------------------------------------------------------------
# the entry point
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Input:
    """One AnnData to read: ``keep`` its rows that are used (sorted; ``None``: all), ``cols``
    its column of each shared gene.
    """

    adata: Any
    what: str
    keep: np.ndarray | None
    cols: np.ndarray


@dataclass(frozen=True)
class _Encoded:
    """Everything prepared before any matrix is read: labels, genes, batches, inputs."""

    inputs: list[_Input]  # in row order: the reference (if any), then the query
    labels: np.ndarray
    classes: list[str]
    genes: list[str]  # shared genes
    batches: np.ndarray  # batch name of every row
    output_rows: np.ndarray


def prepare(
    adata: Any,
    reference: Any | None,
    labels_key: str,
    config: OrcaConfig,
    comm: Any = None,
    min_shared_genes: int = 100,
) -> PreparedData:
    """Turn (query, reference) AnnData into :class:`PreparedData`: encode labels, align genes,
    read the selected genes.

    Without ``reference`` the labelled cells of ``adata`` (``obs[labels_key]`` not NaN and not one
    of ``config.unlabeled_category``) are the reference and the other cells the query.

    ``comm`` (:class:`orca_sc._dist.Comm`, several processes): input on disk is read by each
    rank for its share of the cells, the gene statistics are summed over the ranks, and every
    rank ends with the whole selected matrix. Input in memory is prepared by every rank alike.
    """
    # everything that can be checked without the matrices first: no work (and no warning about
    # the values) before an error about the labels, genes, batches or options
    enc = (
        _encode_single(adata, labels_key, config, min_shared_genes)
        if reference is None
        else _encode_reference(adata, reference, labels_key, config, min_shared_genes)
    )
    _check_labels(enc.labels, enc.classes, labels_key)
    n_unlabeled = int((enc.labels < 0).sum())
    _check_n_novel(config.n_novel, n_unlabeled)
    domain_names, domain = np.unique(enc.batches.astype(str), return_inverse=True)
    rep = read_rep(enc.inputs, config.discovery.use_rep)
    X, hv, input_scale, totals = read_selected(enc.inputs, domain, domain_names, config, comm)
    X.sort_indices()
    genes = [enc.genes[i] for i in hv]
    info = {
        "streamed": any(on_disk(i.adata, config.layer) for i in enc.inputs),
        "n_shared_genes": len(enc.genes),
        "n_genes_used": len(genes),
        "n_labeled": int((enc.labels >= 0).sum()),
        "n_unlabeled": n_unlabeled,
    }
    return PreparedData(
        X=X,
        genes=genes,
        labels=enc.labels,
        classes=enc.classes,
        domain=domain.astype(np.int64),
        domain_names=[str(d) for d in domain_names],
        output_rows=enc.output_rows,
        input_scale=input_scale,
        info=info,
        rep=rep,
        totals=totals,
    )


def read_rep(inputs: list[_Input], key: str | None) -> np.ndarray | None:
    """``obsm[key]`` of every input's used rows, in row order, as one ``(n_cells, d)`` float32
    array (``None`` without ``key``). Checked: present in every input, a numeric matrix of at
    least 2 columns, finite, and of one width across the inputs.
    """
    if key is None:
        return None
    parts, widths = [], {}
    for inp in inputs:
        a = inp.adata
        if key not in a.obsm:
            have = list(a.obsm.keys())
            msg = (
                f"use_rep={key!r} is not in the {inp.what}'s obsm (it holds "
                f"{have if have else 'nothing'}); store the joint embedding of reference and "
                "query (e.g. scvi-tools' get_latent_representation()) in each, or leave "
                "use_rep unset."
            )
            raise OrcaInputError(msg)
        m = a.obsm[key]
        m = m.toarray() if sp.issparse(m) else np.asarray(m)
        if m.ndim != 2 or m.shape[1] < 2 or not np.issubdtype(m.dtype, np.number):
            msg = (
                f"obsm[{key!r}] of the {inp.what} is not a numeric matrix of at least 2 "
                f"columns (shape {m.shape}, dtype {m.dtype}); pass an embedding, one row per cell."
            )
            raise OrcaInputError(msg)
        if inp.keep is not None:
            m = m[inp.keep]
        bad = int(np.size(m) - np.isfinite(m).sum())
        if bad:
            msg = (
                f"obsm[{key!r}] of the {inp.what} holds {bad} non-finite value(s) (NaN or "
                "infinite); recompute the embedding or drop those cells."
            )
            raise OrcaInputError(msg)
        widths[inp.what] = m.shape[1]
        parts.append(m.astype(np.float32, copy=False))
    if len(set(widths.values())) > 1:
        msg = (
            f"obsm[{key!r}] has {widths} columns: reference and query need one joint embedding "
            "of the same width (compute it on their cells together)."
        )
        raise OrcaInputError(msg)
    return np.ascontiguousarray(np.concatenate(parts))


def _encode_single(
    adata: Any, labels_key: str, config: OrcaConfig, min_shared_genes: int
) -> _Encoded:
    """One AnnData: its labelled cells are the reference, the others the query."""
    what = "AnnData"
    _check_has_cells(adata, what)
    check_unique_genes(adata.var_names, what)
    col = _labels_column(adata, labels_key, what)
    unl = _is_unlabeled(col, config.unlabeled_category)
    _check_label_values(adata, col, unl, labels_key, what)
    classes = _class_order(col, ~unl)
    genes = adata.var_names.astype(str).tolist()
    if len(genes) < min_shared_genes:
        msg = (
            f"The {what} has {len(genes)} gene(s); ORCA needs at least "
            f"{min_shared_genes} to tell cell types apart. Pass the "
            "full expression matrix."
        )
        raise OrcaInputError(msg)
    if config.batch_key is not None:
        batches = batch_column(adata, config.batch_key, what)
    else:
        batches = np.full(adata.n_obs, "data", dtype=object)
    inputs = [_Input(adata, what, None, np.arange(len(genes)))]
    rows = np.arange(adata.n_obs)
    return _Encoded(inputs, _encode(col, unl, classes), classes, genes, batches, rows)


def _encode_reference(
    adata: Any, reference: Any, labels_key: str, config: OrcaConfig, min_shared_genes: int
) -> _Encoded:
    """A labelled reference (its unlabelled cells dropped) and a query, or several queries
    (``adata`` a list: their cells follow one another, each query a batch of its own unless
    ``batch_key`` names their batches).
    """
    queries = list(adata) if isinstance(adata, (list, tuple)) else [adata]
    several = isinstance(adata, (list, tuple))
    names = [f"query_{i + 1}" for i in range(len(queries))] if several else ["query"]
    _check_has_cells(reference, "reference")
    for q, name in zip(queries, names, strict=True):
        _check_has_cells(q, name)
        check_unique_genes(q.var_names, name)
    check_unique_genes(reference.var_names, "reference")
    col = _labels_column(reference, labels_key, "reference")
    unl = _is_unlabeled(col, config.unlabeled_category)
    _check_label_values(reference, col, unl, labels_key, "reference")
    if unl.all():
        msg = (
            f"The reference has no labelled cells in obs[{labels_key!r}] (all NaN or one of "
            f"{list(config.unlabeled_category)}); pass a labelled reference."
        )
        raise OrcaInputError(msg)
    keep = np.flatnonzero(~unl)
    classes = _class_order(col, ~unl)
    n_query = sum(q.n_obs for q in queries)
    labels = np.concatenate(
        [_encode(col, unl, classes)[keep], np.full(n_query, -1, dtype=np.int64)]
    )
    genes = reference.var_names.astype(str)
    for q in queries:  # genes of the reference found in every query
        genes = pd.Index(shared_genes(genes, q.var_names.astype(str), min_shared_genes))
    genes = genes.tolist()
    if config.batch_key is not None:
        parts = [batch_column(reference, config.batch_key, "reference")[keep]]
        parts += [batch_column(q, config.batch_key, n) for q, n in zip(queries, names, strict=True)]
        batches = np.concatenate(parts)
    else:
        parts = [["reference"] * len(keep)] + [[n] * q.n_obs for q, n in zip(queries, names,
                                                                              strict=True)]  # fmt: skip
        batches = np.array([b for part in parts for b in part], dtype=object)
    if unl.any():
        logger.info("Dropping %d unlabelled reference cells.", int(unl.sum()))
    inputs = [_Input(reference, "reference", keep, reference.var_names.get_indexer(genes))]
    inputs += [_Input(q, n, None, q.var_names.get_indexer(genes)) for q, n in zip(queries, names,
                                                                                 strict=True)]  # fmt: skip
    return _Encoded(inputs, labels, classes, genes, batches, np.arange(len(keep), len(labels)))


def _check_has_cells(adata: Any, what: str) -> None:
    if adata.n_obs == 0:
        msg = f"The {what} has no cells (n_obs = 0); pass an AnnData with at least one cell."
        raise OrcaInputError(msg)


def read_selected(
    inputs: list[_Input],
    domain: np.ndarray,
    domain_names: np.ndarray,
    config: OrcaConfig,
    comm: Any = None,
) -> tuple[sp.csr_matrix, np.ndarray, dict[str, str]]:
    """Read, normalise and join the inputs' rows and shared genes, and select the highly
    variable genes (:mod:`orca_sc._hvg`: per-batch statistics summed over chunks, the same genes
    as scanpy's seurat flavour on the whole matrix). Two passes over each input's chunks
    (:func:`orca_sc._read.open_matrix`: in memory or on disk alike): the first sums the gene
    statistics, the second takes the selected genes. Peak memory: one chunk of all genes; the
    selected matrix of input on disk is written into a scratch file
    (:func:`orca_sc._store.fill_csr`). Returns ``(X, selected gene indices, input scales)``.

    With several processes (``comm``) and input on disk, each rank reads its share of each
    input's rows; the statistics are summed over the ranks and the selected rows gathered.
    """
    streamed = any(on_disk(i.adata, config.layer) for i in inputs)
    multi = streamed and comm is not None and comm.active
    n_shared = inputs[0].cols.size
    readers, spans = _readers(inputs, config, comm if multi else None)
    starts = np.cumsum([0] + [i.adata.n_obs if i.keep is None else i.keep.size for i in inputs])

    # each cell's counts (over all its genes) where its input holds counts, NaN elsewhere
    totals = np.full(int(starts[-1]), np.nan)

    def rows_of(i: int):  # input i's chunks: (rows of the run, chunk of its kept rows)
        inp, span = inputs[i], spans[i]
        for start, stop, m in readers[i]:
            lo = int(span[start]) if span.size else 0
            rows = _kept_rows(inp.keep, lo, lo + stop - start)
            pos = starts[i] + (rows if inp.keep is None else np.searchsorted(inp.keep, rows))
            if readers[i].last_totals is not None:
                totals[pos] = readers[i].last_totals[rows - lo]
            yield pos, m[rows - lo]

    stats = GeneStats(len(domain_names), n_shared)
    # stored values per gene: the size of the selected matrix, allocated once (one process)
    stored = np.zeros(n_shared, dtype=np.int64)
    count = not multi

    def first_pass() -> None:
        for i, inp in enumerate(inputs):
            for pos, m in rows_of(i):
                sub = _columns(m, inp.cols)
                stats.add(sub, domain[pos])
                if count:
                    stored[:] += np.bincount(sub.indices, minlength=n_shared)

    if not multi:
        first_pass()
    else:
        comm.agree(first_pass)
        stats.apply(comm.sum)
        _agree_on_reading(readers, comm)
    for reader in readers:
        if reader.n_empty and (not multi or comm.main):
            warn_empty(reader.n_empty, stacklevel=4)
    per_batch = stats.nnz.sum(axis=1)
    _check_expressed(per_batch, np.arange(len(domain_names)), domain_names, config.batch_key,
                     n_shared)  # fmt: skip
    hv = select_from_stats(stats, config.n_genes)

    def selected(i: int):  # the second pass: input i's selected genes, chunk by chunk
        cols = inputs[i].cols[hv]
        for _, m in rows_of(i):
            yield _columns(m, cols)

    scales = {inp.what: r.scale for inp, r in zip(inputs, readers, strict=True)}
    if multi:  # every rank gets each input's whole selected matrix, in row order
        blocks = []
        for i in range(len(inputs)):
            empty = sp.csr_matrix((0, hv.size), dtype=np.float32)
            blocks.extend(comm.gather_objects(sp.vstack([empty, *selected(i)], format="csr")))
        # each rank read its share of the totals, NaN elsewhere (fmax skips NaN)
        totals = np.fmax.reduce(np.stack(comm.gather_objects(totals)), axis=0)
        return sp.vstack(blocks, format="csr", dtype=np.float32), hv, scales, totals
    # written chunk by chunk into arrays of its final size (joining the chunks held the selected
    # matrix twice: 100,000 cells at 43% non-zeros peaked 0.6 GiB above the budget); for input
    # on disk into a scratch file
    chunks = (b for i in range(len(inputs)) for b in selected(i))
    X = fill_csr(chunks, int(stats.n.sum()), hv.size, int(stored[hv].sum()), scratch=streamed)
    return X, hv, scales, totals


def _columns(m: sp.csr_matrix, cols: np.ndarray) -> sp.csr_matrix:
    """``m[:, cols]``; ``m`` itself where ``cols`` are all its columns in order (no copy)."""
    if cols.size == m.shape[1] and bool((cols == np.arange(cols.size)).all()):
        return m
    return m[:, cols]


def _readers(inputs: list[_Input], config: OrcaConfig, comm: Any) -> tuple[list, list]:
    """A reader of each input and the rows it reads: all of them, or with several processes
    (``comm``) this rank's share.
    """
    readers, spans = [], []
    for inp in inputs:
        n = inp.adata.n_obs
        if comm is None:
            readers.append(open_matrix(inp.adata, config.layer, inp.what, config.target_sum))
            spans.append(np.arange(n))
        else:
            spans.append(comm.share(n))
            readers.append(ChunkReader(inp.adata, config.layer, inp.what, config.target_sum,
                                       rows=spans[-1], require_values=False))  # fmt: skip
    return readers, spans


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
            raise only_zeros(where)
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
