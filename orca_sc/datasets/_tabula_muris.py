"""The paper's cross-tissue task on Tabula Muris data (or any AnnData with a tissue column)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from .._errors import OrcaInputError
from .._hvg import select_genes
from .._read import get_matrix, to_log_normalized

#: label values that mean "not annotated" in Tabula Muris releases
UNANNOTATED = ("unannotated", "nan", "NA", "")


def tabula_muris_cross_tissue(
    adata: Any,
    *,
    labels_key: str = "cell_ontology_class",
    tissue_key: str = "tissue",
    query_tissues: Sequence[str] | None = None,
    seen_classes: Sequence[str] | None = None,
    seen_fraction: float | None = 0.5,
    labeled_fraction: float = 0.5,
    min_cells: int = 400,
    n_genes: int | None = 2866,
    layer: str | None = None,
    seed: int = 0,
) -> tuple[Any, Any]:
    """Build the ORCA paper's cross-tissue annotation task (§4.1, Appendix B): drop cells
    without an annotation; keep cell types with at least ``min_cells`` cells (the paper: 400,
    leaving 50 types and 93,718 cells of Tabula Muris Senis FACS); log-normalise counts; select
    ``n_genes`` highly variable genes (the paper: 2,866), per tissue; split the tissues into
    reference and query; draw the seen classes (``seen_fraction`` of the types, or
    ``seen_classes``). The reference is ``labeled_fraction`` of the seen-class cells of the
    reference tissues, the query every cell of the query tissues.

    Parameters
    ----------
    adata
        Tabula Muris (Senis) AnnData — or any AnnData with cell types and a tissue column.
    labels_key
        ``obs`` column with the cell type.
    tissue_key
        ``obs`` column with the tissue.
    query_tissues
        Tissues annotated as the query. Default: half of the tissues, drawn with ``seed``
        (sorted names, so the draw is reproducible).
    seen_classes
        The known types. Default: ``seen_fraction`` of the types drawn with ``seed``; with
        ``seen_fraction=None`` every type of the reference tissues is seen (pure cross-tissue:
        novel = types the reference tissues lack).
    labeled_fraction
        Fraction of each seen type's reference-tissue cells labelled.
    min_cells
        Cell types with fewer cells are dropped.
    n_genes
        Highly variable genes selected per tissue (``None``: all genes).
    layer
        Expression layer to read instead of ``X``.
    seed
        Seed of the draws: query tissues, seen classes, labelled cells.

    Returns
    -------
    tuple[AnnData, AnnData]
        ``(reference, query)`` with log-normalised ``X`` on the selected genes; the query's
        ``obs[labels_key]`` keeps the truth (for :func:`orca_sc.metrics.report`). Both have
        ``uns['orca_task']``: the seen / novel classes and the tissues.

    """
    import anndata as ad

    X, obs, var, keep_types = _filtered(adata, labels_key, tissue_key, min_cells, n_genes, layer)
    tissue = obs[tissue_key].astype(str).to_numpy()
    rng = np.random.default_rng(seed)
    tissues = sorted(set(tissue))
    q_t = _query_tissues(rng, tissues, query_tissues, tissue_key)
    in_query = np.isin(tissue, q_t)
    if in_query.all():
        raise OrcaInputError(
            "every tissue is a query tissue; leave at least one for the reference."
        )
    ref_types = sorted(set(obs[labels_key][~in_query]))
    seen = _seen_classes(rng, keep_types, ref_types, seen_classes, seen_fraction)
    y = obs[labels_key].to_numpy()
    lab = ~in_query & np.isin(y, seen) & (rng.random(len(y)) < labeled_fraction)
    novel = sorted(set(y[in_query]) - set(seen))
    info = {
        "reference_tissues": sorted(set(tissues) - set(q_t)),
        "query_tissues": q_t,
        "seen_classes": seen,
        "novel_classes": novel,
        "min_cells": min_cells,
        "n_genes": int(X.shape[1]),
        "labeled_fraction": labeled_fraction,
        "seed": seed,
    }
    ref = ad.AnnData(X=X[lab], obs=obs.iloc[np.flatnonzero(lab)].copy(), var=var)
    ref.obs[labels_key] = pd.Categorical(ref.obs[labels_key], categories=seen)
    query = ad.AnnData(X=X[in_query], obs=obs.iloc[np.flatnonzero(in_query)].copy(), var=var)
    ref.uns["orca_task"] = info
    query.uns["orca_task"] = info
    return ref, query


def _filtered(adata, labels_key, tissue_key, min_cells, n_genes, layer):
    """Annotated cells of types with at least ``min_cells`` cells, log-normalised, on ``n_genes``
    highly variable genes chosen per tissue: ``(X, obs, var, kept types)``.
    """
    for key, what in ((labels_key, "labels_key"), (tissue_key, "tissue_key")):
        if key not in adata.obs.columns:
            cols = ", ".join(map(repr, adata.obs.columns))
            raise OrcaInputError(f"{what} {key!r} is not an obs column; columns: {cols}.")
    labels = adata.obs[labels_key].astype(object)
    ok = labels.notna().to_numpy() & ~labels.astype(str).isin(UNANNOTATED).to_numpy()
    counts = labels[ok].astype(str).value_counts()
    keep_types = sorted(counts[counts >= min_cells].index)
    if len(keep_types) < 2:
        raise OrcaInputError(
            f"only {len(keep_types)} cell types have at least min_cells={min_cells} cells; lower "
            f"min_cells (largest types: {counts.head(5).to_dict()})."
        )
    keep = ok & labels.astype(str).isin(keep_types).to_numpy()
    X = get_matrix(adata, layer, "Tabula Muris data")[keep]
    X, _ = to_log_normalized(X, 1e4)
    obs = adata.obs.loc[keep].copy()
    obs[labels_key] = obs[labels_key].astype(str)
    tissue = obs[tissue_key].astype(str).to_numpy()
    hv = select_genes(X, adata.var_names.astype(str).tolist(), tissue, n_genes)
    return X[:, hv].tocsr(), obs, adata.var.iloc[hv].copy(), keep_types


def _query_tissues(rng, tissues: list[str], query_tissues, tissue_key: str) -> list[str]:
    """The given query tissues (checked), or half of the tissues drawn with ``rng``."""
    if query_tissues is None:
        if len(tissues) < 2:
            raise OrcaInputError(
                f"only one tissue ({tissues}) in obs[{tissue_key!r}]: nothing to split."
            )
        return sorted(rng.choice(tissues, len(tissues) // 2, replace=False).tolist())
    q_t = sorted(map(str, query_tissues))
    missing = sorted(set(q_t) - set(tissues))
    if missing:
        raise OrcaInputError(f"query tissues {missing} not found; tissues: {tissues}.")
    return q_t


def _seen_classes(rng, all_types, ref_types, seen_classes, seen_fraction) -> list[str]:
    """The given seen classes (checked), every reference type (``seen_fraction=None``) or
    ``seen_fraction`` of the types, drawn with ``rng`` among those of the reference tissues.
    """
    if seen_classes is not None:
        seen = sorted(map(str, seen_classes))
        bad = sorted(set(seen) - set(ref_types))
        if bad:
            raise OrcaInputError(f"seen classes {bad} have no cells in the reference tissues.")
    elif seen_fraction is None:
        seen = ref_types
    else:
        all_types = sorted(set(all_types))
        n_seen = max(2, int(round(seen_fraction * len(all_types))))
        # seen types must occur in the reference tissues
        cand = [t for t in rng.permutation(all_types) if t in set(ref_types)]
        seen = sorted(cand[:n_seen])
    if len(seen) < 2:
        raise OrcaInputError(f"need at least 2 seen classes, got {seen}.")
    return seen
