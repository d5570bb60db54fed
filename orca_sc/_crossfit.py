"""The cross-fitted warm-ups: one supervised net without each fold of the labelled cells. Their
cosines of the held-out cells set the per-type out-of-distribution thresholds; their embeddings
calibrate the conformal novelty p-values and their predictions the confidence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ._calibration import FoldPredictions
from ._cells import infer, knn_mean_distance
from ._conformal import SCORE_NEIGHBORS, CrossConformal, fold_ids
from ._context import (
    RunContext,
    seen_similarity,
)
from ._engine import stage
from ._train import TrainRandom, fit_warmup
from .module import OrcaNet


def _side_warmup(run: RunContext, held: np.ndarray, seed: int) -> OrcaNet:
    """A supervised warm-up beside the main one, without the labelled cells ``held``, with the
    random streams of ``seed`` and no progress bar of its own (the run's bars say enough).
    """
    labels = np.where(held, -1, run.data.labels)
    quiet = run.config.replace(progress=False)
    rand = TrainRandom(seed, run.cells.device)
    return fit_warmup(
        run.cells, labels, run.n_seen, quiet, run.plan, rand, run.comm, run.lab,
        init=run.pretrained, cluster_targets=run.warmup_cluster_targets,
    )[0]  # fmt: skip


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
