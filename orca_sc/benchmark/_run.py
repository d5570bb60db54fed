"""Run methods on tasks over seeds; collect metrics, wall time and peak memory; write the report."""

from __future__ import annotations

import logging
import os
import platform
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .. import __version__, metrics
from ._methods import METHODS, Method, MethodUnavailable
from ._tasks import TaskSpec

logger = logging.getLogger(__name__)

METRICS = ["seen_acc", "novel_acc", "novel_nmi", "all_acc"]


# ------------------------------------------------------------------------------------- memory
def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):  # not Linux: peak RSS so far (monotone)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pin_threads(n: int) -> None:
    """Set torch's intra-op threads to ``n`` before each run of a benchmark.

    scanpy's numba kernels (``sc.pp.normalize_total`` and others) set the process's OpenMP
    thread count, which torch shares, to the number of CPUs the first time they run (with
    ``OMP_NUM_THREADS=1``: 1 -> 2 on 2 cores). A benchmark runs them between tasks, so without
    this a task's figures would depend on what ran before it in the process (a suite run and a
    ``--only`` rerun of the same task and seed gave thresholds 0.457195 and 0.457213).
    """
    import torch

    torch.set_num_threads(n)


def check_jobs(jobs: object) -> None:
    """``jobs`` of a benchmark: a positive integer, else ``ValueError``."""
    if not (isinstance(jobs, int) and not isinstance(jobs, bool) and jobs >= 1):
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")


def worker_threads(threads: int, jobs: int, n_work: int) -> int:
    """The torch threads each run gets in :func:`map_runs`: all ``threads`` in one process
    (``jobs == 1`` or at most one run), else ``max(1, threads // jobs)`` per worker.
    """
    return threads if jobs == 1 or n_work <= 1 else max(1, threads // jobs)


def map_runs(
    fn: Callable[..., Any],
    work: Sequence[tuple],
    jobs: int,
    threads: int,
    *,
    initializer: Callable[[], None] | None = None,
) -> Iterator[Any]:
    """``fn(*args, n_threads)`` for each ``args`` of ``work``, yielded in the order of ``work``.

    In this process when :func:`worker_threads` says so (torch's thread count set back to
    ``threads`` afterwards), else in ``min(jobs, len(work))`` fresh worker processes
    (``spawn``: no forked torch or OpenMP state) that each run ``initializer`` once. ``fn`` must
    be importable (a module-level function) and its result picklable.
    """
    check_jobs(jobs)
    per_run = worker_threads(threads, jobs, len(work))
    if jobs == 1 or len(work) <= 1:
        if initializer is not None:
            initializer()
        try:
            for args in work:
                yield fn(*args, per_run)
        finally:
            pin_threads(threads)  # the caller's count back
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(jobs, len(work)), mp_context=ctx,
                             initializer=initializer) as pool:  # fmt: skip
        futures = [pool.submit(fn, *args, per_run) for args in work]
        for future in futures:  # in the order of the work: the rows of one process
            yield future.result()


class PeakMemory:
    """Peak resident memory above the level at entry, sampled every ``interval`` seconds.

    Resident memory covers numpy, scipy and torch allocations alike (``tracemalloc`` misses
    torch's). ``peak_mb`` is available after the ``with`` block.
    """

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak_mb = 0.0

    def __enter__(self) -> PeakMemory:
        self._start = _rss_bytes()
        self._peak = self._start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, _rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, _rss_bytes())
        self.peak_mb = (self._peak - self._start) / 2**20


# ------------------------------------------------------------------------------------ scoring
def score(truth: np.ndarray, pred: np.ndarray, seen: Sequence[str], names_types: bool) -> dict:
    """The paper's metrics; clusters of methods that cannot name types get oracle names first."""
    pred = np.asarray(pred, dtype=object).astype(str)
    if not names_types:
        mapping = metrics.hungarian_match(truth, pred)
        seen_set = set(seen)
        pred = np.array(
            [mapping[p] if mapping.get(p) in seen_set else f"novel:{p}" for p in pred],
            dtype=object,
        )
    found = sorted(set(pred) - set(seen))
    called_novel = ~np.isin(pred, list(seen))
    is_novel = ~np.isin(truth, list(seen))
    return {
        "seen_acc": metrics.seen_accuracy(truth, pred, seen),
        "novel_acc": metrics.novel_accuracy(truth, pred, seen),
        "novel_nmi": metrics.novel_nmi(truth, pred, seen),
        "all_acc": metrics.all_accuracy(truth, pred),
        "novel_found": len(found),
        # Hungarian novel accuracy can score a novel type absorbed whole by a known label as
        # correct: say how many novel-type cells were called novel, and known-type cells too
        "novel_called": float(called_novel[is_novel].mean()) if is_novel.any() else np.nan,
        "known_called_novel": float(called_novel[~is_novel].mean())
        if (~is_novel).any()
        else np.nan,
    }


@dataclass
class BenchmarkResult:
    runs: pd.DataFrame
    summary: pd.DataFrame
    scaling: pd.DataFrame | None = None
    unavailable: dict[str, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)


def run_benchmark(
    tasks: Sequence[TaskSpec],
    methods: Sequence[str] | None = None,
    seeds: Sequence[int] = (0, 1, 2),
    *,
    ablation_seeds: Sequence[int] | None = None,
    progress: bool = True,
    jobs: int = 1,
) -> BenchmarkResult:
    """Every method on every task and seed. A method that fails is recorded, not fatal.

    ``ablation_seeds`` (default: ``seeds``) are the seeds for the ablations and the
    over-provisioned-heads runs, which cost as much as ORCA itself each. ``jobs``: each task and
    seed's runs in one of that many fresh worker processes (``spawn``), each pinned to
    ``max(1, threads // jobs)`` torch threads; the rows are those of one process at that count,
    in the same order (as :func:`orca_sc.benchmark.run_orca_suite`).
    """
    import torch

    methods = list(methods) if methods is not None else list(METHODS)
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        msg = f"unknown methods {unknown}; available: {list(METHODS)}"
        raise ValueError(msg)
    check_jobs(jobs)
    threads = torch.get_num_threads()  # every run at the count the benchmark started with
    abl = list(ablation_seeds) if ablation_seeds is not None else list(seeds)
    plan = {name: abl if METHODS[name].family in ("ablation", "heads") else list(seeds)
            for name in methods}  # fmt: skip
    all_seeds = sorted({s for name in methods for s in plan[name]})
    work = [(spec, seed, methods, plan) for spec in tasks for seed in all_seeds]
    rows: list[dict] = []
    unavailable: dict[str, str] = {}
    for got, missing in map_runs(_task_runs, work, jobs, threads, initializer=_warm_up):
        rows += [r for r in got if r["method"] not in unavailable]
        unavailable |= {k: v for k, v in missing.items() if k not in unavailable}
        _log_runs(got, progress)
    runs = pd.DataFrame(rows)
    return BenchmarkResult(
        runs,
        summarize_runs(runs),
        unavailable=unavailable,
        settings={
            "seeds": list(seeds),
            "ablation_seeds": abl,
            "methods": methods,
            "tasks": [t.name for t in tasks],
            "torch_threads": worker_threads(threads, jobs, len(work)),
            "jobs": jobs,
            "cpu": platform.processor() or platform.machine(),
            "n_cpus": os.cpu_count(),
            "version": __version__,
        },
    )


def _task_runs(
    spec: TaskSpec,
    seed: int,
    methods: Sequence[str],
    plan: dict[str, list[int]],
    threads: int,
) -> tuple[list[dict], dict[str, str]]:
    """The runs of :func:`run_benchmark` on one task and seed at ``threads`` torch threads;
    returns the rows and the methods found unavailable (their rows left out).
    """
    task = spec.make(seed)
    truth = task.truth
    rows, missing = [], {}
    for name in methods:
        m: Method = METHODS[name]
        if name in missing or seed not in plan[name]:
            continue
        t0 = time.perf_counter()
        row = {
            "task": spec.name,
            "kind": spec.kind,
            "method": name,
            "family": m.family,
            "seed": seed,
            "n_query": task.query.n_obs,
            "n_reference": task.reference.n_obs,
            "novel_true": len(task.novel),
        }
        try:
            pin_threads(threads)
            with PeakMemory() as mem:
                pred = m.run(task, seed)
            if isinstance(pred, tuple):  # (labels, extra columns), e.g. ORCA's estimate
                pred, extra = pred
                row.update(extra)
            row.update(score(truth, pred, task.seen, m.names_types))
            row["seconds"] = time.perf_counter() - t0
            row["peak_mb"] = mem.peak_mb
            row["error"] = ""
        except MethodUnavailable as e:
            missing[name] = str(e)
            logger.warning("%s unavailable: %s", name, e)
            continue
        except Exception as e:  # noqa: BLE001 - a failing method is a result, not a crash
            logger.warning("%s failed on %s: %s", name, spec.name, e)
            logger.debug(traceback.format_exc())
            row.update({k: np.nan for k in METRICS})
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    return rows, missing


def _log_runs(rows: list[dict], progress: bool) -> None:
    if not progress:
        return
    for row in rows:
        msg = (
            f"{row['task']} seed {row['seed']} {row['method']}: "
            + " ".join(f"{k}={row.get(k, np.nan):.3f}" for k in METRICS)
            + f" ({row.get('seconds', np.nan):.1f} s)"
        )
        logger.info(msg)


def _warm_up() -> None:
    """Pay one-off costs (lazy imports, thread pools, allocator arenas) before measuring, so that
    the first method's time and memory are not inflated by them.
    """
    import warnings

    from .._ablation import Ablation
    from ..datasets import simulate
    from ..tl import annotate

    a = simulate(300, 200, 4, seed=0)
    a.obs["lab"] = a.obs["cell_type"].astype(object).where(a.obs["cell_type"] != "type_3", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        annotate(a, labels_key="lab", n_genes=100, epochs=2, warmup_epochs=1, ablation=Ablation(epoch_min_steps=2),
                 progress=False)  # fmt: skip
    from sklearn.cluster import KMeans
    from sklearn.linear_model import LogisticRegression

    X = a.X.toarray()[:, :20]
    with warnings.catch_warnings():  # a short fit on purpose: it need not converge
        warnings.simplefilter("ignore")
        KMeans(2, n_init=1, random_state=0).fit(X)
        LogisticRegression(max_iter=50).fit(X, a.obs["cell_type"].astype(str))


def summarize_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean and sd over seeds for every (task, method)."""
    if runs.empty:
        return runs
    cols = [*METRICS, "novel_found", "seconds", "peak_mb"]
    cols = [c for c in cols if c in runs.columns]
    g = runs.groupby(["task", "method"], sort=False)
    mean = g[cols].mean()
    sd = g[cols].std(ddof=0)
    out = mean.add_suffix("_mean").join(sd.add_suffix("_sd"))
    out["novel_true"] = g["novel_true"].first()
    out["family"] = g["family"].first()
    out["n_seeds"] = g["seed"].nunique()
    out["errors"] = g["error"].apply(lambda e: int((e.fillna("") != "").sum()))
    return out.reset_index()
