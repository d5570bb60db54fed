"""Training speed and peak memory of ``orca_sc.tl.annotate`` on simulated counts.

Usage: ``python benchmarks/speed.py [--cells 100000] [--genes 2000] [--threads 2]
[--library-size 3000] [--device cpu]``
Prints seconds per epoch, cells/s, the FLOP floor of the architecture on this machine, the peak
resident memory above the level with the input loaded (against the issue's budget of twice the
selected CSR matrix + 1 GiB) and, on a GPU, the peak GPU memory; writes ``reports/speed.json``.
``--library-size 150`` gives the sparsity of real data after gene selection (5.6% non-zeros).
"""

from __future__ import annotations

import argparse
import resource
import time
import warnings
from pathlib import Path

import torch
from _figures import report_figures

import orca_sc
from orca_sc.benchmark import epoch_speed, simulated_open_world
from orca_sc.benchmark._run import PeakMemory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cells", type=int, default=100_000)
    ap.add_argument("--genes", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--library-size", type=float, default=3000.0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, default=Path("reports/speed.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    a, lab = simulated_open_world(args.cells, args.genes, seed=0, library_size=args.library_size)
    t_sim = time.perf_counter() - t0
    density = a.X.nnz / (a.shape[0] * a.shape[1])

    t0 = time.perf_counter()
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with PeakMemory() as mem, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        orca_sc.tl.annotate(
            a, labels_key="lab", n_genes=None, epochs=args.epochs, progress=False,
            device=args.device,
        )  # fmt: skip
    total = time.perf_counter() - t0
    # the selected matrix: float32 values + int32 indices + int64 row pointers
    csr_gib = (a.X.nnz * 8 + (a.n_obs + 1) * 8) / 2**30
    u = a.uns["orca"]
    speed = epoch_speed(a, lab)
    sec_full = speed["seconds_per_epoch"]
    rep = orca_sc.metrics.report(a, "cell_type")
    out = {
        "cells": args.cells,
        "genes": args.genes,
        "density": density,
        "torch_threads": torch.get_num_threads(),
        "simulate_seconds": t_sim,
        "annotate_seconds": total,
        "training_seconds": u["training"]["seconds"],
        "epochs": u["training"]["epochs"],
        "steps": u["training"]["steps"],
        "seconds_per_epoch_full_objective_median": sec_full,
        "cells_per_second": args.cells / sec_full,
        "flops_per_cell_epoch": speed["flops_per_cell_epoch"],
        "measured_matmul_gflops": speed["matmul_gflops"],
        "flop_floor_seconds_per_epoch": speed["flop_floor_seconds_per_epoch"],
        "device": u["training"]["device"],
        "layout": u["training"].get("layout", ""),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "peak_rss_above_input_gib": mem.peak_mb / 1024,
        "selected_csr_gib": csr_gib,
        "rss_budget_gib (2 x csr + 1)": 2 * csr_gib + 1,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "seen_accuracy": rep["seen_accuracy"],
        "novel_accuracy": rep["novel_accuracy"],
    }
    report_figures(out, args.out)


if __name__ == "__main__":
    main()
