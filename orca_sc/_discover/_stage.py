"""What the ``discover`` stage returns (:class:`Discovery`) and what it tells the user."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._ablation import DiscoveryRules
from .._notes import Note, note_fields

_DEFAULTS = DiscoveryRules()
#: below this many unlabelled cells, discover notes that small novel types go undetected
_SMALL_QUERY = 500
#: below this median of labelled cells per seen class, discover notes that known types may be
#: called novel (the suite's few-label corners: 17-25 cells per type failed, ~70 did not)
_FEW_LABELS = 50


@dataclass(frozen=True)
class Discovery:
    """What the ``discover`` stage found, over the cells it was given (indices into them).

    ``assign``: candidate novel cluster of each cell (``-1``: none), largest first; ``sizes``:
    cells per candidate; ``n_novel``: the estimated number of novel types (the number of
    candidates); ``prototypes``: initial weights ``(n_heads, D)`` of the novel heads (candidate
    means in the warmed-up embedding; random for heads beyond the candidates); ``prior``: the
    regulariser's target over seen + novel heads (``None``: uniform); ``anchor_cells`` and
    ``anchor_heads``: the core cells of coherent candidates and the head (``n_seen + j``) each is
    anchored to; ``threshold``: the out-of-distribution threshold of the best seen-head cosine
    (``None`` without a warm-up); ``notes``: where the data cannot support a call, for the user;
    ``diagnostics``: JSON-able figures for ``uns`` (see :func:`discover`).
    """

    assign: np.ndarray
    sizes: tuple[int, ...]
    n_novel: int
    prototypes: np.ndarray
    prior: np.ndarray | None
    anchor_cells: np.ndarray
    anchor_heads: np.ndarray
    diagnostics: dict[str, Any] = field(default_factory=dict)
    threshold: float | None = None
    notes: tuple[str, ...] = ()

    @property
    def n_heads(self) -> int:
        return int(self.prototypes.shape[0])

    def record(self) -> dict[str, Any]:
        """What ``uns['orca']['estimate']`` holds: the diagnostics, the threshold and the notes."""
        if self.threshold is None:  # no warm-up: no threshold, no notes
            return dict(self.diagnostics)
        return {**self.diagnostics, "threshold": self.threshold, **note_fields(self.notes)}


def _once_per_cell_set(pca_of: Callable[[np.ndarray], np.ndarray]):
    """``pca_of`` computed once per set of cells (on single-batch data the batch's cells and all
    cells are the same set).
    """
    pcas: dict[bytes, np.ndarray] = {}

    def pca_cells(idx: np.ndarray) -> np.ndarray:
        key = np.asarray(idx, dtype=np.int64).tobytes()
        if key not in pcas:
            pcas[key] = pca_of(idx)
        return pcas[key]

    return pca_cells


def _notes(labels, n_seen: int, n_cal: int, cfg: DiscoveryRules) -> list[str]:
    """Where the data cannot support a call: said to the user (``estimate['notes']``, log)."""
    lab = labels >= 0
    n_unl = int((~lab).sum())
    notes = []
    per_class = np.bincount(labels[lab], minlength=n_seen)
    if cfg.calibration_fraction > 0 and n_cal * cfg.ood_max_rate < 1:
        notes.append(
            Note(
                f"Only {n_cal} labelled cells calibrate the threshold: the share of known-type "
                "cells called novel is not controlled (uns['orca']['estimate']['notes']).",
                f"Only {n_cal} labelled cells were held out to calibrate the out-of-distribution "
                f"threshold (fewer than 1/ood_max_rate = {1 / cfg.ood_max_rate:.0f}): the share of "
                "known-type cells called novel is not controlled; more labelled cells would "
                "tighten it.",
            )
        )
    elif cfg.calibration_fraction == 0 and np.median(per_class) < _FEW_LABELS:
        notes.append(
            Note(
                f"Few labelled cells per known type (median {np.median(per_class):.0f}): "
                "known-type cells may be called novel (uns['orca']['estimate']['notes']).",
                f"Few labelled cells per known type (median {np.median(per_class):.0f}): the "
                "warm-up fits them closely, so cells of known types can score as unlike them and "
                "be reported as novel clusters (simulated, 17-25 labelled cells per type: 17-47% of "
                "known-type cells). Check novel clusters against uns['orca']['novel_similarity'], "
                "or calibrate the threshold on held-out cells: calibration_fraction=0.2.",
            )
        )
    if n_unl < _SMALL_QUERY:
        notes.append(
            Note(
                f"Only {n_unl} unlabelled cells: a novel type of fewer than about "
                f"{cfg.n_neighbors} cells may be absorbed by a known type "
                "(uns['orca']['estimate']['notes']).",
                f"Only {n_unl} unlabelled cells: a novel type of fewer than about "
                f"{cfg.n_neighbors} cells (the neighbours of the clustering graph) rarely forms a "
                "cluster of its own and may be absorbed by a known type (simulated 150-cell "
                "queries: a third of the novel-type cells were).",
            )
        )
    return notes
