"""The built-in example: open-world annotation of scanpy's bundled pbmc68k_reduced (real data)."""

from __future__ import annotations

import numpy as np
import pandas as pd

#: FACS-sorted populations hidden from the labelled cells in the demo (they must be discovered).
DEMO_NOVEL = ("CD14+ Monocyte", "CD19+ B", "Dendritic")


def demo_data(seed: int = 0, labeled_fraction: float = 0.5):
    """pbmc68k_reduced (700 PBMCs, 10 sorted types) with three types hidden and half of each other
    type labelled in ``obs['input_label']``; the truth is in ``obs['bulk_labels']``.
    """
    import scanpy as sc

    adata = sc.datasets.pbmc68k_reduced().raw.to_adata()  # log-normalised values of 765 genes
    truth = adata.obs["bulk_labels"].astype(str).to_numpy()
    rng = np.random.default_rng(seed)
    lab = ~np.isin(truth, DEMO_NOVEL) & (rng.random(adata.n_obs) < labeled_fraction)
    adata.obs["input_label"] = pd.Series(np.where(lab, truth, None), index=adata.obs_names)
    return adata


def run_demo(seed: int = 0, progress: bool = True) -> dict:
    """Annotate the demo data and return the paper's metrics."""
    from . import metrics, tl

    adata = demo_data(seed)
    tl.annotate(adata, labels_key="input_label", seed=seed, progress=progress)
    return {"adata": adata, "report": metrics.report(adata, "bulk_labels")}


def umap_figure(adata, truth_key: str = "bulk_labels"):
    """UMAP of the ORCA embedding coloured by the truth and by ``orca_label`` (a matplotlib Figure).

    Adds ``obsp`` neighbours and ``obsm['X_umap']`` to ``adata``.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; never opens a window
    import scanpy as sc

    from .pl import match_colors

    match_colors(adata, truth_key)  # a type has one colour in both panels
    sc.pp.neighbors(adata, use_rep="X_orca", random_state=0)
    sc.tl.umap(adata, random_state=0)
    fig = sc.pl.umap(
        adata,
        color=[truth_key, "orca_label"],
        title=[f"truth ({truth_key})", "ORCA (orca_label)"],
        wspace=0.45,
        show=False,
        return_fig=True,
    )
    return fig
