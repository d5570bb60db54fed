"""Several processes against one: same labels, and how long each takes.

Usage::

    torchrun --standalone --nproc_per_node 2 benchmarks/distributed.py [--cells 20000]
        [--library-size 150] [--threads 1]

Rank 0 simulates one task (half of the cells of 5 of 10 types labelled) and writes it to an
``.h5ad`` file; all ranks annotate it with defaults from the backed file (each reading its
share); then rank 0 alone annotates it again as one process with the same seed. Prints the
share of cells with the same label (novel clusters matched by overlap), seen / novel accuracy
of each run and their times, and writes ``reports/distributed.json``. ``--threads``: torch
threads per process (give the single-process run as many cores as the ranks had together
with ``--single-threads``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from _figures import agreement, report_figures

import orca_sc
from orca_sc.benchmark import simulated_open_world


def _annotate(path: Path, seed: int) -> tuple[np.ndarray, dict, float]:
    a = orca_sc.read_lazy(path)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        orca_sc.tl.annotate(a, labels_key="lab", n_genes=None, seed=seed, progress=False)
    seconds = time.perf_counter() - t0
    rep = orca_sc.metrics.report(a, "cell_type")
    rep["training_seconds"] = a.uns["orca"]["training"]["seconds"]
    return a.obs["orca_label"].astype(str).to_numpy(), rep, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cells", type=int, default=20_000)
    ap.add_argument("--genes", type=int, default=2000)
    ap.add_argument("--library-size", type=float, default=150.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--single-threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("reports/distributed.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tmp = Path(tempfile.gettempdir()) / f"orca_distributed_{os.environ.get('TORCHELASTIC_RUN_ID')}"
    path = tmp / "task.h5ad"
    if rank == 0:
        tmp.mkdir(exist_ok=True)
        a, _ = simulated_open_world(args.cells, args.genes, 0, library_size=args.library_size)
        a.write_h5ad(path)
    dist.barrier()
    labels_d, rep_d, sec_d = _annotate(path, args.seed)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return
    os.environ["WORLD_SIZE"] = "1"  # the single-process run
    torch.set_num_threads(args.single_threads or args.threads)
    labels_s, rep_s, sec_s = _annotate(path, args.seed)
    path.unlink()
    out = {
        "cells": args.cells,
        "processes": world,
        "threads_per_process": args.threads,
        "single_process_threads": torch.get_num_threads(),
        "distributed_seconds": sec_d,
        "single_seconds": sec_s,
        "distributed_training_seconds": rep_d["training_seconds"],
        "single_training_seconds": rep_s["training_seconds"],
        "same_label": agreement(labels_s, labels_d),
        "distributed_seen": rep_d["seen_accuracy"],
        "single_seen": rep_s["seen_accuracy"],
        "distributed_novel": rep_d["novel_accuracy"],
        "single_novel": rep_s["novel_accuracy"],
        "distributed_novel_found": rep_d["n_novel_found"],
        "single_novel_found": rep_s["n_novel_found"],
    }
    report_figures(out, args.out)


if __name__ == "__main__":
    main()
