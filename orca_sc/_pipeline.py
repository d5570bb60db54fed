"""ORCA as stages over one run context: prepare -> align -> warm-up -> discover -> open-world fit
-> infer. :func:`fit` returns arrays and weights (:class:`Fit`); :mod:`orca_sc._model` turns them
into a model and an annotation (naming, novelty). Each stage is a short function of the
:class:`RunContext` that returns a typed result; the arrays they work on come from data
preparation (:mod:`orca_sc._data`, the only layer that reads AnnData), alignment
(:mod:`orca_sc._align`), training (:mod:`orca_sc._train`) and discovery
(:mod:`orca_sc._discover`).
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from ._ablation import LAB, Ablation, DiscoveryRules
from ._align import class_centroids
from ._calibration import FoldPredictions
from ._cells import CellMatrix, infer
from ._config import OrcaConfig
from ._context import (
    RunContext,
    Transform,
    discovery_sample,
    run_context,
    sample_context,
    seen_similarity,
)
from ._crossfit import (
    FoldNets,
    cross_fit,
    fold_warmups,
)
from ._data import PreparedData
from ._discover import (
    Discovery,
    DiscoveryInput,
    calibration_split,
    discover,
    discover_without_warmup,
    query_batch_cells,
    self_check_report,
    self_check_split,
    size_check,
    subsample_rows,
)
from ._discover.compute import neighbours_once, on_device
from ._engine import publish, stage
from ._mapping import fit_query_offsets
from ._pretrain import batch_partners, pretrain_backbone, vouched_labels
from ._train import NovelHeads, Schedule, TrainRandom, fit_open_world, fit_warmup
from .module import OrcaNet

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- stages
@dataclass(frozen=True)
class WarmUp:
    """The supervised warm-up: the net, its history and the labelled cells held out of it to
    calibrate the out-of-distribution threshold.
    """

    net: OrcaNet
    history: list[dict]
    held: np.ndarray


@dataclass(frozen=True)
class Candidates:
    """The discover stage's result over the cells ``rows`` it ran on (indices into the training
    matrix), with their best cosine to a seen head (``None`` without a warm-up).
    """

    found: Discovery
    rows: np.ndarray
    max_cosine: np.ndarray | None


@dataclass(frozen=True)
class OpenWorldFit:
    """The open-world phase: the final net (seen + novel heads) and its history."""

    net: OrcaNet
    history: list[dict]


@dataclass(frozen=True)
class Timings:
    """Seconds of each stage (the self-check counts as warm-up)."""

    warmup: float
    discovery: float
    open_world: float
    novelty: float

    @property
    def training(self) -> float:
        return self.warmup + self.open_world


@dataclass(frozen=True)
class Fit:
    """What :func:`fit` returns: the trained net and, for every cell of the run, its head
    probabilities ``(n, K)`` and L2-normalised embedding ``(n, D)``; plus what naming and the
    run's record need.
    """

    data: PreparedData
    transform: Transform
    config: OrcaConfig
    plan: Schedule
    net: OrcaNet
    history: list[dict]
    found: Discovery
    self_check: dict[str, Any] | None
    centroids: np.ndarray  # (n_seen, G) reference class means of the anchor batch
    probs: np.ndarray
    embedding: np.ndarray
    timings: Timings
    training: dict[str, Any]  # device, layout, density, processes
    novelty_pvalues: np.ndarray | None  # (n,) NaN for labelled cells; None: not computed
    fold_predictions: FoldPredictions | None  # the cross-fitted warm-ups' predictions, or None
    lab: Ablation = LAB

    @property
    def rules(self) -> DiscoveryRules:
        """What discovery's rules read (the user's options and the rules' constants)."""
        return DiscoveryRules.of(self.config.discovery, self.lab)


def fit(
    adata: Any, reference: Any | None, labels_key: str, cfg: OrcaConfig, lab: Ablation = LAB
) -> Fit:
    """Train ORCA on ``adata`` (+ ``reference``) and infer every cell.

    Under ``torchrun`` (or in a process group the caller initialised) the ranks train one model
    together (:mod:`orca_sc._dist`); every rank returns the same result.
    """
    run = run_context(adata, reference, labels_key, cfg, lab)
    # on a GPU, discovery's PCAs and neighbour searches too; each search of a set of points once
    with on_device(run.cells.device), neighbours_once():
        return _fit(run)


def _fit(run: RunContext) -> Fit:
    """:func:`fit`'s stages on the prepared, aligned data."""
    t0 = time.perf_counter()
    # the warm-ups and discovery on at most discovery_cells cells: their calls are those of data
    # of that size (docs/discovery.md, "Discovery at a fixed size")
    sample = discovery_sample(run)
    drun = run if sample is None else sample_context(run, sample)
    if run.lab.pretrain != "none" and run.plan.warmup > 0:
        with stage("pretraining"):
            run._pretrained.append(pretrain(drun))
    with stage("warm-up"):
        warm = warm_up(drun)
    with stage("self-check"):
        check = self_check(drun) if run.config.discovery.self_check else None
    t1 = time.perf_counter()
    dc = run.rules
    side = None
    if dc.novelty_folds and run.plan.warmup > 0:
        with stage("cross-fitted warm-ups"):
            side = fold_warmups(drun, dc.novelty_folds, held_out=dc.cross_fit_threshold != "none")
    if run.lab.query_mapping == "frozen":
        with stage("query mapping"):
            nets = [warm.net] + ([] if side is None else [n for n in side.nets if n is not None])
            run, drun = mapped_queries(run, drun, nets)
    t_side = time.perf_counter() - t1
    held_out = None if side is None else side.held_out_similarity
    with stage("discovery"):
        cand = find_candidates(
            drun,
            warm.net,
            warm.held,
            warmed_up=run.plan.warmup > 0,
            held_out=held_out,
            side=side,
        )
    with stage("size check"):
        cand = check_size(drun, warm.held, cand)
    if sample is not None:  # back to the rows of all the cells
        cand, side = on_all_cells(cand, side, sample, run.data.n_cells)
    publish("candidates", partial(_candidate_of_every_cell, cand, run.data.n_cells))
    t2 = time.perf_counter()
    with stage("open-world fit"):
        ow = open_world(run, warm, cand)
    t3 = time.perf_counter()
    found = cand.found
    logger.info("Novel heads: %d (estimated novel types: %d).", found.n_heads, found.n_novel)
    with stage("inference"):
        probs, embedding = infer(ow.net, run.cells, comm=run.comm)
    t4 = time.perf_counter()
    pvalues, fold_pred = None, None
    if side is not None:
        with stage("novelty test (cross-fit)"):
            pvalues, fold_pred = cross_fit(run, side, probs[:, : run.n_seen].argmax(axis=1))
    t5 = time.perf_counter()
    cells = run.cells
    training = {"device": str(cells.device), "layout": cells.layout, "density": cells.density,
                "processes": run.comm.world}  # fmt: skip
    if run._pretrained:
        training["pretrain"] = run._pretrained[0][1]
    return Fit(
        run.data, run.transform, run.config, run.plan, ow.net, warm.history + ow.history, found,
        check, _anchor_centroids(run), probs, embedding,
        Timings(t1 - t0, t2 - t1 - t_side, t3 - t2, t5 - t4 + t_side), training, pvalues,
        fold_pred, run.lab,
    )  # fmt: skip


def mapped_queries(
    run: RunContext, drun: RunContext, nets: list[OrcaNet]
) -> tuple[RunContext, RunContext]:
    """The run's context and its discovery sample's (``drun``; the same where there is none)
    with each batch without labelled cells mapped onto the frozen ``nets``
    (:func:`orca_sc._mapping.fit_query_offsets`, fitted on ``drun``'s cells): their training
    matrices read the mapped offsets, their PCAs the centroid shift as before; the record is
    the alignment's ``query_mapping`` (per batch, by name).
    """
    t, d = drun.transform, drun.data
    if t.group is not None:
        msg = 'query_mapping="frozen" maps a batch with one offset: it needs type_alignment="none".'
        raise ValueError(msg)
    offset, record = run.comm.on_main(
        fit_query_offsets, nets, d.X, d.labels, d.domain, t.scale, t.offset,
        n_comps=run.rules.n_pcs, seed=run.config.seed,
    )  # fmt: skip

    names = d.domain_names
    record = {**record, "batches": {names[int(b)]: v for b, v in record["batches"].items()}}

    def mapped(ctx: RunContext) -> RunContext:
        tr = replace(ctx.transform, info={**ctx.transform.info, "query_mapping": record})
        cells = CellMatrix(ctx.data.X, tr.code(ctx.data.domain), tr.scale, offset,
                           ctx.cells.device)  # fmt: skip
        new = replace(ctx, transform=tr, cells=cells)
        new._pca_all.update(ctx._pca_all)  # the PCA reads the centroid shift, as before
        new._residuals.extend(ctx._residuals)
        return new

    new_run = mapped(run)
    return new_run, (new_run if drun is run else mapped(drun))


def on_all_cells(
    cand: Candidates, side: FoldNets | None, sample: np.ndarray, n_cells: int
) -> tuple[Candidates, FoldNets | None]:
    """Discovery's candidates and the cross-fitted warm-ups of a run on the cells ``sample``,
    with rows of all ``n_cells`` cells: the candidates' rows mapped back, every cell outside the
    sample in no fold (its nets did not train on it, nor was it held out of them); the record
    says how many cells discovery ran on.
    """
    record = {"cells": int(sample.size), "of": int(n_cells)}
    found = replace(cand.found, diagnostics={**cand.found.diagnostics, "sample": record})
    cand = Candidates(found, sample[cand.rows], cand.max_cosine)
    if side is not None:
        folds = np.full(n_cells, -1, dtype=np.int64)
        folds[sample] = side.folds
        side = FoldNets(folds, side.nets, None)
    return cand, side


def pretrain(run: RunContext) -> tuple[dict, dict]:
    """The backbone pretrained on the run's cells (``Ablation.pretrain``, a study; on the
    labelled cells alone with ``pretrain_cells="labelled"``, with partners across batches with
    ``pretrain_pairs="mnn"``, and only those a warm-up from random weights vouches for with
    ``"vouched"``, :func:`orca_sc._pretrain.vouched_labels`): its ``state_dict`` and record
    (:func:`orca_sc._pretrain.pretrain_backbone`).
    """
    lab, d = run.lab, run.data
    rows = None if lab.pretrain_cells == "all" else np.flatnonzero(d.labels >= 0)
    partners, vouch = None, None
    if lab.pretrain_pairs == "vouched":  # a warm-up from random weights says who is whose type
        cfg = run.config
        rand = TrainRandom(cfg.seed + 3, run.cells.device)
        net, _ = fit_warmup(run.cells, d.labels, run.n_seen, cfg, run.plan, rand, run.comm,
                            run.lab)  # fmt: skip
        _, similarity = seen_similarity(net, run.cells, np.arange(d.n_cells), run.comm)
        vouch = vouched_labels(similarity, d.labels)
    if lab.pretrain_pairs in ("mnn", "vouched"):
        partners = batch_partners(run.pca(run.rules.n_pcs), d.labels, d.domain, vouch=vouch)
    return pretrain_backbone(run.cells, run.config, lab, run.config.seed, rows, partners)


def warm_up(run: RunContext) -> WarmUp:
    """The supervised warm-up on the labelled cells, less those held out for calibration."""
    data, cfg, dc = run.data, run.config, run.rules
    held = calibration_split(
        data.labels, dc.calibration_fraction, dc.calibration_max_cells, cfg.seed
    )
    labels = np.where(held, -1, data.labels)
    net, history = fit_warmup(run.cells, labels, run.n_seen, cfg, run.plan, run.rand, run.comm,
                              run.lab, init=run.pretrained,
                              cluster_targets=run.warmup_cluster_targets)  # fmt: skip
    return WarmUp(net, history, held)


def find_candidates(
    run: RunContext,
    net: OrcaNet,
    calib: np.ndarray,
    *,
    warmed_up: bool = True,
    labels: np.ndarray | None = None,
    domain: np.ndarray | None = None,
    held_out: np.ndarray | None = None,
    side: FoldNets | None = None,
) -> Candidates:
    """The discover stage on (at most ``discovery.max_cells``) cells; ``labels`` and ``domain``
    replace the data's (the self-check hides some); ``held_out``: every cell's cross-fitted best
    seen-head cosine (:func:`fold_warmups`), which sets the thresholds. A decision: made on
    rank 0.
    """
    data, cfg, dc = run.data, run.config, run.rules
    labels = data.labels if labels is None else labels
    domain = data.domain if domain is None else domain
    rows = subsample_rows(data.n_cells, cfg.seed, dc.max_cells)
    pca_of, space = run.discovery_space(rows, domain[rows])

    if not warmed_up:
        found = run.comm.on_main(
            discover_without_warmup, labels[rows], pca_of, cfg.hidden_dims[1],
            n_novel=cfg.n_novel, cfg=dc, seed=cfg.seed,
        )  # fmt: skip
        return Candidates(found, rows, None)
    emb, similarity = seen_similarity(net, run.cells, rows, run.comm)
    cells = DiscoveryInput(
        emb, similarity, labels[rows], domain[rows], pca_of, calibration=calib[rows],
        domain_names=[*data.domain_names, "self-check"],
        held_out_similarity=None if held_out is None else held_out[rows], class_names=data.classes,
    )  # fmt: skip
    found = run.comm.on_main(_discover_in, cells, dc, cfg, space)
    return Candidates(found, rows, similarity.max(axis=1))


def check_size(run: RunContext, held: np.ndarray, cand: Candidates) -> Candidates:
    """``cand`` with :func:`orca_sc._discover.size_check`'s record (and note where they
    disagree): on data of more than twice its sample, the warm-up and discovery are run again
    on a random sample of the cells alone (:func:`sample_discovery`), as on data of that size.
    The run's own nets, random streams and labels are not touched.
    """
    if run.plan.warmup == 0:
        return cand
    found = run.comm.on_main(
        size_check, cand.found, run.data.n_cells, partial(sample_discovery, run, held),
        seed=run.config.seed + 5,
    )  # fmt: skip
    return Candidates(found, cand.rows, cand.max_cosine)


def sample_discovery(run: RunContext, held: np.ndarray, sample: np.ndarray) -> Discovery:
    """The warm-up and discovery of a run on the cells ``sample`` (rows of the training matrix)
    alone: their own schedule, random streams and PCA, the labels less the ``held`` cells (one
    process; no progress bar).
    """
    data, cfg = run.data, run.config.replace(progress=False)
    sub = sample_context(run, sample)  # its rows of the training matrix and its schedule
    cells = sub.cells
    labels = np.where(held, -1, data.labels)[sample]
    rand = TrainRandom(cfg.seed + 400, cells.device)
    net, _ = fit_warmup(cells, labels, run.n_seen, cfg, sub.plan, rand, lab=run.lab,
                        init=run.pretrained,
                        cluster_targets=sub.warmup_cluster_targets)  # fmt: skip
    emb, similarity = seen_similarity(net, cells, np.arange(sample.size))
    dc = run.rules
    pca_of, _ = sub.discovery_space(np.arange(sample.size), data.domain[sample])
    cells = DiscoveryInput(
        emb, similarity, labels, data.domain[sample], pca_of,
        calibration=held[sample], domain_names=[*data.domain_names, "self-check"],
    )  # fmt: skip
    return discover(cells, dc, n_novel=cfg.n_novel, seed=cfg.seed)


def _candidate_of_every_cell(cand: Candidates, n_cells: int) -> np.ndarray:
    """Discovery's candidate of every cell of the run (``-1``: none), for the observers."""
    out = np.full(n_cells, -1, dtype=np.int64)
    out[cand.rows] = cand.found.assign
    return out


def open_world(run: RunContext, warm: WarmUp, cand: Candidates) -> OpenWorldFit:
    """The full ORCA objective on all cells, from the warmed-up net with novel heads added at
    the candidates' prototypes (their core cells anchored for the first epochs).
    """
    found, rows = cand.found, cand.rows
    novel = NovelHeads(found.prototypes, found.prior, rows[found.anchor_cells], found.anchor_heads)
    pairs = run.comm.on_main(_pair_features, run)
    fixed_only = None  # a run without a query batch pairs as with "both": nothing to split
    if run.lab.pair_space == "query_pca":
        query = query_batch_cells(run.data.labels, run.data.domain)
        fixed_only = query if query.any() else None
    net, history = fit_open_world(
        warm.net, run.cells, run.data.labels, novel, run.config, run.plan, run.rand, pairs,
        run.comm, pair_fixed_only=fixed_only, lab=run.lab,
    )  # fmt: skip
    return OpenWorldFit(net, history)


def self_check(run: RunContext) -> dict[str, Any]:
    """The run-time self-check (``discovery.self_check``): a second warm-up without some known
    types and some known-type cells (:func:`orca_sc._discover.self_check_split`), the discover
    stage on it, and how the rules did (:func:`orca_sc._discover.self_check_report`).
    """
    data, cfg, dc = run.data, run.config, run.rules
    split = self_check_split(
        data.labels, data.domain, type_fraction=dc.self_check_types,
        known_fraction=dc.self_check_known, min_cells=dc.n_neighbors, seed=cfg.seed,
    )  # fmt: skip
    if split is None:
        msg = (
            f"no known type can be hidden: it needs three known types, one of them with at "
            f"least {dc.n_neighbors} labelled cells"
        )
        return {"skipped": msg, "notes": []}
    t0 = time.perf_counter()
    n_keep = int(split.labels.max()) + 1
    rand = TrainRandom(cfg.seed + 2, run.cells.device)
    net, _ = fit_warmup(run.cells, split.labels, n_keep, cfg, run.plan, rand, run.comm, run.lab,
                        init=run.pretrained)  # fmt: skip
    with warnings.catch_warnings():  # the probe's own notes are not the user's
        warnings.simplefilter("ignore")
        cand = find_candidates(
            run, net, np.zeros_like(split.novel), labels=split.labels, domain=split.domain
        )
    rows = cand.rows
    report = run.comm.on_main(
        self_check_report, cand.found.assign, cand.max_cosine, cand.found.threshold,
        data.labels[rows], split.subset(rows), data.classes, dc,
    )  # fmt: skip
    report["seconds"] = time.perf_counter() - t0
    return report


# ------------------------------------------------------------------------------------ helpers
def _discover_in(
    cells: DiscoveryInput, dc: Any, cfg: OrcaConfig, space: dict[str, Any]
) -> Discovery:
    """:func:`discover` on ``cells``, with the record of the space it was read in
    (``estimate['integration']``).
    """
    found = discover(cells, dc, n_novel=cfg.n_novel, seed=cfg.seed)
    return replace(found, diagnostics={**found.diagnostics, "integration": dict(space)})


def _pair_features(run: RunContext) -> np.ndarray | None:
    """The unlabelled cells' pairwise partners are chosen (also) in the PCA of the aligned
    expression (``pair_space``): the net's embedding, trained on the seen classes, does not yet
    separate novel types.
    """
    if run.lab.pair_space not in ("pca", "both", "query_pca"):
        return None
    return run.pca(run.lab.pair_pcs)


def _anchor_centroids(run: RunContext) -> np.ndarray:
    """Class means of the labelled cells of the anchor batch ``(n_seen, G)``, against which a
    saved model aligns new data (labels outside the batch masked instead of a copy of its rows).
    """
    data = run.data
    anchor = run.transform.info.get("anchor")
    anchor = anchor if anchor is not None else data.domain[data.labeled][0]
    labels = np.where(data.domain == anchor, data.labels, -1)
    return class_centroids(data.X, labels, run.n_seen)
