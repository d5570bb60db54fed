"""The ``discover`` stage: candidate novel clusters, the number of novel types, and which novel
clusters are known types after all. Every rule that decides these lives in this package, one
module per test, and every parameter is a field of :class:`orca_sc._ablation.DiscoveryRules`
(the user's :class:`orca_sc.DiscoveryConfig` and the rules' constants). Arrays in, a
frozen :class:`Discovery` out: no AnnData, and torch only where a GPU run computes its PCAs and
neighbours on the device (:mod:`.compute`).

After the supervised warm-up, :func:`discover` runs the rules of :data:`RULES`
(:mod:`.rules`), in order, on each cell's embedding and cosine to the seen heads: label support
and deserts (:mod:`.labels`), the resolution (:mod:`.graph`), the out-of-distribution threshold
and the candidate clusters (:mod:`.ood`), the query vote in batches without labelled cells
(:mod:`.query`), the number of novel types and the anchors (:mod:`.heads`).

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
from ._stage import Discovery, _notes, _once_per_cell_set
from .graph import (
    PearsonResiduals,
    calibrate_resolution,
    knn_graph,
    leiden,
    pca_embedding,
    resolve_resolution,
    subsample_rows,
)
from .heads import cluster_cores
from .labels import (
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
    ood_clusters,
    ood_threshold,
    shift_notes,
    type_thresholds,
)
from .query import (
    query_ood_clusters,
    query_pvalues,
    spread_notes,
)
from .rules import OTHER_STAGES, RULES, DiscoveryState, run_rules
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
    """Candidate novel clusters after the warm-up, and the novel heads they start: the rules of
    :data:`~orca_sc._discover.rules.RULES`, in order, on ``cells``; with ``n_novel="auto"`` one
    head per candidate. The record (``uns['orca']['estimate']``) and the method's prose are the
    rules' own.
    """
    lab = cells.labels >= 0
    calibration = np.zeros_like(lab) if cells.calibration is None else cells.calibration & lab
    e = DiscoveryState(
        cells.embedding, cells.seen_similarity, cells.labels, cells.domain,
        _once_per_cell_set(cells.pca_of), calibration, cells.held_out_similarity,
        cells.domain_names, cells.class_names, cfg, n_novel, seed,
    )  # fmt: skip
    record = run_rules(e)
    sizes = e.sizes
    n_seen = cells.seen_similarity.shape[1]
    diagnostics = {
        "n_novel": len(sizes),
        "cluster_sizes": list(sizes),
        "n_query_clusters": len(e.groups),
        **record,
        "n_calibration": int(calibration.sum()),
    }
    return Discovery(
        assign=e.assign, sizes=tuple(sizes), n_novel=len(sizes), prototypes=e.heads.prototypes,
        prior=e.heads.prior, anchor_cells=e.anchor_cells, anchor_heads=e.anchor_heads,
        threshold=e.threshold, diagnostics=diagnostics,
        notes=tuple(_notes(cells.labels, n_seen, int(calibration.sum()), cfg) + e.notes),
    )  # fmt: skip


__all__ = [
    "OTHER_STAGES",
    "RULES",
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
