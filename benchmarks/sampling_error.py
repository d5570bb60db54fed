"""The error of working on a sample where the data are large (issue 22): discovery's PCA is
fitted on 8,192 cells, and discovery (kNN graph, Leiden, the rules) sees at most
``DiscoveryConfig.max_cells`` (50,000) cells.

Usage: ``python benchmarks/sampling_error.py [--cells 100000] [--pca-cells 60000]
[--library-size 3000]`` (150: the sparsity of real data, where this simulator's types barely
separate)

1. **PCA**: on ``--pca-cells`` simulated cells (real-data sparsity), the 30 components fitted on
   8,192 random cells against those fitted on all (simulated with ``--library-size``): the largest principal angle between the two
   subspaces, the variance of all cells that each captures, the share of each cell's 15
   nearest neighbours (among 10,000 cells) that the two embeddings have in common, and the
   share of those neighbours of the cell's own type in each (within a simulated type cells are
   exchangeable, so the neighbours themselves are noise and their type is what counts).
2. **Discovery**: ``tl.annotate`` with defaults on ``--cells`` simulated cells (5 of 10 types
   novel), discovery on 50,000 of them against discovery on all: novel clusters found, seen /
   novel accuracy, novel-type cells called novel, known-type cells called novel, same label.

Writes ``reports/sampling_error.json``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import numpy as np
from _figures import report_figures
from device_agreement import agreement

import orca_sc
from orca_sc._align import aligned_rows
from orca_sc._hvg import select_genes
from orca_sc._read import log_normalize
from orca_sc.benchmark import simulated_open_world


def pca_error(n_cells: int, seed: int, library_size: float) -> dict:
    from scipy.linalg import subspace_angles
    from sklearn.decomposition import PCA
    from sklearn.neighbors import NearestNeighbors

    a, _ = simulated_open_world(n_cells, 4000, seed, library_size=library_size)
    X = log_normalize(a.X.tocsr(), 1e4)
    genes = a.var_names.astype(str).tolist()
    X = X[:, select_genes(X, genes, np.zeros(a.n_obs, dtype=int), 2000)].tocsr()
    ones, zeros = np.ones((1, X.shape[1])), np.zeros((1, X.shape[1]))
    dense = aligned_rows(X, np.zeros(a.n_obs, dtype=int), ones, zeros, np.arange(a.n_obs))
    rng = np.random.default_rng(seed)
    sample = rng.choice(a.n_obs, 8192, replace=False)
    full = PCA(30, random_state=seed).fit(dense)
    part = PCA(30, random_state=seed).fit(dense[sample])
    angle = float(np.degrees(subspace_angles(full.components_.T, part.components_.T).max()))
    # the 10 types span at most 9 directions; the later components are noise of either fit
    angle10 = float(
        np.degrees(subspace_angles(full.components_[:10].T, part.components_[:10].T).max())
    )
    centred = dense - dense.mean(axis=0)
    total = float((centred**2).sum())

    def captured(p) -> float:
        return float(((centred @ p.components_.T) ** 2).sum()) / total

    probe = rng.choice(a.n_obs, 10_000, replace=False)

    def neighbours(p) -> np.ndarray:
        e = p.transform(dense[probe])
        return NearestNeighbors(n_neighbors=16).fit(e).kneighbors(return_distance=False)[:, 1:]

    nf, np_ = neighbours(full), neighbours(part)
    overlap = np.mean([len(set(x) & set(y)) / 15 for x, y in zip(nf, np_, strict=True)])
    types = a.obs["cell_type"].to_numpy()[probe]

    def purity(nb: np.ndarray) -> float:  # neighbours of the cell's own type
        return float(np.mean(types[nb] == types[:, None]))

    return {
        "pca_cells": n_cells,
        "pca_max_principal_angle_deg": angle,
        "pca_max_principal_angle_top10_deg": angle10,
        "pca_variance_captured_all_cells_fit": captured(full),
        "pca_variance_captured_8192_fit": captured(part),
        "pca_knn15_overlap": float(overlap),
        "pca_knn15_same_type_all_cells_fit": purity(nf),
        "pca_knn15_same_type_8192_fit": purity(np_),
    }


def discovery_error(n_cells: int, seed: int, library_size: float) -> dict:
    out, labels = {}, {}
    for name, max_cells in (("sample50k", None), ("all", n_cells)):
        a, _ = simulated_open_world(n_cells, 2000, seed, library_size=library_size)
        kw = {} if max_cells is None else {"max_cells": max_cells}
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            orca_sc.tl.annotate(a, labels_key="lab", n_genes=None, seed=seed, progress=False, **kw)
        out[f"{name}_seconds"] = time.perf_counter() - t0
        out[f"{name}_discovery_seconds"] = a.uns["orca"]["training"]["discovery_seconds"]
        rep = orca_sc.metrics.report(a, "cell_type")
        q = a.obs["lab"].isna().to_numpy()
        truth_novel = ~a.obs["cell_type"].isin([f"type_{i}" for i in range(5)]).to_numpy()
        called = a.obs["orca_novel"].notna().to_numpy()
        out[f"{name}_seen"] = rep["seen_accuracy"]
        out[f"{name}_novel"] = rep["novel_accuracy"]
        out[f"{name}_novel_found"] = rep["n_novel_found"]
        out[f"{name}_novel_called_novel"] = float(called[q & truth_novel].mean())
        out[f"{name}_known_called_novel"] = float(called[q & ~truth_novel].mean())
        labels[name] = a.obs["orca_label"].astype(str).to_numpy()
    out["discovery_same_label"] = agreement(labels["all"], labels["sample50k"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cells", type=int, default=100_000)
    ap.add_argument("--pca-cells", type=int, default=60_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--library-size", type=float, default=3000.0)
    ap.add_argument("--skip-discovery", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("reports/sampling_error.json"))
    args = ap.parse_args()
    out = {"seed": args.seed, "library_size": args.library_size}
    out.update(pca_error(args.pca_cells, args.seed, args.library_size))
    if not args.skip_discovery:
        out.update(
            {"cells": args.cells, **discovery_error(args.cells, args.seed, args.library_size)}
        )
    report_figures(out, args.out)


if __name__ == "__main__":
    main()
