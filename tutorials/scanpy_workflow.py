# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # ORCA in a scanpy workflow
#
# From a scanpy session to an annotated UMAP in a few cells. `pbmc68k_reduced` ships with scanpy
# (700 PBMCs, 10 FACS-sorted populations in `bulk_labels`). We pretend that only some cells of
# some populations were labelled and let ORCA annotate everything else — including three
# populations nobody labelled.

# %%
import warnings

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import scanpy as sc

import orca_sc

warnings.filterwarnings("ignore", category=FutureWarning)
sc.settings.verbosity = 0

adata = sc.datasets.pbmc68k_reduced()  # .X is scaled; .raw holds log-normalised values
adata

# %% [markdown]
# Label half of the cells of seven populations; hide CD14+ monocytes, B cells and dendritic
# cells entirely. Unlabelled cells are NaN (or "Unknown") in the label column.

# %%
hidden = ["CD14+ Monocyte", "CD19+ B", "Dendritic"]
rng = np.random.default_rng(0)
truth = adata.obs["bulk_labels"].astype(str)
labelled = ~truth.isin(hidden) & (rng.random(adata.n_obs) < 0.5)
adata.obs["my_labels"] = pd.Series(np.where(labelled, truth, None), index=adata.obs_names)
print(adata.obs["my_labels"].value_counts(dropna=False).to_string())

# %% [markdown]
# ORCA needs counts or log-normalised values, not scaled data: annotate the `.raw` matrix and
# copy the results back (same cells, same order).

# %%
lognorm = adata.raw.to_adata()
lognorm.obs["my_labels"] = adata.obs["my_labels"]
orca_sc.tl.annotate(lognorm, labels_key="my_labels", progress=False)
for key in ("orca_label", "orca_novel", "orca_confidence"):
    adata.obs[key] = lognorm.obs[key]
adata.obsm["X_orca"] = lognorm.obsm["X_orca"]
adata.uns["orca"] = lognorm.uns["orca"]

# %% [markdown]
# The labels on scanpy's own UMAP of this data, next to the truth:

# %%
sc.pl.umap(adata, color=["bulk_labels", "orca_label"], wspace=0.7, show=False)
plt.show()
orca_sc.pl.embedding(adata, show=False)
plt.show()

# %% [markdown]
# How well did it do on the cells nobody labelled, and what are the novel clusters?

# %%
rep = orca_sc.metrics.report(adata, "bulk_labels")
print(
    {k: round(rep[k], 3) for k in ("seen_accuracy", "novel_accuracy", "novel_nmi", "all_accuracy")}
)
# markers need expression values, not scaled data: summarise the log-normalised object
for rec in orca_sc.tl.summarize(lognorm)["novel"]:
    close = ", ".join(f"{c['type']} {c['similarity']:.2f}" for c in rec["closest"])
    print(f"{rec['name']} ({rec['size']} cells): {', '.join(rec['markers'])} | closest: {close}")

# %%
orca_sc.pl.correspondence(adata, "bulk_labels", show=False)
plt.show()

# %% [markdown]
# ## Reading the novel clusters
#
# There are more novel clusters than hidden populations. That is not noise: `bulk_labels` were
# given by matching each cell to bulk profiles of FACS-sorted populations, and a sort gate is
# broader than a cell type. Where did the cells of each hidden population go?

# %%
is_hidden = adata.obs["bulk_labels"].isin(hidden)
pd.crosstab(
    adata.obs.loc[is_hidden, "bulk_labels"].astype(str),
    adata.obs.loc[is_hidden, "orca_label"].astype(str),
)

# %% [markdown]
# Read the table with the markers printed above:
#
# - the cluster marked by *MZB1*, *IGJ* (J chain), *TNFRSF17* (BCMA) and *SSR4* takes about a
#   third of the sorted CD19+ B cells: these are **plasma cells**, antibody-secreting cells with
#   their own programme, which the CD19 gate lumps with B cells;
# - the cluster marked by *FCGR3A* (CD16), *LST1* and *AIF1* holds the CD14+ monocytes together
#   with the "Dendritic" cells that express *FCGR3A*: **monocytes**, the CD16+ (non-classical) ones
#   included;
# - the remaining "Dendritic" cells split into an *FCER1A*+ cluster (conventional type-2 DCs) and
#   an *IRF8*-high one.
#
# The paper's novel accuracy matches one cluster to each true population (Hungarian matching), so
# the plasma-cell cluster and the second dendritic cluster count as errors against `bulk_labels`
# even though they are distinct cell types. Before merging novel clusters, or naming them, look at
# their markers (`orca_sc.tl.summarize`, `sc.tl.rank_genes_groups(adata, "orca_label")`).
