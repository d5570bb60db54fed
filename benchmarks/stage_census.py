"""Where each call is made: the novel-type and known-type query cells of development-suite
tasks followed through discovery's candidates, the open-world fit and the naming.

Usage: ``python benchmarks/stage_census.py [--only NAME ...] [--seeds 0 1 2]
[--out reports/stage_census.csv]`` (``--only family:real``: the real tasks, as
``orca-sc benchmark --only`` selects them)

Per task and seed, the share of the novel-type query cells (``nn_*``) and of the known-type
ones (``kn_*``) that are in a candidate novel cluster after discovery (``*_candidate``), on a
novel head after the open-world fit (``*_fit``), on a novel head the naming reported as a
known type (``*_merged``: the merge into known types), and called novel in the labels
(``*_labels``, the benchmark's novel→novel and known→novel). Then the means over the seeds.
A run is observed with :class:`orca_sc.benchmark.StageCensus`; nothing in it changes.
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
from _cli import task_parser

from orca_sc.benchmark import StageCensus, annotate_task, dev_suite, observe

STAGES = ("candidate", "fit", "merged", "labels")


def census_row(task, seed: int) -> dict | None:
    """One run of ``task`` with the defaults, observed: the shares of its query cells at each
    stage (``None`` for a task of several queries annotated together).
    """
    if task.info.get("query_key") is not None:
        return None
    census = StageCensus()
    with warnings.catch_warnings(), observe(census):
        warnings.simplefilter("ignore")
        adata, rows = annotate_task(task, seed)
    query = adata[rows]
    n_run = census.head.size
    # the run's cells: one AnnData in its order, or the reference's labelled cells then the query
    run_rows = np.arange(n_run)[rows] if task.single else np.arange(n_run - query.n_obs, n_run)
    at = census.stages(run_rows)
    truth = query.obs["truth"].astype(str).to_numpy()
    novel = ~np.isin(truth, task.seen)
    called = {
        "candidate": at["in_candidate"],
        "fit": at["novel_after_fit"],
        "merged": at["named_known"],
        "labels": query.obs["orca_novel"].notna().to_numpy(),
    }
    row = {"task": task.name, "seed": seed, "n_novel": int(novel.sum()),
           "n_known": int((~novel).sum())}  # fmt: skip
    for stage in STAGES:
        row[f"nn_{stage}"] = float(called[stage][novel].mean()) if novel.any() else np.nan
        row[f"kn_{stage}"] = float(called[stage][~novel].mean()) if (~novel).any() else np.nan
    return row


def main() -> None:
    args = task_parser(__doc__, "reports/stage_census.csv").parse_args()
    data = args.data if args.data.is_dir() else None
    rows: list[dict] = []
    for spec in dev_suite(data, large=False, only=args.only):
        for seed in args.seeds:
            row = census_row(spec.make(seed), seed)
            if row is None:
                print(spec.name, "several queries: skipped", flush=True)
                break
            rows.append(row)
            print(spec.name, seed, flush=True)
    table = pd.DataFrame(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    cols = [f"{k}_{s}" for k in ("nn", "kn") for s in STAGES]
    print(table.groupby("task", sort=False)[cols].mean().round(3).to_string())


if __name__ == "__main__":
    main()
