"""Where the seconds of an annotation go, stage by stage, on the path a CLI user takes: the
imports, reading a reference and a query ``.h5ad``, gene selection and alignment, the warm-up,
discovery, the open-world fit, inference, the novelty test (cross-fitted warm-ups, their
inference and kNN scores), naming and calibration, and writing the annotated query.

Usage: ``python benchmarks/stage_seconds.py [--cells 2000] [--repeats 3] [--out reports/stage_seconds.md]``

The data are :func:`orca_sc.benchmark.simulated_open_world` (10 types, 2,000 genes, 6%
non-zeros; the labelled quarter of the cells is the reference, the rest the query). Each stage
is timed by :class:`orca_sc.benchmark.StageTimer` (the pipeline's own stage marks); the figures are the median over ``--repeats``
runs after one unrecorded run (the first pays for torch's lazy initialisation). Nested stages (the
margin's refresh inside each phase, the fold warm-ups, inference and scores inside the
novelty test) are indented and not added to the total again.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
from _cli import write_report


def import_seconds() -> float:
    """Seconds to import what an annotation loads, in a fresh interpreter, less its start."""
    code = "import orca_sc.cli, torch, anndata, sklearn.neighbors, sklearn.decomposition, igraph"

    def run(c: str) -> float:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", c], check=True)
        return time.perf_counter() - t

    return float(np.median([run(code) - run("pass") for _ in range(3)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cells", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("reports/stage_seconds.md"))
    args = ap.parse_args()
    imports = import_seconds()

    import anndata as ad
    import torch

    import orca_sc
    from orca_sc.benchmark import StageTimer, observe, simulated_open_world

    warnings.simplefilter("ignore")
    a, lab = simulated_open_world(args.cells, 2000, args.seed, library_size=150.0)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        ref_path, query_path, out_path = (Path(tmp) / f for f in ("ref.h5ad", "q.h5ad", "o.h5ad"))
        a[lab].copy().write_h5ad(ref_path)
        q = a[~lab].copy()
        del q.obs["lab"]
        q.write_h5ad(query_path)
        for rep in range(args.repeats + 1):
            t0 = time.perf_counter()
            ref, query = ad.read_h5ad(ref_path), ad.read_h5ad(query_path)
            t1 = time.perf_counter()
            with observe(StageTimer()) as (timer,):
                orca_sc.tl.annotate(query, ref, labels_key="lab", progress=False)
            t2 = time.perf_counter()
            query.write_h5ad(out_path)
            t3 = time.perf_counter()
            staged = timer.outer_seconds()
            nested = StageTimer.NESTED  # indented in the table, not added to the total
            stages = {(f"  {k}" if k in nested else k): v for k, v in timer.seconds.items()}
            row = {"reading the two .h5ad files": t1 - t0, **stages,
                   "obs and uns (outside the stages)": t2 - t1 - staged,
                   "writing the annotated query": t3 - t2, "total": t3 - t0}  # fmt: skip
            phases = query.uns["orca"]["training"]["phases"]
            if rep:
                runs.append(row)
    keys = list(runs[0])
    med = {k: float(np.median([r[k] for r in runs])) for k in keys}
    total = med["total"] + imports
    lines = [
        f"Stages of `orca-sc annotate` on {int(lab.sum()):,} reference + {int((~lab).sum()):,} "
        f"query cells (simulated, 2,000 genes; median of {args.repeats} runs, "
        f"{torch.get_num_threads()} torch threads):",
        "",
        "| stage | seconds | share of the total |",
        "|---|---|---|",
        f"| imports (fresh interpreter) | {imports:.2f} | {imports / total:.0%} |",
    ]
    lines += [f"| {k} | {med[k]:.2f} | {med[k] / total:.0%} |" for k in keys if k != "total"]
    lines += [f"| total, imports included | {total:.2f} | 100% |", ""]
    lines += [f"- {name}: {p['steps']} of {p['max_steps']} steps ({p['stopped']})"
              for name, p in phases.items()]  # fmt: skip
    write_report(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
