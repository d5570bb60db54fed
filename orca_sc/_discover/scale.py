"""Whether discovery's call depends on how many cells carry the types: the candidates a run
found among all its cells against those that the warm-up and discovery find when run on a
random sample of the cells alone (:func:`size_check`).

On the same data, the in-sample threshold and the clustering move with the number of cells (the
warm-up fits its labelled cells less closely as they grow in number, so the threshold's rate on
known cells it did not fit falls: 37% at 20,000 simulated droplet-depth cells, 13% at 50,000; a
fixed Leiden resolution cuts more cells differently). Where the sample and the whole disagree,
the call is the size's and not the data's alone, and the user is told.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from .._notes import Note
from ._stage import Discovery
from .graph import subsample_rows

#: cells of the sample that discovery is repeated on; the check runs above twice as many
SAMPLE_CELLS = 10_000
#: the out-of-distribution threshold of all the cells is called degenerate below this share of
#: the sample's (simulated droplet depth, 100,000 cells: 0.131 against 0.328, nothing found; a
#: million cells: 0.031 against 0.386; plate depth, right at 50,000 and 100,000 cells: 0.72-0.73)
THRESHOLD_SHARE = 0.5


def size_check(
    found: Discovery,
    n_cells: int,
    discover_on: Callable[[np.ndarray], Discovery],
    *,
    seed: int = 0,
    sample_cells: int | None = None,
) -> Discovery:
    """``found`` (discovery of a run on ``n_cells`` cells) with the candidates that
    ``discover_on`` (a warm-up and discovery on the given cells alone) finds among a random
    ``sample_cells`` of them (sorted indices) in ``diagnostics['size_check']`` and, where the two
    disagree (none found on all the cells but some on the sample, or counts apart by more than
    one and a quarter of the sample's), a note for the user. Nothing is repeated for data of at
    most twice ``sample_cells`` (default :data:`SAMPLE_CELLS`) cells. The labels do not change.
    """
    sample_cells = SAMPLE_CELLS if sample_cells is None else sample_cells
    if n_cells <= 2 * sample_cells:
        return found
    sample = subsample_rows(n_cells, seed, sample_cells)
    small = discover_on(sample)
    k, m = found.n_novel, small.n_novel
    tau, sample_tau = _in_sample(found), _in_sample(small)
    record = {
        "n_cells": int(n_cells),
        "sample_cells": int(sample.size),
        "candidates": int(k),
        "sample_candidates": int(m),
        "threshold_in_sample": tau,
        "sample_threshold": sample_tau,
        "agrees": not ((k == 0 and m > 0) or abs(k - m) > max(1, m / 4)),
        "threshold_degenerate": _degenerate(tau, sample_tau),
    }
    notes = found.notes
    if record["threshold_degenerate"]:
        notes += (
            Note(
                f"The threshold among {n_cells:,} cells ({tau:.3f}) is far below a "
                f"{sample.size:,}-cell sample's ({sample_tau:.3f}): novel cells can go unnoticed "
                "(uns['orca']['estimate']['size_check']).",
                f"Discovery's out-of-distribution threshold among {n_cells:,} cells is "
                f"{tau:.3f}, against {sample_tau:.3f} when the warm-up and discovery "
                f"ran on a random {sample.size:,} of them alone: the warm-up fitted its labelled "
                "cells so loosely at this size that almost no cell falls below it, and cells of a "
                "novel type can go unnoticed"
                + (
                    " in batches with labelled cells (in batches without them clusters were also "
                    "voted on their cells' scores against labelled cells no net trained on, which "
                    "this does not affect: estimate['query_votes'])"
                    if _conformal_votes(found)
                    else ""
                )
                + ". uns['orca']['estimate']['size_check'] has both.",
            ),
        )
    if not record["agrees"]:
        notes += (
            Note(
                f"{k} candidate novel cluster(s) among {n_cells:,} cells, {m} in a "
                f"{sample.size:,}-cell sample: the count depends on the size "
                "(uns['orca']['estimate']['size_check']).",
                f"Discovery found {k} candidate novel cluster(s) among {n_cells:,} cells, but {m} "
                f"when the warm-up and discovery ran on a random {sample.size:,} of them alone: at "
                "this size the call depends on how many cells carry each type, not on the data "
                "alone, and this run cannot tell which count is right (the sample also holds fewer "
                "labelled cells)"
                + (", so 'no novel type' is not supported by these data" if k == 0 else "")
                + ". Compare with a run on a random sample of the cells "
                f"(sc.pp.subsample(adata, n_obs={sample.size})); "
                "uns['orca']['estimate']['size_check'] has both counts.",
            ),
        )
    return replace(found, diagnostics={**found.diagnostics, "size_check": record}, notes=notes)


def _conformal_votes(found: Discovery) -> bool:
    """Whether any query cluster of ``found`` was voted on its conformal p-values."""
    means = found.diagnostics.get("query_votes", {}).get("mean_p", [])
    return bool(np.isfinite(np.asarray(means, dtype=float)).any())


def _in_sample(found: Discovery) -> float | None:
    """The in-sample quantile of a discovery's threshold (before any held-out cap: the part
    that moves with the number of cells), or its threshold where the record lacks it.
    """
    return found.diagnostics.get("threshold_in_sample", found.threshold)


def _degenerate(threshold: float | None, sample_threshold: float | None) -> bool:
    """Whether the threshold of all the cells is below :data:`THRESHOLD_SHARE` of the
    sample's (both are best cosines to a seen head; a missing or non-positive sample threshold
    says nothing).
    """
    if threshold is None or sample_threshold is None or not sample_threshold > 0:
        return False
    return bool(threshold < THRESHOLD_SHARE * sample_threshold)
