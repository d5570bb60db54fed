"""The ``discover`` stage: candidate novel clusters, the number of novel types, and which novel
clusters are known types after all. Every rule that decides these lives in this package, one
module per test, and every parameter is a field of :class:`orca_sc._ablation.DiscoveryRules`
(the user's :class:`orca_sc.DiscoveryConfig` and the rules' constants). Arrays in, a
frozen :class:`Discovery` out: no AnnData, and torch only where a GPU run computes its PCAs and
neighbours on the device (:mod:`.compute`).

After the supervised warm-up, :func:`discover` takes each cell's embedding and cosine to the seen
heads and finds the candidates:

* :mod:`.ood`: unlabelled cells whose best cosine to a seen head is below the ``ood_quantile``
  of the labelled cells' (:func:`ood_clusters`), clustered with Leiden at the resolution that
  matches the granularity of the labelled types (:mod:`.graph`); in batches without labelled
  cells (a separate query), clusters of the whole batch voted by their share of such cells
  (:func:`query_ood_clusters`);
* :mod:`.labels`: in batches labelled at random, cells with improbably few labelled neighbours
  join the candidates (:func:`label_deserts`) and cells among labelled ones leave them
  (:func:`labelled_support`).

The candidates start the novel heads (:mod:`.heads`), whose anchors keep only coherent clusters;
their number is the estimate of ``n_novel``. After training, :mod:`.naming` reports novel clusters
that are a known type of another batch as that type and gives one name to a novel type found in
several queries. Without a warm-up, :mod:`.no_warmup` counts Leiden clusters of all cells that
lack labels. :mod:`.self_check` hides known types to see how the rules do; :mod:`.scale`
repeats discovery on a sample of large data and says where the call depends on the number of
cells.

Leiden runs directly on igraph (exact kNN graph from scikit-learn, or from torch on a GPU run),
on at most ``DiscoveryRules.max_cells`` cells.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .._ablation import DiscoveryRules
from ._stage import Discovery, _diagnostics, _notes, _once_per_cell_set
from .graph import (
    PearsonResiduals,
    calibrate_resolution,
    knn_graph,
    leiden,
    pca_embedding,
    resolve_resolution,
    subsample_rows,
)
from .heads import _novel_heads, cluster_cores, significant_cells
from .labels import (
    _label_evidence,
    label_deserts,
    labelled_neighbours,
    labelled_support,
    query_batch_cells,
    segregated_batches,
)
from .naming import match_known_types, match_novel_across_batches, name_heads
from .no_warmup import discover_without_warmup, estimate_n_novel, novel_clusters
from .ood import (
    calibration_split,
    cells_for_quantile,
    ood_clusters,
    ood_threshold,
    shift_notes,
    type_thresholds,
)
from .query import (
    ContrastBar,
    _query_candidates,
    _rank_by_size,
    query_ood_clusters,
    query_pvalues,
    reference_gaps,
    spread_notes,
    type_spread,
)
from .scale import size_check
from .self_check import SelfCheckSplit, self_check_report, self_check_split, youden_threshold

_DEFAULTS = DiscoveryRules()


@dataclass(frozen=True)
class DiscoveryInput:
    """What discovery reads of the cells it runs on (rows of the run's training matrix).

    ``embedding`` ``(n, D)``: the warmed-up embedding; ``seen_similarity`` ``(n, n_seen)``: the
    cosine to each seen head; ``labels`` (``-1`` unlabelled); ``domain``: batch codes;
    ``pca_of(idx)``: the PCA of the aligned expression of the cells ``idx``; ``calibration``:
    labelled cells the warm-up did not train on (:func:`calibration_split`), which cap the
    threshold (:func:`ood_threshold`); ``held_out_similarity`` ``(n,)``: each labelled cell's best
    seen-head cosine in a cross-fitted warm-up that did not train on it (NaN elsewhere), which
    caps it too; ``domain_names``: the batches' names, for the record.
    """

    embedding: np.ndarray
    seen_similarity: np.ndarray
    labels: np.ndarray
    domain: np.ndarray
    pca_of: Callable[[np.ndarray], np.ndarray]
    calibration: np.ndarray | None = None
    domain_names: list[str] | None = None
    held_out_similarity: np.ndarray | None = None
    class_names: list[str] | None = None


def discover(
    cells: DiscoveryInput,
    cfg: DiscoveryRules = _DEFAULTS,
    *,
    n_novel: int | str = "auto",
    seed: int = 0,
) -> Discovery:
    """Candidate novel clusters after the warm-up, and the novel heads they start: clusters of
    unlabelled cells the seen heads do not explain (:func:`ood_clusters`; in batches without
    labelled cells :func:`query_ood_clusters`); with ``n_novel="auto"`` one head per candidate.
    """
    embedding, seen_similarity, labels = cells.embedding, cells.seen_similarity, cells.labels
    domain, pca_of, domain_names = cells.domain, cells.pca_of, cells.domain_names
    calibration = cells.calibration
    pca_cells = _once_per_cell_set(pca_of)
    lab, maxcos = labels >= 0, seen_similarity.max(axis=1)
    predicted = seen_similarity.argmax(axis=1)  # the seen head that scores each cell best
    ev = _label_evidence(lab, domain, pca_cells, cfg, domain_names)
    # batches without any labelled cell (a separate query): candidates are voted per cluster
    query = query_batch_cells(labels, domain)
    # candidates are cut at the granularity of the labelled types (only where labelled and
    # unlabelled cells share a batch: query batches are voted at cfg.query_resolution)
    resolution, scores = resolve_resolution(
        labels, pca_cells, seed=seed, calibrate=bool((~lab & ~query).any()), cfg=cfg
    )
    calib = np.zeros_like(lab) if calibration is None else calibration & lab
    held_out = cells.held_out_similarity
    if held_out is not None:
        held_out = np.where(lab, held_out, np.nan)
    per_type = cfg.cross_fit_threshold == "per_type" and held_out is not None
    tau, tau_info = ood_threshold(maxcos, lab & ~calib, calib, cfg, None if per_type else held_out)
    cell_tau, shift_said, pvalues, votes = None, [], None, []
    if per_type:
        cell_tau, record = type_thresholds(
            maxcos, predicted, labels, held_out, query, domain, tau,
            cfg.novelty_alpha,
        )  # fmt: skip
        shifts = {domain_names[d]: v for d, v in record["query_shift"].items()}
        kept = {domain_names[d]: v for d, v in record["shift_kept"].items()}
        tau_info = {**tau_info, "n_cross_fitted": int(np.isfinite(held_out).sum()),
                    "type_thresholds": record["type_thresholds"], "query_shift": shifts,
                    "shift_kept": kept}  # fmt: skip
        shift_said = shift_notes(record, domain_names, cells.class_names,
                                 cells_for_quantile(cfg.novelty_alpha))  # fmt: skip
        if query.any():  # the query vote's conformal p-values
            pvalues = query_pvalues(
                maxcos, predicted, labels, held_out, domain, np.flatnonzero(query),
                record["query_shift"], cells_for_quantile(cfg.novelty_alpha),
            )  # fmt: skip
    assign, sizes, tau = ood_clusters(
        maxcos, lab, pca_cells, threshold=tau, quantile=cfg.ood_quantile,
        resolution=resolution, seed=seed, exclude=ev.supported | query,
        include=ev.desert, n_neighbors=cfg.n_neighbors, cell_threshold=cell_tau,
    )  # fmt: skip
    # the same cells below their threshold as in ood_clusters, before its include/exclude
    ood = maxcos < (tau if cell_tau is None else cell_tau)
    # the contrast vote where there are p-values; the share vote alone without them
    claimed = predicted if pvalues is not None else None
    bar = None
    if claimed is not None:  # how far below its type a piece of a labelled type sits
        spread = type_spread(held_out, labels, seen_similarity.shape[1])
        bar = ContrastBar(maxcos, spread, reference_gaps(
            held_out, labels, domain, np.flatnonzero(lab & np.isfinite(held_out)), pca_cells,
            spread, resolution=cfg.query_resolution, seed=seed, n_neighbors=cfg.n_neighbors,
            min_cells=cells_for_quantile(cfg.novelty_alpha), max_cells=cfg.query_vote_cells,
        ))  # fmt: skip
    groups = _query_candidates(ood, query, domain, pca_cells, cfg, seed, pvalues, votes, claimed,
                               bar)  # fmt: skip
    if query.any():
        names = domain_names or [str(d) for d in range(int(domain.max()) + 1)]
        shift_said = shift_said + spread_notes(votes, names, cells.class_names)
        tau_info = {**tau_info, "query_votes": {
            "batch": [names[v["batch"]] for v in votes], "cells": [v["cells"] for v in votes],
            "voters": [v["voters"] for v in votes],
            "mean_p": [np.nan if v["mean_p"] is None else v["mean_p"] for v in votes],
            "share": [v["share"] for v in votes],
            "share_test_p": [np.nan if v["share_test_p"] is None else v["share_test_p"]
                             for v in votes],
            "candidate": [v["candidate"] for v in votes],
        }}  # fmt: skip
        if claimed is not None:
            tau_info["query_votes"]["contrast_auc"] = [
                np.nan if v["contrast_auc"] is None else v["contrast_auc"] for v in votes
            ]
            tau_info["query_votes"]["gap"] = [
                np.nan if v["gap"] is None else v["gap"] for v in votes
            ]
            tau_info["contrast_bar"] = {
                "labelled_pieces": int(bar.gaps.size),
                "max_gap": float(bar.gaps[-1]) if bar.gaps.size else None,
            }
    assign, sizes = _rank_by_size(assign, sizes, groups)
    k = len(sizes) if n_novel == "auto" else int(n_novel)
    significant = None
    if pvalues is not None:
        significant = significant_cells(pvalues, query, cfg.novelty_alpha)
    heads = _novel_heads(embedding, seen_similarity, labels, assign, (k, len(sizes)), pca_cells,
                         cfg, seed, significant)  # fmt: skip
    if significant is not None:
        tau_info = {**tau_info, "n_anchored_significant": heads.n_significant}
    n_seen = seen_similarity.shape[1]
    anchor_cells, anchor_heads = np.flatnonzero(heads.core), n_seen + assign[heads.core]
    # cells the labels around them say are known stay on the seen head that claims them
    held = np.flatnonzero(ev.anchored & ~heads.core & cfg.anchor_supported)
    tau_info = {**tau_info, "n_held_on_seen_heads": int(held.size)}
    if held.size:
        anchor_cells = np.concatenate([anchor_cells, held])
        anchor_heads = np.concatenate([anchor_heads, predicted[held]])
    return Discovery(
        assign=assign, sizes=tuple(sizes), n_novel=len(sizes), prototypes=heads.prototypes,
        prior=heads.prior, anchor_cells=anchor_cells, anchor_heads=anchor_heads, threshold=tau,
        diagnostics=_diagnostics(sizes, ev, domain_names, (resolution, scores), heads, groups,
                                 bool(query.any()), tau_info, calib,
                                 cfg, contrast=pvalues is not None),
        notes=tuple(_notes(labels, n_seen, int(calib.sum()), cfg) + shift_said),
    )  # fmt: skip


__all__ = [
    "Discovery",
    "DiscoveryInput",
    "PearsonResiduals",
    "SelfCheckSplit",
    "calibrate_resolution",
    "calibration_split",
    "cluster_cores",
    "discover",
    "discover_without_warmup",
    "estimate_n_novel",
    "knn_graph",
    "label_deserts",
    "labelled_neighbours",
    "labelled_support",
    "leiden",
    "match_known_types",
    "match_novel_across_batches",
    "name_heads",
    "novel_clusters",
    "ood_clusters",
    "ood_threshold",
    "pca_embedding",
    "query_batch_cells",
    "query_ood_clusters",
    "query_pvalues",
    "resolve_resolution",
    "segregated_batches",
    "self_check_report",
    "self_check_split",
    "shift_notes",
    "spread_notes",
    "size_check",
    "subsample_rows",
    "type_thresholds",
    "youden_threshold",
]
