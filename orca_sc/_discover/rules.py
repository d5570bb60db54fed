"""Discovery as an ordered list of rules (:data:`RULES`): what each reads, what it decides, and
the entry it leaves in the run's record (``uns['orca']['estimate']``).

The rules share one :class:`DiscoveryState`: what the warm-up gave (each cell's embedding, its
cosine to the seen heads, the labels, batches and the PCA) and what the rules before decided.
Each rule is a small object with one job: ``run`` decides (a mask, a threshold, a set of
candidates) and writes it into the state, ``record`` returns its entries of the record, ``describe`` its
clause of ``estimate['method']`` (``""``: none). :func:`orca_sc._discover.discover` runs the
list in order; the record and the method's prose are built from the same list.

Rules that decide a novel call at other stages of a run are listed too, with where they run
(:data:`OTHER_STAGES`): the choice of what discovery's PCA reads (before the warm-up), and after
training the pruning of small heads, the merge into known types and the evidence verdicts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._ablation import DiscoveryRules
from .graph import reference_resolution, resolve_resolution
from .heads import _novel_heads, significant_cells
from .labels import _label_evidence, no_label_evidence, query_batch_cells
from .ood import cells_for_quantile, ood_clusters, ood_threshold, shift_notes, type_thresholds
from .query import (
    QUERY_LEVEL,
    QUERY_MEAN_P,
    _query_candidates,
    _rank_by_size,
    query_pvalues,
    spread_notes,
)


@dataclass
class DiscoveryState:
    """What the rules read and decide, over the cells discovery runs on.

    Read (set once): ``embedding``, ``seen_similarity``, ``labels``, ``domain``, ``pca_cells``
    (the PCA of a set of cells, computed once per set), ``calibration`` (labelled cells held out
    of the warm-up), ``held_out`` (each labelled cell's cross-fitted best cosine, NaN elsewhere;
    ``None`` without the folds), ``domain_names``, ``class_names``, the rules' parameters
    ``cfg``, ``n_novel`` and ``seed``. Derived: ``lab`` (labelled), ``maxcos`` (best seen-head
    cosine), ``predicted`` (that head), ``query`` (cells of batches without labelled cells).
    Decided by the rules: the fields below ``query``.
    """

    embedding: np.ndarray
    seen_similarity: np.ndarray
    labels: np.ndarray
    domain: np.ndarray
    pca_cells: Callable[[np.ndarray], np.ndarray]
    calibration: np.ndarray
    held_out: np.ndarray | None
    domain_names: list[str] | None
    class_names: list[str] | None
    cfg: DiscoveryRules
    n_novel: int | str
    seed: int
    lab: np.ndarray = field(init=False)
    maxcos: np.ndarray = field(init=False)
    predicted: np.ndarray = field(init=False)
    query: np.ndarray = field(init=False)
    # decided by the rules, in order
    label: Any = None  # LabelEvidence: supported, desert, anchored cells
    resolution: float = 0.5
    resolution_scores: list = field(default_factory=list)
    threshold: float = 0.0  # the in-sample (or capped) threshold
    cell_threshold: np.ndarray | None = None  # per cell, with per-type thresholds
    threshold_record: dict = field(default_factory=dict)
    shift: dict | None = None  # type_thresholds' record (query shifts)
    pvalues: np.ndarray | None = None  # query cells' conformal p-values
    assign: np.ndarray | None = None  # candidate of each cell (-1: none)
    sizes: list = field(default_factory=list)
    votes: list = field(default_factory=list)  # one entry per query cluster voted on
    #: each query batch's resolution and its record (``query_resolution="reference"``)
    query_resolutions: dict = field(default_factory=dict)
    groups: list = field(default_factory=list)  # query candidates (cell indices)
    heads: Any = None  # prototypes, prior, core cells
    anchor_cells: np.ndarray | None = None
    anchor_heads: np.ndarray | None = None
    n_held: int = 0
    notes: list = field(default_factory=list)  # where the data cannot support a call

    def __post_init__(self) -> None:
        self.lab = self.labels >= 0
        self.maxcos = self.seen_similarity.max(axis=1)
        self.predicted = self.seen_similarity.argmax(axis=1)  # the seen head scoring it best
        self.query = query_batch_cells(self.labels, self.domain)
        if self.held_out is not None:
            self.held_out = np.where(self.lab, self.held_out, np.nan)

    @property
    def per_type(self) -> bool:
        """Thresholds per known type (``cross_fit_threshold="per_type"`` and the folds ran)."""
        return self.cfg.cross_fit_threshold == "per_type" and self.held_out is not None

    @property
    def contrast(self) -> bool:
        """The query vote is the contrast vote (the query cells have p-values)."""
        return self.pvalues is not None

    @property
    def batch_names(self) -> list[str]:
        """Every batch's name (its code where the names are not given)."""
        return self.domain_names or [str(d) for d in range(int(self.domain.max()) + 1)]


class Rule:
    """One rule of discovery: ``run`` decides, ``record`` and ``describe`` say what."""

    name = ""

    def run(self, e: DiscoveryState) -> None:
        raise NotImplementedError

    def record(self, e: DiscoveryState) -> dict[str, Any]:
        return {}

    def describe(self, e: DiscoveryState) -> str:
        return ""


class LabelSupport(Rule):
    """In batches labelled at random, an unlabelled cell among labelled cells of its batch is of
    a known type (never a candidate, and held on the seen head that claims it); one with
    improbably few labelled neighbours (a binomial test at the batch's labelled fraction) is a
    label desert (always a candidate). Where labels are sparse the tests read as many neighbours
    as they need; a batch whose unlabelled cells are almost never supported was not labelled at
    random and takes neither.
    """

    name = "label support and deserts"

    def run(self, e: DiscoveryState) -> None:
        if "label_support" in e.cfg.drop:
            e.label = no_label_evidence(e.lab.size)
            return
        e.label = _label_evidence(e.lab, e.domain, e.pca_cells, e.cfg, e.domain_names)

    def record(self, e: DiscoveryState) -> dict[str, Any]:
        ev = e.label
        return {
            "n_supported_by_labels": int(ev.supported.sum()),
            "n_label_deserts": int(ev.desert.sum()),
            "label_neighbours": {e.batch_names[d]: k for d, k in ev.neighbours.items()},
            "segregated_batches": [e.batch_names[d] for d in ev.segregated],
        }


class Resolution(Rule):
    """The Leiden resolution of the candidate clusters: the one at which clusters of the
    labelled cells best match their labels (``resolution="auto"``), calibrated only where
    labelled and unlabelled cells share a batch (query batches are voted at their own
    resolution).
    """

    name = "resolution"

    def run(self, e: DiscoveryState) -> None:
        calibrate = bool((~e.lab & ~e.query).any()) and "resolution" not in e.cfg.drop
        e.resolution, e.resolution_scores = resolve_resolution(
            e.labels, e.pca_cells, seed=e.seed, calibrate=calibrate, cfg=e.cfg
        )

    def record(self, e: DiscoveryState) -> dict[str, Any]:
        grid = map(str, e.cfg.resolution_grid)
        return {
            "resolution": e.resolution,
            "resolution_ari": dict(zip(grid, e.resolution_scores, strict=False)),
        }


class Threshold(Rule):
    """The out-of-distribution threshold of the best seen-head cosine: the ``ood_quantile`` of
    the labelled cells the warm-up trained on (capped by held-out calibration cells); with the
    cross-fitted cosines (``cross_fit_threshold="per_type"``), per cell the ``novelty_alpha``
    quantile of the type whose head scores it best, lowered in a query batch by the batch's
    shift of that type (said in the notes where large).
    """

    name = "threshold"

    def run(self, e: DiscoveryState) -> None:
        calib = e.calibration & e.lab
        cap = None if e.per_type else e.held_out
        e.threshold, e.threshold_record = ood_threshold(e.maxcos, e.lab & ~calib, calib, e.cfg, cap)
        if not e.per_type:
            return
        e.cell_threshold, e.shift = type_thresholds(
            e.maxcos, e.predicted, e.labels, e.held_out, e.query, e.domain, e.threshold,
            e.cfg.novelty_alpha, shift_query="query_shift" not in e.cfg.drop,
        )  # fmt: skip
        e.notes += shift_notes(
            e.shift, e.domain_names, e.class_names, cells_for_quantile(e.cfg.novelty_alpha)
        )

    def record(self, e: DiscoveryState) -> dict[str, Any]:
        out = dict(e.threshold_record)
        if e.per_type:
            names = e.domain_names
            out |= {
                "n_cross_fitted": int(np.isfinite(e.held_out).sum()),
                "type_thresholds": e.shift["type_thresholds"],
                "query_shift": {names[d]: v for d, v in e.shift["query_shift"].items()},
                "shift_kept": {names[d]: v for d, v in e.shift["shift_kept"].items()},
            }
        return out


class QueryPValues(Rule):
    """Each cell of a batch without labelled cells gets a conformal p-value of novelty: its best
    cosine, shifted by its batch, ranked among the cross-fitted cosines of the labelled cells of
    the type that claims it (only with per-type thresholds; the contrast vote reads them).
    """

    name = "query p-values"

    def run(self, e: DiscoveryState) -> None:
        if e.per_type and e.query.any():
            e.pvalues = query_pvalues(
                e.maxcos, e.predicted, e.labels, e.held_out, e.domain, np.flatnonzero(e.query),
                e.shift["query_shift"], cells_for_quantile(e.cfg.novelty_alpha),
            )  # fmt: skip


class Candidates(Rule):
    """Where labelled and unlabelled cells share a batch: Leiden clusters (at the resolution
    above) of the unlabelled cells below their threshold and of the label deserts, less the
    cells the labels support and the cells of query batches.
    """

    name = "candidate clusters"

    def run(self, e: DiscoveryState) -> None:
        e.assign, e.sizes, e.threshold = ood_clusters(
            e.maxcos, e.lab, e.pca_cells, threshold=e.threshold, quantile=e.cfg.ood_quantile,
            resolution=e.resolution, seed=e.seed, exclude=e.label.supported | e.query,
            include=e.label.desert, n_neighbors=e.cfg.n_neighbors, cell_threshold=e.cell_threshold,
        )  # fmt: skip

    def describe(self, e: DiscoveryState) -> str:
        return (
            f"Leiden clusters (resolution {e.resolution:g}) of cells below the "
            f"{e.cfg.ood_quantile:.0%} quantile of labelled max cosine or with improbably few "
            "labelled neighbours"
        )


def query_resolutions(e: DiscoveryState) -> dict[int, tuple[float, dict[str, float]]]:
    """Each query batch's resolution (``query_resolution="reference"``): the finest of
    ``query_resolution_grid`` at which a sample of the labelled cells of the batch's size (of
    the cells that vote: at most ``query_vote_cells``) keeps every labelled type whole
    (:func:`reference_resolution`; 1 where fewer than two types can be judged), with the share
    of types whole at each resolution.
    """
    cfg, rows = e.cfg, np.flatnonzero(e.lab)
    out = {}
    for d in np.unique(e.domain[e.query]):  # loop over batches
        n = int((e.domain[e.query] == d).sum())
        if cfg.query_vote_cells is not None:
            n = min(n, cfg.query_vote_cells)
        out[int(d)] = reference_resolution(
            e.labels, rows, n, e.pca_cells, cfg.query_resolution_grid, seed=e.seed + int(d),
            n_neighbors=cfg.n_neighbors, fallback=_DEFAULT_QUERY_RESOLUTION,
        )  # fmt: skip
    return out


#: where the labelled cells cannot check a query batch's resolution
_DEFAULT_QUERY_RESOLUTION = 1.0


class QueryVote(Rule):
    """In a batch without labelled cells, Leiden clusters of the whole batch vote
    (:func:`orca_sc._discover.query.query_ood_clusters`): a cluster is a candidate by the share
    vote (enough of its cells below their threshold, and, where they have p-values, scoring
    below the labelled cells as a whole) or by the contrast vote (its cells below the
    cross-fitted cosines of the type that claims them, and below that type's other cells in the
    batch). Without p-values, the share vote alone. With ``absence_vote`` (a study, not the
    default), a cluster of a type these votes give no candidate is also one where that type's
    labelled cells lack its state (the absence vote).
    """

    name = "query vote"

    def run(self, e: DiscoveryState) -> None:
        if not e.query.any():
            return
        cfg = e.cfg
        claimed = e.predicted if e.contrast or cfg.absence_vote else None
        ood = e.maxcos < (e.threshold if e.cell_threshold is None else e.cell_threshold)
        resolution = cfg.query_resolution
        if resolution == "reference":  # each query batch's, checked on the labelled cells
            e.query_resolutions = query_resolutions(e)
            resolution = {d: r for d, (r, _) in e.query_resolutions.items()}
        e.groups = _query_candidates(ood, e.query, e.domain, e.pca_cells, cfg, e.seed,
                                     e.pvalues, e.votes, claimed, resolution,
                                     e.labels)  # fmt: skip
        e.notes += spread_notes(e.votes, e.batch_names, e.class_names)

    def record(self, e: DiscoveryState) -> dict[str, Any]:
        if not e.query.any():
            return {}
        names = e.batch_names

        def column(key: str) -> list:
            return [np.nan if v[key] is None else v[key] for v in e.votes]

        votes = {
            "batch": [names[v["batch"]] for v in e.votes],
            "cells": [v["cells"] for v in e.votes],
            "voters": [v["voters"] for v in e.votes],
            "mean_p": column("mean_p"),
            "share": [v["share"] for v in e.votes],
            "share_test_p": column("share_test_p"),
            "candidate": [v["candidate"] for v in e.votes],
        }
        if e.cfg.absence_vote:
            votes["absence_p"] = column("absence_p")
        out: dict[str, Any] = {"query_votes": votes}
        if e.query_resolutions:
            out["query_resolution"] = {
                names[d]: {"resolution": r, "types_whole": whole}
                for d, (r, whole) in e.query_resolutions.items()
            }
        if e.contrast:
            votes["contrast_auc"] = column("contrast_auc")
        return out

    def describe(self, e: DiscoveryState) -> str:
        if not e.query.any():
            return ""
        cfg = e.cfg
        share = (
            f"at least {cfg.query_min_fraction:.0%} (or {cfg.query_min_enrichment:g}x the "
            "batch's share) of such cells"
        )
        if e.contrast:
            share += (
                ", or whose cells score below the cross-fitted cosines of the known types that "
                f"claim them (mean conformal p <= {QUERY_MEAN_P:g}, below 1/2 at level "
                f"{QUERY_LEVEL:g})"
                " and below that type's cells in the batch's clusters this leaves "
                f"(Mann-Whitney at level {QUERY_LEVEL:g}, P(above) <= {QUERY_MEAN_P:g})"
            )
        if cfg.absence_vote:
            share += (
                ", or, of a known type these give no candidate, whose state that type's "
                "labelled cells lack (binomial test at level "
                f"{cfg.novelty_alpha:g} over the clusters it reads, estimate['query_votes'])"
            )
        if cfg.query_resolution == "reference":
            res = (
                "the finest at which a sample of the labelled cells of the batch's size keeps "
                "every labelled type whole, estimate['query_resolution']"
            )
        else:
            res = f"{cfg.query_resolution:g}"
        return (
            f"; in batches without labels, Leiden clusters (resolution {res}) of the batch "
            f"with {share}"
        )


class NumberOfTypes(Rule):
    """The candidates, largest first, are the novel types: their number is the estimate of
    ``n_novel`` (``"auto"``: one novel head each).
    """

    name = "number of novel types"

    def run(self, e: DiscoveryState) -> None:
        e.assign, e.sizes = _rank_by_size(e.assign, e.sizes, e.groups)


class Anchors(Rule):
    """The novel heads start at their candidates' mean embeddings, with the regulariser's prior
    the estimated composition of the cells. For the anchor epochs the core cells of each
    coherent candidate are pulled to its head, and so are a query candidate's cells whose
    p-value is significant at false discovery rate ``novelty_alpha`` (a small query's
    candidates have no core); the cells the labels support stay on the seen head that claims
    them.
    """

    name = "anchors"

    def run(self, e: DiscoveryState) -> None:
        sizes = e.sizes
        k = len(sizes) if e.n_novel == "auto" else int(e.n_novel)
        significant = None
        if e.pvalues is not None and "significant_anchors" not in e.cfg.drop:
            significant = significant_cells(e.pvalues, e.query, e.cfg.novelty_alpha)
        e.heads = _novel_heads(e.embedding, e.seen_similarity, e.labels, e.assign,
                               (k, len(sizes)), e.pca_cells, e.cfg, e.seed, significant)  # fmt: skip
        n_seen = e.seen_similarity.shape[1]
        core = e.heads.core
        cells, heads = np.flatnonzero(core), n_seen + e.assign[core]
        held = np.flatnonzero(e.label.anchored & ~core & e.cfg.anchor_supported)
        e.n_held = int(held.size)
        if held.size:
            cells = np.concatenate([cells, held])
            heads = np.concatenate([heads, e.predicted[held]])
        e.anchor_cells, e.anchor_heads = cells, heads

    def record(self, e: DiscoveryState) -> dict[str, Any]:
        out: dict[str, Any] = {"n_anchored": int(e.heads.core.sum())}
        if e.pvalues is not None:
            out["n_anchored_significant"] = e.heads.n_significant
        return out | {"n_held_on_seen_heads": e.n_held}


#: the rules of the discover stage, in the order :func:`orca_sc._discover.discover` runs them
RULES: tuple[Rule, ...] = (
    LabelSupport(),
    Resolution(),
    Threshold(),
    QueryPValues(),
    Candidates(),
    QueryVote(),
    NumberOfTypes(),
    Anchors(),
)


@dataclass(frozen=True)
class OtherStage:
    """A rule that decides a novel call outside the discover stage, and where it runs."""

    name: str
    stage: str
    where: str
    doc: str


#: the rules that decide a novel call at other stages of a run
OTHER_STAGES: tuple[OtherStage, ...] = (
    OtherStage(
        "PCA input",
        "before the warm-up",
        "orca_sc._discover.graph.pca_input_verdict",
        "Pearson residuals where the labelled cells' nearest labelled neighbours name their type "
        "right more often in them than in the log values (one-sided exact McNemar test).",
    ),
    OtherStage(
        "pruning",
        "after training",
        "orca_sc._discover.naming.too_few_cells",
        "A novel head that wins fewer than min_novel_cells unlabelled cells is no cluster.",
    ),
    OtherStage(
        "merge into known types",
        "after training",
        "orca_sc._discover.naming.match_known_types",
        "A novel cluster whose marker signature correlates with a known type of another batch "
        "takes its name; one novel type found in several batches gets one name.",
    ),
    OtherStage(
        "evidence verdicts",
        "after training",
        "orca_sc._discover.evidence.novel_evidence",
        "Per novel cluster: supported, cannot tell (and why), not confirmed or not tested.",
    ),
)


def run_rules(e: DiscoveryState, rules: tuple[Rule, ...] = RULES) -> dict[str, Any]:
    """Run ``rules`` in order on ``e``; returns their record entries (in order) with the
    method's prose (``method``) and the rules' names (``rules``).
    """
    for rule in rules:
        rule.run(e)
    record: dict[str, Any] = {}
    for rule in rules:
        record |= rule.record(e)
    record["method"] = "".join(rule.describe(e) for rule in rules)
    return record
