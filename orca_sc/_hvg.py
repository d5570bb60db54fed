"""Highly variable genes from streamed statistics: scanpy's ``flavor="seurat"`` selection
(batch-aware) computed from per-batch sums accumulated chunk by chunk, so that a matrix read
from disk in pieces never has to be held whole. :func:`seurat_from_stats` follows
``scanpy.pp.highly_variable_genes`` (scanpy 1.11) step by step; a test checks that both select
the same genes.
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import scipy.sparse as sp


class GeneStats:
    """Per-batch sums over cells of log-normalised expression, accumulated chunk by chunk:
    cells, ``sum`` and ``sumsq`` of ``expm1(x)`` (what the seurat flavour ranks), cells
    expressing each gene, and ``sum`` / ``sumsq`` of ``x`` itself (the fallback ranking by
    variance). All in float64.
    """

    def __init__(self, n_batches: int, n_genes: int) -> None:
        shape = (n_batches, n_genes)
        self.n = np.zeros(n_batches, dtype=np.int64)
        self.sum = np.zeros(shape)
        self.sumsq = np.zeros(shape)
        self.nnz = np.zeros(shape, dtype=np.int64)
        self.log_sum = np.zeros(shape)
        self.log_sumsq = np.zeros(shape)

    def apply(self, fn) -> None:
        """Replace each array by ``fn(array)`` (e.g. its sum over several processes)."""
        for name in ("n", "sum", "sumsq", "nnz", "log_sum", "log_sumsq"):
            setattr(self, name, fn(getattr(self, name)))

    def add(self, X: sp.csr_matrix, batch: np.ndarray) -> None:
        """Add the cells of ``X`` (log-normalised, CSR) whose batch codes are ``batch``."""
        nb = self.n.size
        ind = sp.csr_matrix(
            (np.ones(batch.size), (batch, np.arange(batch.size))), shape=(nb, batch.size)
        )
        self.n += np.bincount(batch, minlength=nb)
        X = sp.csr_matrix(X)
        e = X.copy()
        e.data = np.expm1(X.data).astype(np.float64)  # scanpy: expm1 in float32, sums in float64
        self.sum += np.asarray((ind @ e).todense())
        e.data **= 2
        self.sumsq += np.asarray((ind @ e).todense())
        e.data = (X.data > 0).astype(np.float64)
        self.nnz += np.asarray((ind @ e).todense()).astype(np.int64)
        e.data = X.data.astype(np.float64)
        self.log_sum += np.asarray((ind @ e).todense())
        e.data **= 2
        self.log_sumsq += np.asarray((ind @ e).todense())


def _mean_var(n: int, s: np.ndarray, sq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = s / n
    var = sq / n - mean**2
    if n != 1:  # scanpy's unbiased variance
        var = var * (n / (n - 1))
    return mean, var


def _single_batch(mean: np.ndarray, var: np.ndarray, n_top: int, n_bins: int) -> pd.DataFrame:
    """As scanpy's ``_highly_variable_genes_single_batch`` (seurat flavour, ``n_top_genes``) from
    the means and variances of ``expm1(x)``.
    """
    mean = mean.copy()
    mean[mean == 0] = 1e-12
    dispersion = var / mean
    dispersion[dispersion == 0] = np.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        dispersion = np.log(dispersion)
    mean = np.log1p(mean)
    df = pd.DataFrame({"means": mean, "dispersions": dispersion})
    df["mean_bin"] = pd.cut(df["means"], bins=n_bins)
    stats = df.groupby("mean_bin", observed=True)["dispersions"].agg(avg="mean", dev="std")
    one = stats["dev"].isnull()  # a bin with one gene: its normalised dispersion is 1
    stats.loc[one, "dev"] = stats.loc[one, "avg"]
    stats.loc[one, "avg"] = 0
    stats = stats.loc[df["mean_bin"]].set_index(df.index)
    df["dispersions_norm"] = (df["dispersions"] - stats["avg"]) / stats["dev"]
    norm = df["dispersions_norm"].to_numpy()
    defined = norm[~np.isnan(norm)]
    if defined.size == 0:
        raise ValueError("no gene has a defined dispersion")
    n = min(n_top, mean.size, defined.size)
    cut = np.sort(defined)[::-1][n - 1]
    df["highly_variable"] = np.nan_to_num(norm, nan=-np.inf) >= cut
    return df


def seurat_from_stats(
    stats: GeneStats, batches: np.ndarray, n_top: int, n_bins: int = 20
) -> np.ndarray:
    """Boolean mask of the highly variable genes over the batches ``batches`` (codes into
    ``stats``), as ``sc.pp.highly_variable_genes(flavor="seurat", n_top_genes=n_top,
    batch_key=...)`` on those cells; one batch: as without ``batch_key``.
    Raises ``ValueError`` where scanpy cannot rank (no gene has a defined dispersion).
    """
    n_genes = stats.sum.shape[1]
    if batches.size == 1:
        b = int(batches[0])
        mean, var = _mean_var(int(stats.n[b]), stats.sum[b], stats.sumsq[b])
        return _single_batch(mean, var, n_top, n_bins)["highly_variable"].to_numpy()
    dfs = []
    for b in batches:
        keep = stats.nnz[b] > 0  # scanpy drops genes no cell of the batch expresses
        mean, var = _mean_var(int(stats.n[b]), stats.sum[b][keep], stats.sumsq[b][keep])
        df = _single_batch(mean, var, n_top, n_bins)
        df.index = np.flatnonzero(keep)
        if not keep.all():  # zeros for the dropped genes, as scanpy fills them
            missing = pd.DataFrame(
                np.zeros((int((~keep).sum()), len(df.columns))), columns=df.columns
            )
            missing["highly_variable"] = missing["highly_variable"].astype(bool)
            missing.index = np.flatnonzero(~keep)
            df = pd.concat([df, missing]).loc[np.arange(n_genes)]
        dfs.append(df)
    df = pd.concat(dfs, axis=0)
    df["highly_variable"] = df["highly_variable"].astype(int)
    df = df.groupby(df.index, observed=True).agg(
        {
            "means": "mean",
            "dispersions": "mean",
            "dispersions_norm": "mean",
            "highly_variable": "sum",
        }
    )
    df["nbatches"] = df["highly_variable"]
    order = df.index.copy()
    df = df.sort_values(["nbatches", "dispersions_norm"], ascending=False, na_position="last")
    df["highly_variable"] = np.arange(df.shape[0]) < n_top
    return df.loc[order, "highly_variable"].to_numpy()


def select_from_stats(stats: GeneStats, n_genes: int | None) -> np.ndarray:
    """Indices of ``n_genes`` highly variable genes as :func:`select_genes`
    chooses them on the whole matrix: batches of one cell take no part in the ranking (unless
    no batch has two cells); where no gene has a defined dispersion, the genes of highest
    variance of ``x`` over all cells.
    """
    n_all = stats.sum.shape[1]
    if n_genes is None or n_genes >= n_all:
        return np.arange(n_all)
    present = np.flatnonzero(stats.n > 0)
    ranked = present[stats.n[present] >= 2]
    if ranked.size == present.size or ranked.size == 0:
        ranked = present
    try:
        if ranked.size > 1:
            hv = seurat_from_stats(stats, ranked, n_genes)
        else:
            merged = _merge(stats, ranked)
            hv = seurat_from_stats(merged, np.array([0]), n_genes)
    except (ValueError, IndexError):
        n = stats.n.sum()
        mean = stats.log_sum.sum(axis=0) / n
        var = stats.log_sumsq.sum(axis=0) / n - mean**2
        return np.sort(np.argsort(-var, kind="stable")[:n_genes])
    return np.flatnonzero(hv)


def _merge(stats: GeneStats, batches: np.ndarray) -> GeneStats:
    out = GeneStats(1, stats.sum.shape[1])
    for name in ("n", "sum", "sumsq", "nnz", "log_sum", "log_sumsq"):
        getattr(out, name)[...] = getattr(stats, name)[batches].sum(axis=0)
    return out


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
