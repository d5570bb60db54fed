"""Accuracy of ``orca_sc.tl.annotate`` on the real tasks of ``../shared/data`` (see its README),
with ``OrcaConfig`` overrides, for developing the core (the tasks are ``orca_sc.benchmark``'s;
``orca-sc benchmark`` compares against baselines).

Usage: ``python benchmarks/real_tasks.py [--data DIR] [--seeds 0 1 2] [--set key=value ...]``
Prints one row per task (mean over seeds) and writes ``reports/real_tasks.csv``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
from _overrides import config_overrides

import orca_sc
from orca_sc.benchmark import annotate_task, builtin_tasks

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


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
    overrides = config_overrides(args.set)
    rows = []
    for seed in args.seeds:
        for spec in builtin_tasks(args.data):
            name = spec.name
            if args.only and not any(o in name for o in args.only):
                continue
            task = spec.make(seed)
            kw = dict(overrides)
            if args.true_n_novel:
                kw["n_novel"] = len(task.novel)
            t0 = time.perf_counter()
            q, _ = annotate_task(task, seed, **kw)
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
