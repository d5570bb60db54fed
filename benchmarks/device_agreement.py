"""Same seed on the CPU and on a GPU: how many cells get the same label.

Usage: ``python benchmarks/device_agreement.py [--cells 20000] [--library-size 150]``
Annotates one simulated task (half of the cells of 5 of 10 types labelled) with defaults on
``cpu`` and on ``cuda``, and prints the share of cells with the same label (novel clusters
matched by their overlap), the seen / novel accuracy of each and their times; beside it, the
same share between two seeds on the CPU (the devices draw different random streams, so the
two devices differ as two seeds do). Writes ``reports/device_agreement.json``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from _figures import report_figures

import orca_sc
from orca_sc.benchmark import simulated_open_world


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Share of cells with the same label once each label of ``b`` is renamed to the label of
    ``a`` it overlaps most (novel cluster numbers may differ between runs).
    """
    tab = pd.crosstab(pd.Series(b, name="b"), pd.Series(a, name="a"))
    rename = tab.idxmax(axis=1).to_dict()
    return float(np.mean(np.array([rename[x] for x in b]) == a))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cells", type=int, default=20_000)
    ap.add_argument("--genes", type=int, default=2000)
    ap.add_argument("--library-size", type=float, default=150.0)
    ap.add_argument("--out", type=Path, default=Path("reports/device_agreement.json"))
    args = ap.parse_args()
    out = {"cells": args.cells, "torch_threads": torch.get_num_threads()}
    labels = {}
    for device, seed in (("cpu", 0), ("cuda", 0), ("cpu_seed1", 1)):
        a, _ = simulated_open_world(args.cells, args.genes, 0, library_size=args.library_size)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            orca_sc.tl.annotate(
                a, labels_key="lab", n_genes=None, device=device.split("_")[0], seed=seed,
                progress=False,
            )  # fmt: skip
        out[f"{device}_seconds"] = time.perf_counter() - t0
        rep = orca_sc.metrics.report(a, "cell_type")
        out[f"{device}_seen"] = rep["seen_accuracy"]
        out[f"{device}_novel"] = rep["novel_accuracy"]
        out[f"{device}_layout"] = a.uns["orca"]["training"]["layout"]
        labels[device] = a.obs["orca_label"].astype(str).to_numpy()
    out["same_label_cpu_cuda"] = agreement(labels["cpu"], labels["cuda"])
    out["same_label_cpu_seed0_seed1"] = agreement(labels["cpu"], labels["cpu_seed1"])
    report_figures(out, args.out)


if __name__ == "__main__":
    main()
