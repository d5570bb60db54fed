"""Accuracy of ``orca_sc.tl.annotate`` on the real tasks of ``../shared/data`` (see its README).

Usage: ``python benchmarks/real_tasks.py [--data DIR] [--seeds 0 1 2] [--set key=value ...]``
Prints one row per task (mean over seeds) and writes ``reports/real_tasks.csv``.
"""

from __future__ import annotations

import argparse
import ast
import time
import warnings
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd

import orca_sc

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _protocol(adata, seed, seen_frac=0.5, lab_frac=0.5, key="cell_type"):
    """Paper §4.1: half of the classes seen, half of each seen class labelled."""
    rng = np.random.default_rng(seed)
    classes = np.array(sorted(adata.obs[key].astype(str).unique()))
    seen = rng.choice(classes, int(round(seen_frac * len(classes))), replace=False)
    truth = adata.obs[key].astype(str).to_numpy()
    lab = np.isin(truth, seen) & (rng.random(adata.n_obs) < lab_frac)
    adata.obs["orca_input"] = pd.Series(np.where(lab, truth, None), index=adata.obs_names)
    adata.obs["truth"] = truth
    return adata, None, "orca_input"


def tasks(data_dir: Path, seed: int):
    """Yield (name, query, reference, labels_key)."""
    f = data_dir / "tm_facs_scfind.h5ad"
    if f.exists():
        a = ad.read_h5ad(f)
        a = a[a.obs.cell_type != "unannotated"].copy()
        a.obs["truth"] = a.obs.cell_type.astype(str)
        yield (
            "tm_kidney_to_marrow",
            a[a.obs.tissue == "Marrow"].copy(),
            a[a.obs.tissue == "Kidney"].copy(),
            "cell_type",
        )
    f = data_dir / "baron_mouse.h5ad"
    if f.exists():
        a = ad.read_h5ad(f)
        a.obs["truth"] = a.obs.cell_type.astype(str)
        novel = ["ductal", "endothelial", "quiescent_stellate", "macrophage"]
        ref = a[(a.obs.batch == "mouse1") & ~a.obs.cell_type.isin(novel)].copy()
        yield "baron_mouse1_to_mouse2", a[a.obs.batch == "mouse2"].copy(), ref, "cell_type"
    f = data_dir / "scannotate_pbmc.h5ad"
    if f.exists():
        a = ad.read_h5ad(f)
        a.obs["truth"] = a.obs.cell_type.astype(str)
        ref = a[(a.obs.batch == "Drop-seq") & (a.obs.cell_type != "B cell")].copy()
        yield "pbmc_dropseq_to_indrops", a[a.obs.batch == "inDrops"].copy(), ref, "cell_type"
    for name in ("mca_bladder", "worm_neuron"):
        f = data_dir / f"{name}.h5ad"
        if f.exists():
            q, r, k = _protocol(ad.read_h5ad(f), seed)
            yield f"{name}_protocol", q, r, k
    import scanpy as sc

    p = sc.datasets.pbmc68k_reduced()
    p = p.raw.to_adata()
    p.obs["cell_type"] = p.obs["bulk_labels"].astype(str)
    q, r, k = _protocol(p, seed)
    yield "pbmc68k_protocol", q, r, k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--set", nargs="*", default=[], help="OrcaConfig overrides, key=value")
    ap.add_argument("--out", type=Path, default=Path("reports/real_tasks.csv"))
    ap.add_argument(
        "--true-n-novel", action="store_true", help="give n_novel = the true number of novel types"
    )
    args = ap.parse_args()
    overrides = {}
    for kv in args.set:
        k, v = kv.split("=", 1)
        try:
            overrides[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            overrides[k] = v
    rows = []
    for seed in args.seeds:
        for name, q, r, key in tasks(args.data, seed):
            if args.only and not any(o in name for o in args.only):
                continue
            kw = dict(overrides)
            if args.true_n_novel:
                seen = (
                    set(r.obs[key].dropna().astype(str))
                    if r is not None
                    else set(q.obs[key].dropna().astype(str))
                )
                kw["n_novel"] = len(set(q.obs["truth"]) - seen)
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                orca_sc.tl.annotate(q, r, labels_key=key, seed=seed, progress=False, **kw)
            rep = orca_sc.metrics.report(q, "truth")
            u = q.uns["orca"]
            row = {
                "task": name,
                "seed": seed,
                "seen_acc": rep["seen_accuracy"],
                "novel_acc": rep["novel_accuracy"],
                "novel_nmi": rep["novel_nmi"],
                "all_acc": rep["all_accuracy"],
                "novel_true": rep["n_novel_true"],
                "novel_est": u["n_novel"]["estimated"],
                "novel_found": u["n_novel"]["found"],
                "seconds": time.perf_counter() - t0,
            }
            if name == "tm_kidney_to_marrow":
                t = q.obs["truth"]
                lab = q.obs["orca_label"].astype(str)
                b = t.str.contains("B cell")
                kidney_only = [
                    "epithelial cell of proximal tubule",
                    "kidney collecting duct epithelial cell",
                    "endothelial cell",
                ]
                row["tm_B_not_kidney"] = float((~lab[b].isin(kidney_only)).mean())
                row["tm_macro_ok"] = int((lab[t == "macrophage"] == "macrophage").sum())
            rows.append(row)
            print(
                " ".join(
                    f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                ),
                flush=True,
            )
    df = pd.DataFrame(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    print(df.groupby("task", sort=False).mean(numeric_only=True).round(3).to_string())


if __name__ == "__main__":
    main()
