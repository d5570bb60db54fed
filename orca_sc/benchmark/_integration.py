"""How well a task's reference and query mix before and after integration, and whether
integration pulls novel types onto known ones (issue "ORCA core 4"), from the task's data alone
(no ORCA run): the joint log-normalised PCA of reference and query (2,000 highly variable genes,
50 components) against Harmony on it (batch: reference / query; :func:`orca_sc._integrate.harmony`)
and against the query moved onto the reference by mutual nearest neighbours
(:func:`orca_sc._integrate.mnn_correct`).

For each space:

* ``mix``: share of known-type query cells with a reference cell of the same type among their
  15 nearest neighbours (reference and query cells together);
* ``sep_qshare``: AUROC of novel- vs known-type query cells for the share of query cells among
  the 15 neighbours (novel types sit among query cells);
* ``sep_knn``: AUROC for the mean distance to the 10 nearest reference cells (the kNN novelty
  score);
* ``over``: share of novel-type query cells whose 15 neighbours are mostly reference cells of
  one known type (over-correction: a novel type pulled onto a known one).

A protocol split (reference and query from one batch) has nothing to integrate: its Harmony
and MNN figures are those of the PCA.
"""

from __future__ import annotations

import time
import warnings

import numpy as np

from ._splits import Task

N_NEIGHBORS = 15
REF_NEIGHBORS = 10


def integration_figures(task: Task, seed: int = 0, n_pcs: int = 50) -> dict[str, float]:
    """The module's figures for ``task``, with the PCA, the Harmony embedding and the
    mutual-nearest-neighbour correction (columns ``<figure>_pca``, ``<figure>_harmony``,
    ``<figure>_mnn``) and the two corrections' seconds.
    """
    from .._integrate import harmony, mnn_correct

    pcs, is_ref = _joint_pca(task, n_pcs, seed)
    truth_ref = task.reference.obs[task.labels_key].astype(str).to_numpy()
    truth = np.concatenate([truth_ref, task.truth])
    out = {f"{k}_pca": v for k, v in _figures(pcs, is_ref, truth, task.seen).items()}
    if task.single:
        out |= {f"{k}_{m}": out[f"{k}_pca"] for k in _FIGURES for m in ("harmony", "mnn")}
        out["integration_seconds"] = out["mnn_seconds"] = 0.0
        return out
    t0 = time.perf_counter()
    emb = harmony(pcs, np.where(is_ref, "reference", "query"), seed)
    out["integration_seconds"] = time.perf_counter() - t0
    out |= {f"{k}_harmony": v for k, v in _figures(emb, is_ref, truth, task.seen).items()}
    t0 = time.perf_counter()
    batch = (~is_ref).astype(np.int64)
    emb, _ = mnn_correct(pcs, batch, np.array([0, 1]))
    out["mnn_seconds"] = time.perf_counter() - t0
    out |= {f"{k}_mnn": v for k, v in _figures(emb, is_ref, truth, task.seen).items()}
    return out


_FIGURES = ("mix", "sep_qshare", "sep_knn", "over")


def _joint_pca(task: Task, n_pcs: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    import anndata as ad
    import scanpy as sc
    import scipy.sparse as sp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, qry = task.reference, task.query
        a = ad.AnnData(sp.vstack([sp.csr_matrix(ref.X), sp.csr_matrix(qry.X)]).tocsr())
        a.var_names = ref.var_names
        x = a.X.data
        if x.size and np.allclose(x, np.round(x)):  # counts: normalise as the pipeline does
            sc.pp.normalize_total(a, target_sum=1e4)
            sc.pp.log1p(a)
        n_top = min(2000, a.n_vars - 1)
        sc.pp.highly_variable_genes(a, n_top_genes=n_top, flavor="seurat")
        a = a[:, a.var["highly_variable"].to_numpy()].copy()
        k = int(min(n_pcs, a.n_obs - 1, a.n_vars - 1))
        sc.pp.pca(a, n_comps=k, random_state=seed)
    is_ref = np.arange(a.n_obs) < ref.n_obs
    return np.asarray(a.obsm["X_pca"], dtype=np.float32), is_ref


def _figures(emb: np.ndarray, is_ref: np.ndarray, truth: np.ndarray, seen) -> dict[str, float]:
    from sklearn.metrics import roc_auc_score
    from sklearn.neighbors import NearestNeighbors

    n = emb.shape[0]
    k = min(N_NEIGHBORS, n - 1)
    nn = NearestNeighbors(n_neighbors=k).fit(emb).kneighbors(return_distance=False)
    q = np.flatnonzero(~is_ref)
    novel = ~np.isin(truth[q], list(seen))
    nb = nn[q]  # (n_query, k)
    nb_ref = is_ref[nb]
    same = nb_ref & (truth[nb] == truth[q][:, None])
    known = ~novel
    mix = float(same[known].any(axis=1).mean()) if known.any() else np.nan
    qshare = 1.0 - nb_ref.mean(axis=1)
    refs = np.flatnonzero(is_ref)
    kr = min(REF_NEIGHBORS, refs.size)
    dist, _ = NearestNeighbors(n_neighbors=kr).fit(emb[refs]).kneighbors(emb[q])
    score = dist.mean(axis=1)

    def auroc(s: np.ndarray) -> float:
        if novel.all() or not novel.any():
            return float("nan")
        return float(roc_auc_score(novel, s))

    over = float("nan")
    if novel.any():
        # per novel cell, its neighbours that are reference cells, counted by type
        names, codes = np.unique(truth, return_inverse=True)
        rows = nb[novel]
        ref_codes = np.where(is_ref[rows], codes[rows], names.size)  # query cells: a spare bin
        counts = np.zeros((rows.shape[0], names.size + 1), dtype=np.int64)
        np.add.at(counts, (np.repeat(np.arange(rows.shape[0]), k), ref_codes.ravel()), 1)
        over = float((counts[:, :-1].max(axis=1) > k / 2).mean())
    return {"mix": mix, "sep_qshare": auroc(qshare), "sep_knn": auroc(score), "over": over}
