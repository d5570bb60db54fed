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
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np
import torch

from ._ablation import LAB, Ablation, DiscoveryRules
from ._align import class_centroids, compute_transform
from ._calibration import FoldPredictions
from ._config import OrcaConfig
from ._conformal import SCORE_NEIGHBORS, CrossConformal, fold_ids
from ._data import PreparedData, prepare
from ._discover import (
    Discovery,
    DiscoveryInput,
    PearsonResiduals,
    calibration_split,
    discover,
    discover_without_warmup,
    pca_embedding,
    query_batch_cells,
    self_check_report,
    self_check_split,
    size_check,
    subsample_rows,
)
from ._discover.compute import kneighbors, neighbours_once, on_device
from ._dist import Comm, init_from_env, rank_device
from ._engine import stage
from ._integrate import integrated_space
from ._train import (
    CellMatrix,
    NovelHeads,
    Schedule,
    TrainRandom,
    fit_open_world,
    fit_warmup,
    infer,
    knn_mean_distance,
    resolve_device,
    schedule,
)
from .module import OrcaNet

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ context
@dataclass(frozen=True)
class Transform:
    """Per-batch alignment ``x * scale[batch] + offset[batch]`` (each ``(n_batches, G)``) and
    its JSON-able details (method, anchor batch, shift norms).
    """

    scale: np.ndarray
    offset: np.ndarray
    info: dict[str, Any]


#: the level of the test that switches discovery's PCA to Pearson residuals (``pca_input="auto"``)
PCA_INPUT_ALPHA = 0.05


def choose_pca_input(run: RunContext, residuals: PearsonResiduals) -> dict[str, Any]:
    """``pca_input="auto"``: the Pearson residuals where the labelled cells say that they tell
    cell types apart better than the log-normalised expression, else the log values.

    The labelled cells (at most ``calibration_cells``, at random) are put in each PCA and each
    is given the majority label of its ``n_neighbors`` nearest labelled cells (itself left
    out). The residuals are used when they classify more cells right than the log values and a
    one-sided exact McNemar test on the cells the two disagree on rejects "no better" at
    :data:`PCA_INPUT_ALPHA`: the log values stay unless the data show the residuals pay.
    Returns the record (both accuracies, the discordant counts, the p-value).
    """
    from scipy.stats import binom

    d, dc, seed = run.data, run.rules, run.config.seed
    lab = np.flatnonzero(d.labels >= 0)
    if lab.size > dc.calibration_cells:
        lab = np.sort(np.random.default_rng(seed).choice(lab, dc.calibration_cells, replace=False))
    y = d.labels[lab]
    record: dict[str, Any] = {"pca_input": "log", "asked": "auto"}
    if np.unique(y).size < 2 or lab.size <= dc.n_neighbors:
        return {**record, "reason": "too few labelled cells to compare"}
    t = run.transform
    right = []
    for res in (None, residuals):
        z = pca_embedding(d.X, d.domain, t.scale, t.offset, n_comps=dc.n_pcs, seed=seed,
                          rows=lab, residuals=res)  # fmt: skip
        nb = y[kneighbors(z, dc.n_neighbors)]  # each cell itself left out
        votes = np.stack([(nb == k).sum(axis=1) for k in range(int(y.max()) + 1)], axis=1)
        right.append(votes.argmax(axis=1) == y)
    log_only, res_only = int((right[0] & ~right[1]).sum()), int((right[1] & ~right[0]).sum())
    p = float(binom.sf(res_only - 1, log_only + res_only, 0.5)) if res_only > log_only else 1.0
    return {
        **record,
        "pca_input": "pearson" if p < PCA_INPUT_ALPHA else "log",
        "knn_accuracy_log": float(right[0].mean()),
        "knn_accuracy_pearson": float(right[1].mean()),
        "right_only_log": log_only,
        "right_only_pearson": res_only,
        "p_value": p,
        "n_cells": int(lab.size),
    }


@dataclass(frozen=True)
class RunContext:
    """Everything a stage reads, built once: the prepared data, its alignment, the training
    matrix on the device, the configuration, the schedule, the random streams carried from the
    warm-up to the open-world fit, and the processes that train together.
    """

    data: PreparedData
    transform: Transform
    cells: CellMatrix
    config: OrcaConfig
    plan: Schedule
    rand: TrainRandom
    comm: Comm
    #: the laboratory's settings (ORCA's by default; the benchmark varies them)
    lab: Ablation = LAB
    #: the PCA of all cells per number of components (discovery and the pair partners read it)
    _pca_all: dict[int, np.ndarray] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: the Pearson residuals' depths and gene shares, fitted at the first PCA that reads them
    _residuals: list = field(default_factory=list, init=False, repr=False, compare=False)
    #: what the PCA reads and why, decided once (a context on a sample shares its run's)
    _pca_input: list = field(default_factory=list, repr=False, compare=False)

    @property
    def rules(self) -> DiscoveryRules:
        """What discovery's rules read: the user's options and the rules' constants."""
        return DiscoveryRules.of(self.config.discovery, self.lab)

    @property
    def n_seen(self) -> int:
        return len(self.data.classes)

    def pca(self, n_comps: int, rows: np.ndarray | None = None) -> np.ndarray:
        """PCA of the aligned expression of ``rows`` (all cells by default); that of all cells
        is computed once per number of components.
        """
        t = self.transform
        X, domain, seed = self.data.X, self.data.domain, self.config.seed
        n = self.data.n_cells
        every = rows is None or (rows.size == n and bool(np.array_equal(rows, np.arange(n))))
        if every and n_comps in self._pca_all:
            return self._pca_all[n_comps]
        out = pca_embedding(X, domain, t.scale, t.offset, n_comps=n_comps, seed=seed, rows=rows,
                            residuals=self.residuals())  # fmt: skip
        if every:  # shared by its readers, which do not write to it
            self._pca_all[n_comps] = out
        return out

    @property
    def pca_input(self) -> str:
        """What the PCA reads: ``"pearson"`` or ``"log"`` (:meth:`pca_input_record`)."""
        return self.pca_input_record()["pca_input"]

    def pca_input_record(self) -> dict[str, Any]:
        """What the PCA reads and why, decided once: ``"log"`` where asked or where some input
        was not counts; ``"pearson"`` where asked; with ``"auto"``, the Pearson residuals where
        they tell the labelled types apart better (:func:`choose_pca_input`).
        """
        if self._pca_input:
            return self._pca_input[0]
        asked, counts = self.config.discovery.pca_input, self.has_counts
        record: dict[str, Any] = {"pca_input": "log" if asked == "log" or not counts else asked}
        if asked != "log" and not counts:
            record["reason"] = "not every input held counts"
        if record["pca_input"] == "auto":
            record = choose_pca_input(self, self.residuals_fit())
        self._pca_input.append(record)
        return record

    @property
    def has_counts(self) -> bool:
        """Whether every cell's total counts were recorded while reading (counts input)."""
        totals = self.data.totals
        return totals is not None and totals.size > 0 and bool(np.isfinite(totals).all())

    def residuals_fit(self) -> PearsonResiduals:
        """The Pearson residuals' depths and gene shares of all cells, fitted once."""
        if not self._residuals:
            d = self.data
            self._residuals.append(
                PearsonResiduals.fit(d.X, d.domain, d.totals, self.config.target_sum)
            )
        return self._residuals[0]

    def residuals(self) -> PearsonResiduals | None:
        """The Pearson residuals the PCA reads (``None``: the log-normalised expression)."""
        return self.residuals_fit() if self.pca_input == "pearson" else None

    def discovery_space(
        self, rows: np.ndarray, batch: np.ndarray
    ) -> tuple[Callable[[np.ndarray], np.ndarray], dict[str, Any]]:
        """The space discovery reads for the cells ``rows`` (``batch``: their batches):
        ``pca_of(idx)`` (positions into ``rows``) and its record. By default the PCA of each
        cell set's aligned expression; with ``discovery.integration="harmony"`` and several
        batches, the rows of one Harmony embedding of the joint PCA of all of ``rows``; with
        ``discovery.use_rep``, the rows of the user's embedding.
        """
        dc, seed = self.rules, self.config.seed
        if self.data.rep is not None:  # the user's own integrated embedding: no PCA
            rep = self.data.rep[rows]
            info = {"method": "use_rep", "key": dc.use_rep, "width": int(rep.shape[1])}
            return rep.__getitem__, info
        info: dict[str, Any] = {"method": "none", **self.pca_input_record()}
        if dc.integration == "none":
            return (lambda idx: self.pca(dc.n_pcs, rows[idx])), info
        done: list[np.ndarray | None] = []

        def pca_of(idx: np.ndarray) -> np.ndarray:
            if not done:  # computed at the first call (on the process that decides)
                with stage("integration"):
                    pcs = self.pca(dc.n_pcs, rows)
                    emb, record = integrated_space(
                        pcs, batch, dc.integration, seed, self.data.labeled[rows]
                    )
                done.append(emb)
                info.clear()
                info.update(record, **self.pca_input_record())
            if done[0] is None:
                return self.pca(dc.n_pcs, rows[idx])
            return done[0][idx]

        return pca_of, info


def run_context(
    adata: Any, reference: Any | None, labels_key: str, cfg: OrcaConfig, lab: Ablation = LAB
) -> RunContext:
    """Prepare the data, align its batches and put the training matrix on the device."""
    comm = init_from_env(cfg.device)
    device = resolve_device(rank_device(cfg.device, comm))  # options first, then the data
    if comm.active and not comm.main:
        cfg = cfg.replace(progress=False)
    with stage("prepare"):
        data = prepare(adata, reference, labels_key, cfg, comm, lab.min_shared_genes)
    n_batches, n_seen = len(data.domain_names), len(data.classes)
    with stage("alignment"):
        transform = Transform(
            *comm.on_main(
                compute_transform,
                cfg.alignment,
                data.X,
                data.labels,
                data.domain,
                n_batches,
                n_seen,
            )
        )
    cells = CellMatrix(data.X, data.domain, transform.scale, transform.offset, device)
    return RunContext(
        data, transform, cells, cfg, schedule(data.n_cells, cfg, lab),
        TrainRandom(cfg.seed, device), comm, lab,
    )  # fmt: skip


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
    t2 = time.perf_counter()
    with stage("open-world fit"):
        ow = open_world(run, warm, cand)
    t3 = time.perf_counter()
    found = cand.found
    logger.info("Novel heads: %d (estimated novel types: %d).", found.n_heads, found.n_novel)
    for note in [*found.notes, *(check or {}).get("notes", [])]:  # the data cannot support a call
        logger.warning(note)
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
    return Fit(
        run.data, run.transform, run.config, run.plan, ow.net, warm.history + ow.history, found,
        check, _anchor_centroids(run), probs, embedding,
        Timings(t1 - t0, t2 - t1 - t_side, t3 - t2, t5 - t4 + t_side), training, pvalues,
        fold_pred, run.lab,
    )  # fmt: skip


def discovery_sample(run: RunContext) -> np.ndarray | None:
    """The cells (sorted rows) that the warm-ups and discovery run on: a random
    ``discovery.discovery_cells`` of them (the run's seed) above that many, else ``None`` (all).

    The warm-up's stopping rule ends it after a number of optimiser steps that hardly moves with
    the data's size, so the more cells, the less closely it fits each labelled cell, and the
    in-sample threshold and every vote built on it follow: on the simulated droplet-depth
    scale task the same data found 6-9 novel types at 20,000 cells and 0 at 100,000 at some
    seeds (docs/discovery.md). On a sample of fixed size the warm-ups see each labelled cell as
    often as at that size, whatever the size of the data.
    """
    cap, n = run.config.discovery.discovery_cells, run.data.n_cells
    if cap is None or n <= cap:
        return None
    rng = np.random.default_rng([run.config.seed, 0xD15C])
    return np.sort(rng.choice(n, cap, replace=False))


def sample_context(run: RunContext, sample: np.ndarray) -> RunContext:
    """The run's context on the cells ``sample`` alone: their rows of the data and training
    matrix, their own schedule, random streams (the run's seed) and PCA; same alignment,
    configuration, processes and choice of what the PCA reads (``pca_input``, decided once, on
    whichever cells ask first: the sample's, where discovery runs on one).
    """
    d, t, cfg = run.data, run.transform, run.config
    data = replace(
        d, X=d.X[sample], labels=d.labels[sample], domain=d.domain[sample],
        output_rows=np.flatnonzero(np.isin(sample, d.output_rows)),
        rep=None if d.rep is None else d.rep[sample],
        totals=None if d.totals is None else d.totals[sample],
    )  # fmt: skip
    cells = CellMatrix(data.X, data.domain, t.scale, t.offset, run.cells.device)
    rand = TrainRandom(cfg.seed, cells.device)
    if not run.has_counts:  # some input is not counts anywhere in the data: no test to run
        run.pca_input_record()
    # one choice of what the PCA reads per run, made on the sample where discovery runs: the
    # pair partners of all cells then read what discovery read (and the test is not repeated)
    return RunContext(data, t, cells, cfg, schedule(sample.size, cfg, run.lab), rand, run.comm,
                      run.lab, _pca_input=run._pca_input)  # fmt: skip


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


def warm_up(run: RunContext) -> WarmUp:
    """The supervised warm-up on the labelled cells, less those held out for calibration."""
    data, cfg, dc = run.data, run.config, run.rules
    held = calibration_split(
        data.labels, dc.calibration_fraction, dc.calibration_max_cells, cfg.seed
    )
    labels = np.where(held, -1, data.labels)
    net, history = fit_warmup(run.cells, labels, run.n_seen, cfg, run.plan, run.rand, run.comm,
                              run.lab)  # fmt: skip
    return WarmUp(net, history, held)


def _side_warmup(run: RunContext, held: np.ndarray, seed: int) -> OrcaNet:
    """A supervised warm-up beside the main one, without the labelled cells ``held``, with the
    random streams of ``seed`` and no progress bar of its own (the run's bars say enough).
    """
    labels = np.where(held, -1, run.data.labels)
    quiet = run.config.replace(progress=False)
    rand = TrainRandom(seed, run.cells.device)
    return fit_warmup(run.cells, labels, run.n_seen, quiet, run.plan, rand, run.comm, run.lab)[0]


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
    net, _ = fit_warmup(cells, labels, run.n_seen, cfg, sub.plan, rand, lab=run.lab)
    emb, similarity = seen_similarity(net, cells, np.arange(sample.size))
    dc = run.rules
    pca_of, _ = sub.discovery_space(np.arange(sample.size), data.domain[sample])
    cells = DiscoveryInput(
        emb, similarity, labels, data.domain[sample], pca_of,
        calibration=held[sample], domain_names=[*data.domain_names, "self-check"],
    )  # fmt: skip
    return discover(cells, dc, n_novel=cfg.n_novel, seed=cfg.seed)


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
    net, _ = fit_warmup(run.cells, split.labels, n_keep, cfg, run.plan, rand, run.comm, run.lab)
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


#: the novelty score's neighbours are looked for among at most this many labelled cells per fold
#: (the same random ones score its held-out and its test cells, so the p-values keep their
#: level; a cap of 500 lowered the test's power on the real tasks where it binds by at most
#: 0.03: docs/discovery.md)
NOVELTY_REFERENCE_CELLS = 2_000


@dataclass(frozen=True)
class FoldNets:
    """The cross-fitted warm-ups: ``folds`` (each labelled cell's fold, ``-1`` unlabelled), one
    supervised net per fold trained without it (``None`` for an empty fold), and, where asked
    for, every labelled cell's best seen-head cosine in the net of its fold
    (``held_out_similarity``, NaN for unlabelled cells; ``None`` when not asked for).
    """

    folds: np.ndarray
    nets: list[OrcaNet | None]
    held_out_similarity: np.ndarray | None


def fold_warmups(run: RunContext, n_folds: int, held_out: bool = False) -> FoldNets:
    """One supervised warm-up without each of ``n_folds`` folds of the labelled cells (stratified
    by type; the random streams of the run's seed + 100 + fold) and, with ``held_out``, each
    held-out cell's best cosine to a seen head of its fold's net (one inference pass over the
    labelled cells, made for ``cross_fit_threshold``).
    """
    data, cfg = run.data, run.config
    folds = fold_ids(data.labels, n_folds, cfg.seed)
    nets: list[OrcaNet | None] = []
    similarity = np.full(data.n_cells, np.nan) if held_out else None
    for f in range(n_folds):  # loop over folds, not cells
        held = folds == f
        if not held.any():
            nets.append(None)
            continue
        with stage("fold warm-ups"):
            net = _side_warmup(run, held, cfg.seed + 100 + f)
        nets.append(net)
        if similarity is not None:
            rows = np.flatnonzero(held)
            similarity[rows] = seen_similarity(net, run.cells, rows, run.comm)[1].max(axis=1)
    return FoldNets(folds, nets, similarity)


def cross_fit(
    run: RunContext, side: FoldNets, seen_top: np.ndarray
) -> tuple[np.ndarray, FoldPredictions]:
    """The cross-fitted warm-ups (:func:`fold_warmups`) put to two uses. (1) The cross-fitted
    conformal novelty p-value of every unlabelled cell (NaN for labelled ones;
    :mod:`orca_sc._conformal`): the held-out cells calibrate the kNN score of the unlabelled
    cells (neighbours among at most :data:`NOVELTY_REFERENCE_CELLS` of the fold's training
    cells). (2) The fold nets' predictions that calibrate the confidence
    (:mod:`orca_sc._calibration`); ``seen_top``: every cell's most probable known type under the
    final net.
    """
    data, cfg = run.data, run.config
    folds, n_folds = side.folds, len(side.nets)
    test = np.flatnonzero(~data.labeled)
    counts = CrossConformal(test.size)
    rng = np.random.default_rng(cfg.seed)
    held_prob = np.zeros(data.n_cells)
    held_correct = np.zeros(data.n_cells, dtype=bool)
    label_prob = np.full((n_folds, data.n_cells), np.nan, dtype=np.float32)
    at = np.empty(data.n_cells, dtype=np.int64)  # a cell's row in the fold's inference
    for f, net in enumerate(side.nets):  # loop over folds, not cells
        held = folds == f
        if net is None:
            continue
        # the cells the fold's net trained on (all labelled cells but the fold's, where the
        # warm-ups ran on every cell)
        train = np.flatnonzero((folds >= 0) & ~held)
        if train.size > NOVELTY_REFERENCE_CELLS:  # the same random labelled cells score all
            train = np.sort(rng.choice(train, NOVELTY_REFERENCE_CELLS, replace=False))
        # the cells a fold's net says something of: the query, its held-out and its reference
        # cells (a labelled cell's confidence comes from the fold it was held out of)
        rows = np.union1d(np.flatnonzero(~data.labeled | held), train)
        with stage("fold inference"):
            probs, emb = infer(net, run.cells, rows, comm=run.comm)
        at[rows] = np.arange(rows.size)
        # every rank has the embedding; the scores are counted once
        with stage("fold scores"):
            run.comm.on_main(
                _count_fold, counts, emb, at[train], at[held], at[test], run.cells.device
            )
        held_prob[held] = probs[at[held]].max(axis=1)
        held_correct[held] = probs[at[held]].argmax(axis=1) == data.labels[held]
        label_prob[f, rows] = probs[np.arange(rows.size), seen_top[rows]]
    p = np.full(data.n_cells, np.nan)
    p[test] = run.comm.on_main(counts.pvalues)
    lab = folds >= 0  # every labelled cell a fold's net was scored on
    return p, FoldPredictions(held_prob[lab], held_correct[lab], folds, label_prob)


# ------------------------------------------------------------------------------------ helpers
def _discover_in(
    cells: DiscoveryInput, dc: Any, cfg: OrcaConfig, space: dict[str, Any]
) -> Discovery:
    """:func:`discover` on ``cells``, with the record of the space it was read in
    (``estimate['integration']``).
    """
    found = discover(cells, dc, n_novel=cfg.n_novel, seed=cfg.seed)
    return replace(found, diagnostics={**found.diagnostics, "integration": dict(space)})


def _count_fold(
    counts: CrossConformal,
    emb: np.ndarray,
    train: np.ndarray,
    held: np.ndarray,
    test: np.ndarray,
    device: torch.device,
) -> None:
    """One fold of :func:`cross_fit`: the kNN scores (:data:`SCORE_NEIGHBORS` neighbours, found on
    ``device``) of its held-out and of the test cells against its training cells ``train`` in
    its net's embedding ``emb`` (all three: rows of ``emb``), into ``counts``.
    """
    ref = emb[train]
    counts.add(knn_mean_distance(ref, emb[held], SCORE_NEIGHBORS, device),
               knn_mean_distance(ref, emb[test], SCORE_NEIGHBORS, device))  # fmt: skip


def seen_similarity(
    net: OrcaNet, cells: CellMatrix, idx: np.ndarray, comm: Comm | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The L2-normalised embedding of the cells ``idx`` ``(n, D)`` and their cosine to each seen
    head of ``net`` ``(n, n_seen)`` (the net has no novel heads yet).
    """
    _, emb = infer(net, cells, idx, comm)
    seen_w = torch.nn.functional.normalize(net.head.weight.detach(), dim=1).cpu().numpy()
    return emb, emb @ seen_w.T


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
