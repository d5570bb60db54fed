"""Annotate a large simulated dataset read from disk (``orca_sc.read_lazy``): time and peak memory.

Usage: ``python benchmarks/out_of_core.py [--cells 1000000] [--genes 2000] [--library-size 150]
[--path /tmp/orca_sc_1m.h5ad] [--threads 2]``
Writes the simulated counts to ``--path`` once (half of the cells of 5 of 10 types labelled in
``obs['lab']``; kept for later runs), drops them from memory, opens the file with
``orca_sc.read_lazy`` (the matrix stays on disk) and runs ``tl.annotate`` with defaults. Prints
the stage times from ``uns['orca']``, the peak resident memory of the process (and of its
anonymous part, without the pages of memory-mapped files) and the size of the selected matrix, and writes ``reports/out_of_core.json``.
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
import warnings
from pathlib import Path

import torch
from _figures import report_figures

import orca_sc
from orca_sc.benchmark import simulated_open_world
from orca_sc.benchmark._run import PeakMemory


class PeakAnon(PeakMemory):
    """Peak of the process's anonymous resident memory (``RssAnon``: not the pages of mapped
    files, which the system can drop and read again), sampled like :class:`PeakMemory`.
    """

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.anon_peak_gib = max(getattr(self, "anon_peak_gib", 0.0), _rss_anon_gib())
            time.sleep(self.interval)


def _rss_anon_gib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cells", type=int, default=1_000_000)
    ap.add_argument("--genes", type=int, default=2000)
    ap.add_argument("--library-size", type=float, default=150.0)
    ap.add_argument("--path", type=Path, default=Path("/tmp/orca_sc_1m.h5ad"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("reports/out_of_core.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out: dict = {"cells": args.cells, "genes": args.genes, "torch_threads": args.threads}
    if not args.path.exists():
        t0 = time.perf_counter()
        a, _ = simulated_open_world(args.cells, args.genes, 0, library_size=args.library_size)
        a.obs["lab"] = a.obs["lab"].astype("category")
        a.write_h5ad(args.path)
        out["simulate_and_write_seconds"] = time.perf_counter() - t0
        del a
        gc.collect()
    out["file_gib"] = args.path.stat().st_size / 2**30
    adata = orca_sc.read_lazy(args.path)
    t0 = time.perf_counter()
    with PeakMemory(interval=0.05) as mem, PeakAnon(0.05) as anon, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        orca_sc.tl.annotate(adata, labels_key="lab", progress=False)
    out["annotate_seconds"] = time.perf_counter() - t0
    u = adata.uns["orca"]
    out.update(
        {
            "training_seconds": u["training"]["seconds"],
            "discovery_seconds": u["training"]["discovery_seconds"],
            "epochs": u["training"]["epochs"],
            "steps": u["training"]["steps"],
            "layout": u["training"]["layout"],
            "streamed": u["data"]["streamed"],
            "n_genes_used": u["data"]["n_genes_used"],
            "peak_rss_above_start_gib": mem.peak_mb / 1024,
            "peak_rss_process_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "peak_anonymous_rss_gib": getattr(anon, "anon_peak_gib", float("nan")),
            "novel_clusters": u["n_novel"]["found"],
        }
    )
    truth = adata.obs["cell_type"]
    rep = orca_sc.metrics.report(adata, "cell_type") if truth is not None else {}
    out["seen_accuracy"] = rep.get("seen_accuracy")
    out["novel_accuracy"] = rep.get("novel_accuracy")
    report_figures(out, args.out)


if __name__ == "__main__":
    main()
