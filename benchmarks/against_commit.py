"""ORCA of another commit, with its defaults, on today's development tasks: the check that no
task's all-class accuracy falls more than 2 points below a past commit's ("ORCA core 5": below
a546cd6's).

    git worktree add /tmp/old a546cd6
    python benchmarks/against_commit.py /tmp/old RUNS.csv --data-dir ../shared/data \
        --only TASK ... --seeds 0,1,2 [--work DIR] [--out F.md]

Each task is drawn by today's suite (``orca_sc.benchmark``: same splits and seeds) and written
to ``--work`` as a reference and a query ``.h5ad``; the old commit's ``orca_sc`` (the checkout's
folder first on ``PYTHONPATH``, in a fresh process, one torch thread) annotates each with its
defaults, as ``annotate_task`` does (a one-dataset protocol task as one AnnData with the query
unlabelled); today's scorer reads its labels. ``RUNS.csv``: today's ``runs.csv`` of the same
tasks and seeds (``orca-sc benchmark --suite dev --method ORCA``). Prints per task the old and
today's novel→novel, known→novel, clusters and all-class accuracy (mean over seeds), and the
tasks more than 2 points of all-class accuracy below the old commit's. Runs already annotated
in ``--work`` are not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from orca_sc.benchmark._compare import orca_runs
from orca_sc.benchmark._run import score
from orca_sc.benchmark._suite import dev_suite, select_tasks

#: a task more than this far below the old commit's all-class accuracy is reported
DROP = 0.02
FIGURES = ["novel_called", "known_called_novel", "novel_found", "all_acc"]

#: what the old commit's process runs on one written task: its own ``annotate``, its defaults
OLD_RUN = """
import json, sys, warnings
import anndata as ad, numpy as np, pandas as pd, torch
torch.set_num_threads(1)
from orca_sc.tl import annotate
d = sys.argv[1]
m = json.load(open(d + "/meta.json"))
ref, q = ad.read_h5ad(d + "/ref.h5ad"), ad.read_h5ad(d + "/query.h5ad")
key = m["key"]
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    if m["single"]:
        a = ad.concat([ref, q], join="inner", merge="same")
        a.obs_names_make_unique()
        labels = list(ref.obs[key].astype(str)) + [None] * q.n_obs
        a.obs[key] = pd.Series(labels, index=a.obs_names, dtype=object)
        annotate(a, labels_key=key, seed=m["seed"], progress=False)
        pred = a.obs["orca_label"].astype(str).to_numpy()[ref.n_obs:]
    else:
        annotate(q, ref, labels_key=key, seed=m["seed"], progress=False)
        pred = q.obs["orca_label"].astype(str).to_numpy()
np.save(d + "/pred.npy", pred.astype(str))
"""


def write_task(spec, seed: int, folder: Path) -> None:
    """Today's draw of ``spec`` at ``seed``, as files the old commit reads."""
    task = spec.make(seed)
    if task.info.get("query_key") is not None:
        msg = f"{spec.name}: several queries annotated together are not supported here"
        raise SystemExit(msg)
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        task.reference.write_h5ad(folder / "ref.h5ad")
        task.query.write_h5ad(folder / "query.h5ad")
    meta = {"task": spec.name, "seed": seed, "single": bool(task.single),
            "key": task.labels_key, "truth": [str(t) for t in task.truth],
            "seen": [str(s) for s in task.seen]}  # fmt: skip
    (folder / "meta.json").write_text(json.dumps(meta))


def run_old(checkout: Path, folder: Path) -> None:
    """The old commit annotates the task in ``folder`` (a fresh process)."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", OLD_RUN, str(folder)], env=env, cwd=checkout,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    if done.returncode != 0:  # its notes are quiet; its error is shown
        msg = f"the old commit failed on {folder.name}:\n{done.stderr[-3000:]}"
        raise SystemExit(msg)


def old_runs(work: Path) -> pd.DataFrame:
    """Today's scores of the old commit's labels, one row per task and seed."""
    rows = []
    for folder in sorted(p for p in work.iterdir() if (p / "pred.npy").exists()):
        m = json.loads((folder / "meta.json").read_text())
        pred = np.load(folder / "pred.npy")
        figures = score(np.asarray(m["truth"]), pred, m["seen"], True)
        rows.append({"task": m["task"], "seed": m["seed"], **figures})
    return pd.DataFrame(rows)


def table(old: pd.DataFrame, today: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """Per task, old → today (means over the seeds both have), and the tasks more than
    :data:`DROP` of all-class accuracy below the old commit.
    """
    both = old.merge(today, on=["task", "seed"], suffixes=("_old", "_now"))
    cols = [f"{f}_{s}" for f in FIGURES for s in ("old", "now")]
    per = both.groupby("task")[cols].mean()
    below = per.index[per["all_acc_now"] < per["all_acc_old"] - DROP].tolist()
    return per, below


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", type=Path, help="a checkout of the old commit")
    ap.add_argument("today", type=Path, help="today's runs.csv of the same tasks and seeds")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--only", action="append", required=True, help="a task (repeat)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--work", type=Path, default=None, help="where tasks and labels are kept")
    ap.add_argument("--out", type=Path, default=None, help="also write the table (Markdown)")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="against_commit_"))
    seeds = [int(s) for s in args.seeds.split(",")]
    specs = select_tasks(dev_suite(args.data_dir, large=False), args.only)
    for spec in specs:  # loop over tasks and seeds: each a process of the old commit
        for seed in seeds:
            folder = work / f"{spec.name}_{seed}"
            if not (folder / "meta.json").exists():
                write_task(spec, seed, folder)
            if not (folder / "pred.npy").exists():
                run_old(args.checkout, folder)
                print(f"{spec.name} seed {seed}: annotated by the old commit", flush=True)
    today = orca_runs(pd.read_csv(args.today))[["task", "seed", *FIGURES]]
    old = old_runs(work)
    old = old[old["task"].isin([s.name for s in specs]) & old["seed"].isin(seeds)]
    per, below = table(old, today)
    lines = ["| task | " + " | ".join(f"{f} (old → today)" for f in FIGURES) + " |",
             "|---|" + "---|" * len(FIGURES)]  # fmt: skip
    for task, r in per.iterrows():
        cells = [f"{r[f + '_old']:.3f} → {r[f + '_now']:.3f}" for f in FIGURES]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Tasks more than {DROP * 100:.0f} points of all-class accuracy below the old "
                 f"commit: {len(below)} of {len(per)}" + (f" ({', '.join(below)})" if below else ""))  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
