"""The paper's protocol on an atlas-like simulation: many cell types, strong imbalance.

The paper's single-cell task has 50 types whose sizes differ 28-fold; the shared real tasks have
10-16. This simulates ``--types`` types (``orca_sc.datasets.simulate``, largest type 28 times the
smallest), picks half of them as seen at random, labels half of each seen type's cells, and
annotates the rest with ``orca_sc.tl.annotate`` (defaults, ``n_novel="auto"``, plus any
``--set key=value`` overrides). For scale, two reference points on the same cells: a 15-NN
classifier on the PCA (30 components) of the labelled cells (seen accuracy) and KMeans with the
true number of novel types on the truly novel cells alone (novel accuracy; an oracle).

Usage: ``python benchmarks/many_types.py [--cells 30000] [--seeds 0 1] [--set pair_space=pca]``
Prints one row per seed and writes ``reports/many_types.csv``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from _overrides import config_overrides

import orca_sc
from orca_sc.datasets import simulate


def reference_points(adata, types, seen, labelled, seed) -> tuple[float, float]:
    """(kNN seen accuracy, KMeans-on-novel-cells novel accuracy)."""
    import scanpy as sc
    from sklearn.cluster import KMeans
    from sklearn.neighbors import KNeighborsClassifier

    b = adata.copy()
    sc.pp.normalize_total(b, target_sum=1e4)
    sc.pp.log1p(b)
    sc.pp.pca(b, n_comps=30, random_state=seed)
    emb = b.obsm["X_pca"]
    test = np.isin(types, seen) & ~labelled
    knn = KNeighborsClassifier(15).fit(emb[labelled], types[labelled])
    knn_seen = float(np.mean(knn.predict(emb[test]) == types[test]))
    novel = ~np.isin(types, seen)
    k = np.unique(types[novel]).size
    km = KMeans(k, n_init=3, random_state=seed).fit_predict(emb[novel])
    return knn_seen, orca_sc.metrics.novel_accuracy(types[novel], km.astype(str), list(seen))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cells", type=int, default=30_000)
    ap.add_argument("--types", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--set", nargs="*", default=[], help="OrcaConfig overrides, key=value")
    ap.add_argument("--out", type=Path, default=Path("reports/many_types.csv"))
    args = ap.parse_args()
    overrides = config_overrides(args.set)
    rows = []
    for seed in args.seeds:
        adata = simulate(
            args.cells, 2000, args.types, imbalance=28.0, markers_per_type=30, seed=seed
        )
        types = adata.obs["cell_type"].astype(str).to_numpy()
        rng = np.random.default_rng(seed)
        seen = rng.choice(np.unique(types), args.types // 2, replace=False)
        labelled = np.isin(types, seen) & (rng.random(types.size) < 0.5)
        adata.obs["label"] = pd.Series(
            np.where(labelled, types, None), index=adata.obs_names, dtype=object
        )
        adata.obs["truth"] = types
        knn_seen, km_novel = reference_points(adata, types, seen, labelled, seed)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            orca_sc.tl.annotate(adata, labels_key="label", seed=seed, progress=False, **overrides)
        rep = orca_sc.metrics.report(adata, "truth")
        row = {
            "seed": seed,
            "seen_acc": rep["seen_accuracy"],
            "novel_acc": rep["novel_accuracy"],
            "all_acc": rep["all_accuracy"],
            "novel_nmi": rep["novel_nmi"],
            "novel_true": rep["n_novel_true"],
            "novel_est": adata.uns["orca"]["n_novel"]["estimated"],
            "novel_found": rep["n_novel_found"],
            "knn_seen_acc": knn_seen,
            "kmeans_oracle_novel_acc": km_novel,
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    df = pd.DataFrame(rows)
    print(df.drop(columns="seed").mean().round(3).to_string())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
