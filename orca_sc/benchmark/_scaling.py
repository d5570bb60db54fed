"""Time and memory against the number of cells (simulated), with ORCA's FLOP floor beside."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from .._io import read_lazy
from ._run import PeakMemory

logger = logging.getLogger(__name__)


def matmul_gflops(m: int, k: int, n: int, reps: int = 20) -> float:
    """Measured float32 matmul throughput (GFLOP/s) for an ``(m, k) @ (k, n)`` product."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.perf_counter() - t) / 1e9


def flops_per_cell_epoch(g: float, h1: int, h2: int, k: int, batch: int, unl_frac: float) -> float:
    """FLOPs one cell costs per epoch of ORCA's full objective.

    ``g``: the first layer's inputs multiplied per cell: the number of genes, or on the sparse
    layout the stored values per cell. The first layer runs once for both dropout views (it
    comes before the first dropout): ``2 g h1`` forward and ``2 g h1`` for its weight gradient
    (no gradient w.r.t. its input). The rest runs per view: ``2 (h1 h2 + h2 K)`` forward and
    twice that backward. Pair selection: a ``B x B x h2`` similarity per batch, i.e. ``2 B h2``
    per cell; the uncertainty pass: one forward pass over the unlabelled cells.
    """
    first = 2 * g * h1
    rest = 2 * (h1 * h2 + h2 * k)
    pairs = 2 * batch * h2
    return 2 * first + 2 * (rest + 2 * rest) + pairs + unl_frac * (first + rest)


def simulated_open_world(n: int, n_genes: int, seed: int = 0, library_size: float = 3000.0):
    """Simulated counts of 10 types; half of the cells of types 0-4 labelled in ``obs['lab']``.

    ``library_size`` sets how sparse the matrix is: 3,000 counts over 2,000 genes gives 45%
    non-zeros after normalisation, 150 gives 5.6% (real data after selecting 2,000 genes: 1-7%).
    Returns ``(adata, labelled)`` with ``labelled`` a boolean mask.
    """
    from ..datasets import simulate

    a = simulate(n, n_genes, 10, library_size=library_size, seed=seed)
    rng = np.random.default_rng(seed)
    seen = [f"type_{i}" for i in range(5)]
    lab = a.obs["cell_type"].isin(seen).to_numpy() & (rng.random(a.n_obs) < 0.5)
    a.obs["lab"] = a.obs["cell_type"].astype(object).where(lab, None)
    return a, lab


def epoch_speed(adata, labelled: np.ndarray) -> dict:
    """Seconds per epoch of the full objective (its epochs' seconds over their steps, times the
    steps of an epoch) of an AnnData annotated by ORCA, next to the FLOP floor of its
    architecture on this machine: its FLOPs at the measured dense matmul throughput, the first
    layer counted on the stored values alone where it was a sparse product (no sparse kernel is
    faster per FLOP than a dense one).
    """
    u = adata.uns["orca"]
    h = u["history"]
    full = ~np.asarray(h["warmup"], dtype=bool)
    steps = np.asarray(h["steps"], dtype=float)[full]
    per_step = float(np.asarray(h["seconds"])[full].sum() / max(1.0, steps.sum()))
    h1, h2 = u["params"]["hidden_dims"]
    k = len(u["seen_classes"]) + u["n_novel"]["heads"]
    batch = u["params"]["batch_size"]
    per_epoch = per_step * int(np.ceil(adata.n_obs / batch))
    g = u["data"]["n_genes_used"]  # genes the network was trained on
    t = u["training"]
    inputs = g * t["density"] if t["layout"] == "sparse" else g
    fpc = flops_per_cell_epoch(inputs, h1, h2, k, batch, float(np.mean(~labelled)))
    gflops = matmul_gflops(batch, g, h1)
    return {
        "seconds_per_epoch": per_epoch,
        "flops_per_cell_epoch": fpc,
        "matmul_gflops": gflops,
        "flop_floor_seconds_per_epoch": fpc * adata.n_obs / (gflops * 1e9),
    }


#: the stages in the order the pipeline runs them (a nested one after its stage; the margin's
#: refresh runs in every phase: the warm-up, the fold warm-ups and the open-world fit)
STAGE_ORDER = ("prepare", "alignment", "warm-up", "margin refresh", "self-check",
               "cross-fitted warm-ups", "fold warm-ups", "discovery", "integration", "size check",
               "open-world fit", "inference", "novelty test (cross-fit)", "fold inference",
               "fold scores", "naming, novelty and calibration", "other")  # fmt: skip

#: prefix of the scaling table's per-stage columns (seconds)
STAGE_PREFIX = "stage: "


def _orca_point(a, lab, seed: int) -> dict:
    """ORCA with its defaults (every gene of the simulation), timed from the call to the
    labels, with the seconds of each stage of the pipeline (``"stage: <name>"`` columns,
    :class:`~orca_sc.benchmark.StageTimer`; ``"stage: other"`` is the time outside them).
    """
    import torch

    from .. import metrics
    from ..tl import annotate
    from ._hooks import StageTimer, observe

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with PeakMemory() as mem, warnings.catch_warnings(), observe(StageTimer()) as (timer,):
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        annotate(a, labels_key="lab", n_genes=None, seed=seed, progress=False)
        total = time.perf_counter() - t0
    stages = {f"{STAGE_PREFIX}{k}": v for k, v in timer.seconds.items()}
    stages[f"{STAGE_PREFIX}other"] = max(0.0, total - timer.outer_seconds())
    speed = epoch_speed(a, lab)
    t = a.uns["orca"]["training"]
    rep = metrics.report(a, "cell_type")
    out = {
        "seconds": total,
        "training_seconds": t["seconds"],
        "discovery_seconds": t["discovery_seconds"],
        "novelty_test_seconds": t["novelty_test_seconds"],
        "steps": t["steps"],
        "seconds_per_epoch": speed["seconds_per_epoch"],
        "flop_floor_seconds_per_epoch": speed["flop_floor_seconds_per_epoch"],
        "matmul_gflops": speed["matmul_gflops"],
        "cells_per_second": a.n_obs / total,
        "peak_mb": mem.peak_mb,
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan"),
        "device": t["device"],
        "layout": t["layout"],
        "non_zeros": t["density"],  # of the matrix as trained on
        "seen_accuracy": rep["seen_accuracy"],
        "novel_accuracy": rep["novel_accuracy"],
        "all_accuracy": rep["all_accuracy"],
    }
    return out | training_columns(a.uns["orca"]) | stages


def training_columns(uns: dict) -> dict:
    """Steps each phase of training ran (``warmup_steps``, ``open_world_steps``), its schedule's
    (``*_max_steps``) and why it stopped (``*_stopped``), from ``uns['orca']['training']``.
    """
    phases = uns["training"].get("phases", {})
    out = {}
    for name, col in (("warm-up", "warmup"), ("open-world", "open_world")):
        if name in phases:
            ph = phases[name]
            out |= {f"{col}_steps": int(ph["steps"]), f"{col}_max_steps": int(ph["max_steps"]),
                    f"{col}_stopped": str(ph["stopped"])}  # fmt: skip
    return out


def _lr_point(a, lab, seed: int) -> dict:
    """CellTypist's model family (logistic regression on log-normalised, scaled genes)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    from .._read import log_normalize

    with PeakMemory() as mem, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        X = log_normalize(a.X.tocsr(), 1e4)
        y = a.obs["cell_type"].astype(str).to_numpy()
        scaler = StandardScaler(with_mean=False).fit(X[lab])
        clf = LogisticRegression(max_iter=200, C=0.1, random_state=seed)
        clf.fit(scaler.transform(X[lab]), y[lab])
        clf.predict_proba(scaler.transform(X[~lab]))
        total = time.perf_counter() - t0
    return {"seconds": total, "peak_mb": mem.peak_mb}


def _celltypist_point(a, lab, seed: int) -> dict:
    import anndata as ad
    import celltypist

    from .._read import log_normalize

    with PeakMemory() as mem, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        X = log_normalize(a.X.tocsr(), 1e4)
        ref = ad.AnnData(X=X[lab], var=a.var[[]])
        ref.obs["label"] = a.obs["cell_type"].astype(str).to_numpy()[lab]
        logging.getLogger("celltypist").setLevel(logging.WARNING)
        # SGD mode (the default solver passes multi_class="ovr", removed in scikit-learn 1.8),
        # with mini-batches (CellTypist recommends them for large data; they are faster from a
        # few thousand cells: at 10,000 cells plain SGD took 44.8 s), or plain SGD where there
        # are fewer labelled cells than one mini-batch
        model = celltypist.train(
            ref, labels="label", check_expression=False, use_SGD=True,
            mini_batch=int(lab.sum()) >= MINI_BATCH_CELLS, n_jobs=1, feature_selection=False,
            random_state=seed,
        )  # fmt: skip
        celltypist.annotate(ad.AnnData(X=X[~lab], var=a.var[[]]), model, mode="prob match")
        total = time.perf_counter() - t0
    return {"seconds": total, "peak_mb": mem.peak_mb}


#: CellTypist is trained in mini-batches from this many labelled cells (one of its batches)
MINI_BATCH_CELLS = 1_000


def run_scaling(
    sizes: Sequence[int] = (2_000, 10_000, 100_000),
    n_genes: int = 2000,
    seed: int = 0,
    progress: bool = True,
    library_size: float | Sequence[float] = 150.0,
    disk_sizes: Sequence[int] = (),
    workdir: str | Path | None = None,
) -> pd.DataFrame:
    """ORCA with its defaults and CellTypist (or, when CellTypist cannot run here, logistic
    regression, its model family: the ``method`` column says which) on simulated counts of
    each of ``sizes`` cells in memory (a quarter of them labelled: half the cells of 5 of 10
    types), timed from the call to the labels; CellTypist is trained in its SGD mini-batch
    mode from 1,000 labelled cells (one of its batches; plain SGD below). ``disk_sizes``: ORCA alone on data read from an
    ``.h5ad`` file (:func:`orca_sc.read_lazy`), written once to ``workdir`` (default: the
    data cache, ``orca_sc.datasets.default_cache_dir() / "scaling"``) and kept for later runs.
    ``library_size``: counts per cell of the simulation, or several (every size is run at
    each, the ``library_size`` and ``non_zeros`` columns say which); 150 gives the sparsity of
    real data after selecting 2,000 genes (5.6-6.6% non-zeros), 3,000 a dense matrix (43%).
    ORCA's rows carry the seconds of each stage (``"stage: <name>"`` columns).
    """
    from ._run import _warm_up

    _warm_up()
    libs = [float(library_size)] if np.isscalar(library_size) else [float(v) for v in library_size]
    parts = [_scaling_at(sizes, n_genes, seed, progress, lib, disk_sizes, workdir) for lib in libs]
    return pd.concat(parts, ignore_index=True)


def _scaling_at(sizes, n_genes, seed, progress, library_size, disk_sizes, workdir) -> pd.DataFrame:
    """:func:`run_scaling` at one library size."""
    rows = []
    for n in sizes:
        a, lab = simulated_open_world(n, n_genes, seed, library_size=library_size)
        orca = _orca_point(a, lab, seed)
        where = {"library_size": library_size, "non_zeros": orca["non_zeros"]}
        rows.append({"method": "ORCA", "n_cells": n, "storage": "memory", **where, **orca})
        try:
            point = _celltypist_point(a, lab, seed)
            name = "CellTypist"
        except Exception as e:  # noqa: BLE001 - not installed, or broken with this scikit-learn
            logger.info("CellTypist unavailable for scaling (%s); using logistic regression.", e)
            point = _lr_point(a, lab, seed)
            name = "Logistic regression (CellTypist's model; CellTypist unavailable)"
        rows.append({"method": name, "n_cells": n, "storage": "memory", **where, **point})
        if progress:
            logger.info(
                "scaling %d cells: ORCA %.1f s (%d steps), %.0f MB; %s %.1f s",
                n, orca["seconds"], orca["steps"], orca["peak_mb"], name, point["seconds"],
            )  # fmt: skip
        del a
    for n in disk_sizes:
        path = _simulated_file(n, n_genes, seed, library_size, workdir)
        a = read_lazy(path)
        lab = a.obs["lab"].notna().to_numpy()
        orca = _orca_point(a, lab, seed)
        rows.append({"method": "ORCA", "n_cells": n, "storage": "disk",
                     "library_size": library_size, **orca})  # fmt: skip
        if progress:
            logger.info("scaling %d cells on disk: ORCA %.1f s (%d steps), %.0f MB",
                        n, orca["seconds"], orca["steps"], orca["peak_mb"])  # fmt: skip
        del a
    return pd.DataFrame(rows)


def _simulated_file(n: int, n_genes: int, seed: int, library_size: float,
                    workdir: str | Path | None) -> Path:  # fmt: skip
    """The ``.h5ad`` of :func:`simulated_open_world`, written once (to a temporary name, then
    renamed, so an interrupted write leaves no file that looks complete).
    """
    from ..datasets import default_cache_dir

    folder = Path(workdir) if workdir is not None else default_cache_dir() / "scaling"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"sim_{n}_{n_genes}_{library_size:g}_{seed}.h5ad"
    if not path.exists():
        a, _ = simulated_open_world(n, n_genes, seed, library_size=library_size)
        a.obs["lab"] = a.obs["lab"].astype("category")
        tmp = path.with_suffix(".partial.h5ad")
        a.write_h5ad(tmp)
        tmp.replace(path)
        del a
    return path
