"""ORCA alone on the development suite, with configuration overrides: the before/after run for
every change of a default (``orca-sc benchmark --suite dev --method ORCA [--set key=value]``).

One row per task and seed: the suite's figures (:func:`orca_sc.benchmark.score`), the novelty
test's and the confidence's (:func:`novelty_test_shares`, :func:`confidence_figures`), each
evidence level of the novel clusters, the self-check's and the size check's where they ran,
how long each phase of training ran, and how the task's reference and query mix before and
after integration (:func:`orca_sc.benchmark.integration_figures`). :func:`orca_sc.benchmark.compare_runs` makes the
before/after tables from two of these.
"""

from __future__ import annotations

import ast
import logging
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from ._integration import integration_figures
from ._methods import annotate_task, confidence_figures, novelty_test_shares
from ._run import PeakMemory, map_runs, pin_threads, score
from ._scaling import training_columns
from ._tasks import TaskSpec

logger = logging.getLogger(__name__)


def config_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """``["epochs=5", "pair_space=pca"]`` -> ``{"epochs": 5, "pair_space": "pca"}``: values are
    Python literals where they parse as one (``true``, ``false`` and ``none`` in any case too),
    strings otherwise. A pair without ``=`` is a :class:`ValueError`.
    """
    words = {"true": True, "false": False, "none": None}
    overrides: dict[str, Any] = {}
    for kv in pairs:
        if "=" not in kv:
            raise ValueError(f"{kv!r} is not key=value (e.g. epochs=5)")
        k, v = kv.split("=", 1)
        word = v.strip().lower()
        if word in words:
            overrides[k.strip()] = words[word]
            continue
        try:
            overrides[k.strip()] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            overrides[k.strip()] = v
    return overrides


def run_orca_suite(
    specs: Sequence[TaskSpec],
    seeds: Sequence[int],
    overrides: dict[str, Any] | None = None,
    *,
    task_seed: int | None = None,
    progress: bool = True,
    jobs: int = 1,
) -> pd.DataFrame:
    """ORCA with ``overrides`` on every task of ``specs`` and seed; one row per run (see the
    module). ``task_seed``: every task's split (labelled cells, hidden types, subsamples) drawn
    with that seed, only the model's seed varying: the same data, another seed.

    ``jobs``: the runs shared among that many worker processes (started fresh, ``spawn``), each
    pinned to ``max(1, threads // jobs)`` torch threads (``threads``: the count the suite
    started with). A run's figures depend on its task, seed, overrides and thread count alone,
    so a suite of ``jobs`` workers at one thread each gives the rows of a one-process suite at
    one thread, in the same order; only the seconds and memory, measured while the other
    workers run, differ.
    """
    import torch

    threads = torch.get_num_threads()  # every run at the count the suite started with
    work = [(spec, seed, overrides or {}, task_seed) for spec in specs for seed in seeds]
    rows: list[dict] = []
    for row in map_runs(_suite_run, work, jobs, threads):
        rows.append(row)
        _log_row(row, progress)
    return pd.DataFrame(rows)


def _suite_run(
    spec: TaskSpec, seed: int, overrides: dict[str, Any], task_seed: int | None, threads: int
) -> dict:
    """One run of :func:`run_orca_suite` (in its process or in a worker) at ``threads``."""
    task = spec.make(seed if task_seed is None else task_seed)
    t0 = time.perf_counter()
    pin_threads(threads)
    with warnings.catch_warnings(), PeakMemory() as mem:
        warnings.simplefilter("ignore")
        q, sl = annotate_task(task, seed, **overrides)
    row = orca_row(spec, task, seed, q, sl, time.perf_counter() - t0)
    row["peak_mb"] = mem.peak_mb
    row |= integration_figures(task, seed)
    row["torch_threads"] = threads
    return row


def _log_row(row: dict, progress: bool) -> None:
    if progress:
        logger.info(
            " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in
                     row.items() if k not in ("kind", "method", "error"))
        )  # fmt: skip


def orca_row(spec: TaskSpec, task, seed: int, q, rows: slice, seconds: float) -> dict:
    """The figures of one annotated task ``q`` (its query cells: ``rows``)."""
    uns = q.uns["orca"]
    pred = q.obs["orca_label"].astype(str).to_numpy()[rows]
    return {
        "task": spec.name,
        "kind": spec.kind,
        "method": "ORCA",
        "family": "ORCA",
        "seed": seed,
        "n_query": task.query.n_obs,
        "novel_true": len(task.novel),
        "novel_est": uns["n_novel"]["estimated"],
        "threshold": uns["estimate"].get("threshold"),
        "pca_input": uns["estimate"].get("integration", {}).get("pca_input", ""),
        "query_vote_extra": _vote_extra(uns["estimate"].get("query_votes")),
        "share_vote_dropped": _share_dropped(uns["estimate"].get("query_votes")),
        # query cells anchored for a significant p-value (anchor_significant): a run with none
        # is the run without the rule
        "anchored_significant": uns["estimate"].get("n_anchored_significant", 0),
        **_size_check_columns(uns["estimate"].get("size_check")),
        **score(task.truth, pred, task.seen, True),
        "novel_sizes": novel_sizes(task.truth, pred, task.seen),
        "seconds": seconds,
        "error": "",
        **_self_check_columns(uns.get("self_check")),
        **novelty_test_shares(q, rows, task),
        **confidence_figures(q, rows, task),
        **_per_cell_columns(q, rows, task),
        **_evidence_columns(q, rows, task),
        **training_columns(uns),
    }


def novel_sizes(truth, pred, seen) -> str:
    """The query cells of each novel cluster, largest first, each marked ``n`` where most of
    them are of novel types and ``k`` where most are of known types (``"327n;96n;1k"``): where
    a surplus of clusters comes from, pieces of novel types or groups of known-type cells.
    """
    truth, pred = np.asarray(truth, dtype=str), np.asarray(pred, dtype=str)
    seen = [str(s) for s in seen]
    called = ~np.isin(pred, seen)  # cells of novel clusters
    _, cluster = np.unique(pred[called], return_inverse=True)
    size = np.bincount(cluster)
    of_novel = np.bincount(cluster, weights=~np.isin(truth[called], seen), minlength=size.size)
    parts = [f"{size[c]}{'n' if of_novel[c] > size[c] / 2 else 'k'}"
             for c in np.argsort(-size, kind="stable")]  # fmt: skip
    return ";".join(parts)


def _vote_extra(votes: dict | None) -> int:
    """Query clusters taken as candidates that the share vote alone would not take
    (``estimate['query_votes']``): where this is 0 in every run of a task, the query vote left
    the run's candidates, and so its labels, as the share vote's.
    """
    if not votes:
        return 0
    share = votes.get("share", votes["candidate"])
    return int(sum(bool(c) and not bool(s) for c, s in zip(votes["candidate"], share, strict=True)))


def _share_dropped(votes: dict | None) -> int:
    """Query clusters the share vote took that its test (``share_vote_test``) left out
    (``estimate['query_votes']``): where this is 0 in every run of a task, the test left the
    run's candidates, and so its labels, as they were without it.
    """
    if not votes:
        return 0
    return int(sum(bool(s) and not bool(c) for c, s in zip(votes["candidate"], votes["share"],
                                                           strict=True)))  # fmt: skip


def _per_cell_columns(q, rows, task) -> dict:
    """With ``majority_vote=True``: the per-cell labels' figures (``per_cell_*``) beside the
    voted ones, from the same run, and the share of query cells in mixed clusters.
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
    (``ev_<level>_false``), their cells and their cells of novel types.
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
            "size_check_agrees": bool(check["agrees"]),
            "size_check_sample_threshold": check.get("sample_threshold"),
            "size_check_threshold_degenerate": bool(check.get("threshold_degenerate", False))}  # fmt: skip


def _self_check_columns(check: dict | None) -> dict:
    """The self-check's figures (``self_check=True``), to set beside the run's own."""
    if not check or "skipped" in check:
        return {}
    keys = ("novel_called", "known_called_novel", "hidden_accuracy", "hidden_clusters_found",
            "hidden_types_true", "n_known_cells", "threshold", "youden_threshold", "seconds")  # fmt: skip
    return {f"check_{k}": check[k] for k in keys}
