"""ORCA alone on the development suite (``orca_sc.benchmark.dev_suite``), with ``OrcaConfig`` /
``DiscoveryConfig`` overrides: the before/after run for every change of a default.
``orca-sc benchmark --suite dev`` runs the same tasks with the baselines.

Usage: ``python benchmarks/dev_suite.py [--data DIR] [--seeds 0 1 2] [--task-seed N]
[--only NAME ...] [--no-large] [--large] [--set key=value ...] [--out reports/dev_suite.csv]``

``--task-seed N`` draws every task's split (labelled cells, hidden types, subsamples) with seed
``N`` and varies only the model's seed: the same data, another seed.
Prints one line per run, then the suite table; writes the runs (CSV) and the table (Markdown).
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from _overrides import config_overrides

import orca_sc
from orca_sc.benchmark import (
    annotate_task,
    dev_suite,
    score,
    suite_markdown,
    training_columns,
)
from orca_sc.benchmark._methods import confidence_figures, novelty_test_shares

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--task-seed", type=int, default=None, help="one split for every seed")
    ap.add_argument("--only", nargs="*", default=None, help="tasks whose name contains one")
    ap.add_argument("--no-large", action="store_true", help="skip the 50,000-cell query")
    ap.add_argument("--large", action="store_true",
                    help="the large tier too: the scale task at 50,000 and 100,000 cells and "
                         "the real tasks grown to ~50,000 cells")  # fmt: skip
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
    ap.add_argument("--out", type=Path, default=Path("reports/dev_suite.csv"))
    args = ap.parse_args()
    overrides = config_overrides(args.set)
    data = args.data if args.data.is_dir() else None
    specs = dev_suite(data, large=not args.no_large, only=args.only, scale=args.large)
    rows = []
    for spec in specs:
        for seed in args.seeds:
            task = spec.make(seed if args.task_seed is None else args.task_seed)
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q, sl = annotate_task(task, seed, **overrides)
            pred = q.obs["orca_label"].astype(str).to_numpy()[sl]
            row = {
                "task": spec.name,
                "kind": spec.kind,
                "method": "ORCA",
                "seed": seed,
                "n_query": task.query.n_obs,
                "novel_true": len(task.novel),
                "novel_est": q.uns["orca"]["n_novel"]["estimated"],
                "threshold": q.uns["orca"]["estimate"].get("threshold"),
                **_size_check_columns(q.uns["orca"]["estimate"].get("size_check")),
                **score(task.truth, pred, task.seen, True),
                "seconds": time.perf_counter() - t0,
                "error": "",
                **_self_check_columns(q.uns["orca"].get("self_check")),
                **novelty_test_shares(q, sl, task),
                **confidence_figures(q, sl, task),
                **_per_cell_columns(q, sl, task),
                **_evidence_columns(q, sl, task),
                **training_columns(q.uns["orca"]),
            }
            rows.append(row)
            print(
                " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in
                         row.items() if k not in ("kind", "method", "error")),
                flush=True,
            )  # fmt: skip
    runs = pd.DataFrame(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs.to_csv(args.out, index=False)
    settings = {
        "version": orca_sc.__version__,
        "seeds": args.seeds,
        "torch_threads": torch.get_num_threads(),
    }
    md = suite_markdown(runs, settings)
    args.out.with_suffix(".md").write_text(md)
    print(md)


def _per_cell_columns(q, rows, task) -> dict:
    """With ``--set majority_vote=True``: the per-cell labels' figures (``per_cell_*``) beside
    the voted ones, from the same run, and the share of query cells in mixed clusters.
    """
    if "orca_label_per_cell" not in q.obs:
        return {}
    per_cell = q.obs["orca_label_per_cell"].astype(str).to_numpy()[rows]
    figures = score(task.truth, per_cell, task.seen, True)
    mixed = q.obs["orca_vote_mixed"].to_numpy()[rows]
    return {**{f"per_cell_{k}": v for k, v in figures.items()},
            "vote_mixed_share": float(mixed.mean())}  # fmt: skip


#: ``uns['orca']['novel_evidence']`` levels, as column names
EVIDENCE = {"supported": "supported", "cannot tell": "cannot_tell",
            "not confirmed": "not_confirmed", "not tested": "not_tested"}  # fmt: skip


def _evidence_columns(q, rows, task) -> dict:
    """Per evidence level of the novel clusters (``uns['orca']['novel_evidence']``): how many
    clusters (``ev_<level>_clusters``), how many of them are mostly cells of known types
    (``ev_<level>_false``), their cells and their cells of novel types; for
    ``benchmarks/evidence_table.py``.
    """
    ev = q.uns["orca"].get("novel_evidence", {})
    label = q.obs["orca_label"].astype(str).to_numpy()[rows]
    novel = ~np.isin(np.asarray(task.truth, dtype=str), task.seen)
    out = {f"ev_{c}_{k}": 0 for c in EVIDENCE.values()
           for k in ("clusters", "false", "cells", "novel_cells")}  # fmt: skip
    for name, level in zip(ev.get("cluster", []), ev.get("evidence", []), strict=True):
        members = label == name
        col = EVIDENCE[str(level)]
        out[f"ev_{col}_clusters"] += 1
        out[f"ev_{col}_false"] += int(novel[members].mean() < 0.5) if members.any() else 0
        out[f"ev_{col}_cells"] += int(members.sum())
        out[f"ev_{col}_novel_cells"] += int(novel[members].sum())
    return out


def _size_check_columns(check: dict | None) -> dict:
    """Discovery repeated on a sample of large data (``estimate['size_check']``)."""
    if not check:
        return {}
    return {"size_check_sample_candidates": check["sample_candidates"],
            "size_check_agrees": bool(check["agrees"])}  # fmt: skip


def _self_check_columns(check: dict | None) -> dict:
    """The self-check's figures (``--set self_check=True``), to set beside the run's own."""
    if not check or "skipped" in check:
        return {}
    keys = (
        "novel_called",
        "known_called_novel",
        "hidden_accuracy",
        "hidden_clusters_found",
        "hidden_types_true",
        "n_known_cells",
        "threshold",
        "youden_threshold",
        "seconds",
    )
    return {f"check_{k}": check[k] for k in keys}  # fmt: skip


if __name__ == "__main__":
    main()
