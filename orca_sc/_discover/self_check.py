"""The self-check: hide some known types and known-type cells, run discovery, and report how its
rules did on what was hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._ablation import DiscoveryRules
from .._notes import Note, note_fields
from .ood import _hold_out_per_class

_DEFAULTS = DiscoveryRules()


@dataclass(frozen=True)
class SelfCheckSplit:
    """The run-time self-check's data (:func:`self_check_split`): known types of the reference
    hidden as if novel, and labelled cells of the other types held out as known-type queries.
    """

    held_types: np.ndarray  # class codes treated as novel
    novel: np.ndarray  # (n,) bool: labelled cells of the held-out types
    known: np.ndarray  # (n,) bool: labelled cells of the other types, held out
    labels: np.ndarray  # (n,) the probe's labels: other types recoded 0..k-1, -1 unlabelled
    domain: np.ndarray  # (n,) the probe's batches

    def subset(self, rows: np.ndarray) -> SelfCheckSplit:
        """The split restricted to the cells ``rows``."""
        return SelfCheckSplit(
            self.held_types, self.novel[rows], self.known[rows], self.labels[rows],
            self.domain[rows],
        )  # fmt: skip


def self_check_split(
    labels: np.ndarray,
    domain: np.ndarray,
    *,
    type_fraction: float = _DEFAULTS.self_check_types,
    known_fraction: float = _DEFAULTS.self_check_known,
    min_cells: int = _DEFAULTS.n_neighbors,
    seed: int = 0,
) -> SelfCheckSplit | None:
    """Hide ``type_fraction`` of the known types (at least one; at least two stay known) and
    ``known_fraction`` of every other type's labelled cells (never its last one), as in DTC's
    probe classes (Han et al., ICCV 2019). Only types with at least ``min_cells`` labelled cells
    are hidden: a smaller group rarely forms a cluster of its own (the neighbours of the
    clustering graph), so missing it would say nothing about the rules. Where the real unlabelled
    cells are mostly in batches without labels (a separate query), the hidden cells form a batch
    of their own, so that the probe goes through the same rules as the query; otherwise they stay
    in their batches. Returns ``None`` when no type can be hidden (fewer than three known types,
    or none with ``min_cells`` cells).
    """
    classes, counts = np.unique(labels[labels >= 0], return_counts=True)
    eligible = classes[counts >= min_cells]
    if classes.size < 3 or eligible.size == 0:
        return None
    rng = np.random.default_rng(seed)
    n_held = int(
        np.clip(round(type_fraction * classes.size), 1, min(eligible.size, classes.size - 2))
    )
    held_types = np.sort(rng.choice(eligible, n_held, replace=False))
    novel = np.isin(labels, held_types)
    known = _hold_out_per_class(np.where(novel, -1, labels), known_fraction, rng)
    keep = np.setdiff1d(classes, held_types)
    recode = np.full(int(classes.max()) + 1, -1)
    recode[keep] = np.arange(keep.size)
    probe_labels = np.where((labels >= 0) & ~novel & ~known, recode[np.maximum(labels, 0)], -1)
    unl = labels < 0
    labelled_batches = np.unique(domain[labels >= 0])
    query_like = unl.any() and np.mean(~np.isin(domain[unl], labelled_batches)) > 0.5
    probe_domain = np.where(novel | known, domain.max() + 1, domain) if query_like else domain
    return SelfCheckSplit(held_types, novel, known, probe_labels, probe_domain)


def youden_threshold(novel_score: np.ndarray, known_score: np.ndarray) -> tuple[float, float]:
    """The cut ``t`` on a score (cells below ``t`` are called novel) that best tells the two
    groups apart: the maximum over ``t`` of Youden's J = (share of ``novel_score`` below ``t``)
    - (share of ``known_score`` below ``t``). Returns ``(t, J)``; ``t`` is midway between the
    two scores at the cut.
    """
    scores = np.concatenate([novel_score, known_score])
    is_novel = np.concatenate([np.ones(novel_score.size), np.zeros(known_score.size)])
    order = np.argsort(scores, kind="stable")
    s, y = scores[order], is_novel[order]
    j = np.cumsum(y) / max(novel_score.size, 1) - np.cumsum(1 - y) / max(known_score.size, 1)
    last = np.r_[s[1:] != s[:-1], True]  # only cut between distinct scores
    j = np.where(last, j, -np.inf)
    i = int(np.argmax(j))
    t = (s[i] + s[i + 1]) / 2 if i + 1 < s.size else s[i] + 1e-6
    return float(t), float(max(j[i], 0.0))


def self_check_report(
    assign: np.ndarray,
    maxcos: np.ndarray,
    threshold: float,
    labels: np.ndarray,
    split: SelfCheckSplit,
    classes: list[str],
    cfg: DiscoveryRules = _DEFAULTS,
) -> dict[str, Any]:
    """How the discover rules did on the self-check (:func:`self_check_split`): ``assign`` is
    the probe's candidate cluster per cell (-1 none), ``maxcos`` its cells' best cosine to a
    seen head and ``threshold`` its out-of-distribution threshold; ``labels`` the true codes.

    Reports the share of hidden-type cells in candidate clusters (``novel_called``), the share
    of held-out known-type cells there (``known_called_novel``), the clustering accuracy of the
    hidden types (Hungarian, cells outside candidates wrong), the candidate clusters made mostly
    of hidden-type cells (among the hidden and held-out cells in them) against the number of
    hidden types (granularity), and the Youden cut
    of the probe's cosine (:func:`youden_threshold`) beside the threshold the rules used.
    """
    from scipy.optimize import linear_sum_assignment

    cand = assign >= 0
    nov, kno = split.novel, split.known
    held = split.held_types
    # hidden type x candidate cluster, over the hidden-type cells
    n_c = int(assign.max()) + 1 if cand.any() else 0
    t_idx = np.searchsorted(held, labels[nov & cand])
    table = np.zeros((held.size, max(n_c, 1)), dtype=np.int64)
    np.add.at(table, (t_idx, assign[nov & cand]), 1)
    r, c = linear_sum_assignment(-table)
    acc = table[r, c].sum() / max(int(nov.sum()), 1)
    # clusters made mostly of hidden-type cells, among their cells whose type is known here
    # (the probe's cells; in one batch the unlabelled cells of a hidden type join its cluster)
    probe = cand & (nov | kno)
    per_cluster = np.bincount(assign[probe], minlength=n_c)
    hidden_in = table.sum(axis=0)[:n_c] if n_c else np.zeros(0)
    n_found = int(np.sum(hidden_in > per_cluster / 2)) if n_c else 0
    t_j, j = youden_threshold(maxcos[nov], maxcos[kno])
    report = {
        "hidden_types": [classes[k] for k in held],
        "n_hidden_cells": int(nov.sum()),
        "n_known_cells": int(kno.sum()),
        "novel_called": float(cand[nov].mean()) if nov.any() else float("nan"),
        "known_called_novel": float(cand[kno].mean()) if kno.any() else float("nan"),
        "hidden_accuracy": float(acc),
        "hidden_clusters_found": n_found,
        "hidden_types_true": int(held.size),
        "threshold": float(threshold),
        "novel_below_threshold": float(np.mean(maxcos[nov] < threshold)),
        "known_below_threshold": float(np.mean(maxcos[kno] < threshold)) if kno.any() else 0.0,
        "youden_threshold": t_j,
        "youden_j": j,
    }
    hidden = ", ".join(report["hidden_types"])
    notes = []
    if kno.sum() >= 1 / cfg.ood_max_rate and report["known_called_novel"] > cfg.ood_max_rate:
        notes.append(
            Note(
                f"Self-check: {report['known_called_novel']:.0%} of held-out known-type cells "
                "called novel; expect as much here (uns['orca']['self_check']).",
                f"Self-check: with {hidden} hidden, the discover rules put "
                f"{report['known_called_novel']:.0%} of held-out known-type cells into novel "
                "clusters; expect a similar share of this query's known-type cells in novel "
                "clusters (see uns['orca']['self_check']).",
            )
        )
    if nov.any() and report["novel_called"] < 0.5:
        notes.append(
            Note(
                f"Self-check: only {report['novel_called']:.0%} of the hidden types' cells called "
                "novel; close novel types may be absorbed (uns['orca']['self_check']).",
                f"Self-check: the discover rules called only {report['novel_called']:.0%} of the "
                f"cells of the hidden known types ({hidden}) novel; novel types as close to the "
                "known ones as these may be absorbed by known types.",
            )
        )
    report.update(note_fields(notes))
    return report
