"""ORCA's training (paper Algorithm 1) in two phases, and batched inference. Torch and numpy
only: no AnnData, nothing of ``tl``.

:func:`fit_warmup` trains a new net on the labelled cells (supervised term only);
:func:`fit_open_world` continues from it with novel heads added (a new net) and the full
objective on all cells. A :class:`TrainRandom` carries the random streams across the two.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ._ablation import LAB, Ablation
from ._cells import (
    CellMatrix,
    infer,
)
from ._config import OrcaConfig
from ._dist import Comm
from ._engine import StopState, fit_phase
from ._loss import (
    CellBatch,
    OrcaLoss,
)
from ._pretrain import start_from
from .module import BatchDecoder, NormedLinear, OrcaNet

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Schedule:
    """Batches per epoch and the number of epochs of each phase (see :func:`schedule`)."""

    steps_per_epoch: int
    n_epochs: int
    warmup: int
    anchor: int


def schedule(n_cells: int, config: OrcaConfig, lab: Ablation = LAB) -> Schedule:
    """At least ``lab.epoch_min_steps`` optimiser steps per epoch of ``config.epochs`` (passes
    over the cells are added for small data, so that a run of fewer epochs is always shorter);
    warm-up and anchor phases scale with the number of passes.
    """
    steps_per_epoch = max(1, math.ceil(n_cells / config.batch_size))
    min_steps = lab.epoch_min_steps * config.epochs
    n_epochs = max(config.epochs, math.ceil(min_steps / steps_per_epoch))
    warmup = round(config.warmup_epochs * n_epochs / config.epochs)
    anchor = round(lab.anchor_epochs * n_epochs / config.epochs)
    return Schedule(steps_per_epoch, n_epochs, warmup, anchor)


@dataclass(frozen=True)
class StopRule:
    """When a phase of training ends before its schedule (the schedule is the upper bound).

    Every ``every`` optimiser steps the phase is checked on a fixed ``sample`` of cells (rows of
    the training matrix): it stops at a check, once it has run ``min_steps`` steps, when both

    * the mean loss of the last ``every`` steps fell by less than two standard errors of the
      difference from the ``every`` steps before (the loss has stopped falling beyond its noise),
      and
    * the share of the sampled cells whose head (argmax, in eval mode) changed since the previous
      check is below ``tolerance``, or has stopped falling: it fell by less than two binomial
      standard errors of the difference from the check before. Cells between two close types
      keep changing head at a steady rate however long a phase trains (on noisy data 10% of
      the cells between warm-up checks); that rate no longer falling is the sign of convergence.
    """

    sample: np.ndarray
    tolerance: float
    every: int
    min_steps: int


#: cells whose heads a stopping check compares (a share of 1% is then 20 cells)
STOP_SAMPLE = 2000


def stop_rule(n_cells: int, config: OrcaConfig, lab: Ablation = LAB) -> StopRule | None:
    """The :class:`StopRule` of a phase (``None`` with ``lab.stop_tolerance=0``: the schedule).
    The sample is drawn from the config's seed, the same in both phases; the checks are
    ``lab.stop_check_steps`` steps apart (checks an epoch apart at any size were measured and
    not kept: they train longer at large sizes, docs/discovery.md).
    """
    if lab.stop_tolerance <= 0:
        return None
    rng = np.random.default_rng([config.seed, 0x5709])
    sample = np.sort(rng.choice(n_cells, size=min(n_cells, STOP_SAMPLE), replace=False))
    return StopRule(sample, lab.stop_tolerance, lab.stop_check_steps, lab.stop_min_steps)


def stop_state(rule: StopRule | None, data: CellMatrix, comm: Comm | None) -> StopState:
    """The engine's :class:`~orca_sc._engine.StopState` of ``rule`` over one phase on ``data``
    (``None``: one that never checks).
    """
    if rule is None:
        return StopState.never()

    def heads_of(net: OrcaNet) -> np.ndarray:
        return infer(net, data, rule.sample, comm)[0].argmax(axis=1)

    return StopState(rule.every, rule.min_steps, rule.tolerance, heads_of)


class TrainRandom:
    """The random streams of one training run, carried from the warm-up to the open-world phase
    so that the two phases together draw exactly as one run would: mini-batch order (numpy),
    labelled cells' pair partners (a torch generator) and torch's global stream (weight
    initialisation, dropout), which is saved on leaving a phase and restored on entering the next
    (the caller's global state is left as it was).
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.numpy = np.random.default_rng(seed)
        # on a GPU drawn there (no copy from the host per step); on the CPU as before
        gen_device = device if device.type == "cuda" else torch.device("cpu")
        self.pairs = torch.Generator(device=gen_device).manual_seed(seed)
        self._devices = [device] if device.type == "cuda" else []
        self._state: tuple | None = None
        self._seed = seed

    @contextlib.contextmanager
    def torch_stream(self):
        with torch.random.fork_rng(devices=self._devices):
            if self._state is None:
                torch.manual_seed(self._seed)
            else:
                torch.random.set_rng_state(self._state[0])
                if self._devices:
                    torch.cuda.set_rng_state(self._state[1], self._devices[0])
            try:
                yield
            finally:
                cuda = torch.cuda.get_rng_state(self._devices[0]) if self._devices else None
                self._state = (torch.random.get_rng_state(), cuda)


@dataclass(frozen=True)
class NovelHeads:
    """What the open-world phase needs from discovery: initial weights ``(k, D)`` of the novel
    heads, the regulariser's prior over all heads (``None``: uniform), and the rows of the
    training matrix anchored to a novel head during the anchor epochs, with their heads.
    """

    prototypes: np.ndarray
    prior: np.ndarray | None = None
    anchor_rows: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    anchor_heads: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))


def fit_warmup(
    data: CellMatrix,
    labels: np.ndarray,
    n_seen: int,
    config: OrcaConfig,
    plan: Schedule,
    rand: TrainRandom,
    comm: Comm | None = None,
    lab: Ablation = LAB,
    init: dict | None = None,
    cluster_targets: np.ndarray | None = None,
) -> tuple[OrcaNet, list[dict]]:
    """A new :class:`OrcaNet` with one head per seen class, trained for at most ``plan.warmup``
    epochs on the labelled cells with the supervised term alone (the margin follows the
    unlabelled cells' uncertainty as in the full objective), stopped earlier by
    ``config``'s :class:`StopRule`. Returns the net and one history record per epoch.
    ``comm``: the processes that train it together (see :mod:`orca_sc._dist`). ``init``: a
    pretrained backbone to start from (:func:`orca_sc._pretrain.start_from`, its first layer
    kept fixed with ``lab.pretrain_freeze``). ``cluster_targets``: each cell's cluster for the
    cluster term (:attr:`orca_sc._context.RunContext.warmup_cluster_targets`), read with
    ``lab.warmup_clusters`` only.
    """
    with rand.torch_stream():
        net = OrcaNet(data.shape[1], n_seen, config.hidden_dims, config.dropout).to(data.device)
        start_from(net, init, lab.pretrain_freeze)
        if lab.warmup_recon:  # a decoder for the reconstruction term, dropped after the phase
            n_batches = int(data.domain_np.max()) + 1
            net.decoder = BatchDecoder(config.hidden_dims[1], n_batches, data.shape[1])
            net.decoder.to(data.device)
        loss = OrcaLoss(data, labels, config, plan, comm, full=False, generator=rand.pairs,
                        lab=lab, cluster_targets=cluster_targets)  # fmt: skip
        if loss.clusters:  # a head for the cluster term, dropped after the phase
            net.cluster_head = NormedLinear(config.hidden_dims[1], int(cluster_targets.max()) + 1)
            net.cluster_head.to(data.device)
        history = _fit(net, loss, data, labels, range(plan.warmup), plan, config, rand, comm)
        if lab.warmup_recon:
            del net.decoder
        if loss.clusters:
            del net.cluster_head
    return net, history


def fit_open_world(
    net: OrcaNet,
    data: CellMatrix,
    labels: np.ndarray,
    novel: NovelHeads,
    config: OrcaConfig,
    plan: Schedule,
    rand: TrainRandom,
    pair_features: np.ndarray | None = None,
    comm: Comm | None = None,
    pair_fixed_only: np.ndarray | None = None,
    lab: Ablation = LAB,
) -> tuple[OrcaNet, list[dict]]:
    """ORCA's open-world phase (paper Algorithm 1) on all cells: a new net with ``net``'s
    backbone and seen heads plus the novel heads of ``novel``, trained with the full objective
    for at most the epochs after the warm-up (the first ``plan.anchor`` of them with the anchor
    term), stopped earlier by ``config``'s :class:`StopRule` (not during the anchor epochs).
    ``pair_features`` ``(n_cells, P)``: a fixed space in which unlabelled cells' pairwise
    partners are also looked for (``lab.pair_space``); ``pair_fixed_only`` ``(n_cells,)``:
    the cells that look for them in that space alone (``pair_space="query_pca"``: the cells of
    batches without labelled cells). ``net`` is left as it is.
    """
    dev = data.device
    with rand.torch_stream():
        net = net.with_novel_heads(torch.as_tensor(novel.prototypes, dtype=torch.float32))
        net = net.to(dev)
        prior = None
        if lab.prior == "data" and novel.prior is not None:
            prior = torch.as_tensor(novel.prior, dtype=torch.float32, device=dev)
        y_anchor = None
        if novel.anchor_rows.size:
            y_anchor = torch.full((data.shape[0],), -1, dtype=torch.int64, device=dev)
            y_anchor[torch.as_tensor(novel.anchor_rows, device=dev)] = torch.as_tensor(
                novel.anchor_heads, dtype=torch.int64, device=dev
            )
        feats = fixed_only = None
        if pair_features is not None:
            feats = torch.as_tensor(pair_features, dtype=torch.float32, device=dev)
        if pair_fixed_only is not None:
            fixed_only = torch.as_tensor(pair_fixed_only, dtype=torch.bool, device=dev)
        loss = OrcaLoss(
            data, labels, config, plan, comm, full=True, prior=prior, y_anchor=y_anchor,
            pair_features=feats, generator=rand.pairs, pair_fixed_only=fixed_only, lab=lab,
        )  # fmt: skip
        epochs = range(plan.warmup, plan.n_epochs)
        history = _fit(net, loss, data, labels, epochs, plan, config, rand, comm)
    net.eval()
    return net, history


def _fit(net, loss, data, labels, epochs, plan, config, rand, comm) -> list[dict]:
    """:func:`orca_sc._engine.fit_phase` of ``net`` on the cells of ``data``: the phase's
    batches, Adam, the stopping rule of ``config`` and, with several processes, the net
    wrapped for ``DistributedDataParallel``.
    """
    comm = comm if comm is not None and comm.active else None
    full = loss.full
    phase = "open-world" if full else "warm-up"
    rule = stop_rule(data.shape[0], config, loss.lab)
    return fit_phase(
        net, loss, CellBatches(data, labels, plan, rand, full, comm, loss.unlabelled_rows),
        _adam(net, config), epochs,
        phase=phase, stop=stop_state(rule, data, comm),
        model=_distributed(net, data.device, comm),
        desc="ORCA" if full else "ORCA warm-up", progress=config.progress,
    )  # fmt: skip


class CellBatches:
    """The mini-batches of a phase on the cells of ``data``: every epoch a permutation of the
    labelled cells and one of the unlabelled, cut into ``plan.steps_per_epoch`` batches that mix
    the two in proportion (the warm-up's, ``full=False``, hold the labelled cells alone);
    balanced sizes, so that the last batch is never tiny. With several processes every rank
    draws the same batches and loads its part of each. ``unlabelled``: the unlabelled cells
    a warm-up's batches hold too (``Ablation.warmup_recon``, ``Ablation.warmup_clusters``;
    ``None``: all of them in the open-world phase, none in a warm-up).
    """

    def __init__(self, data, labels, plan: Schedule, rand: TrainRandom, full: bool, comm,
                 unlabelled: np.ndarray | None = None):  # fmt: skip
        self.data, self.plan, self.rand, self.comm = data, plan, rand, comm
        self.full = full or unlabelled is not None
        self.lab_idx = np.flatnonzero(labels >= 0)
        self.unl_idx = np.flatnonzero(labels < 0) if unlabelled is None else unlabelled

    def epoch(self, epoch: int) -> list[np.ndarray]:
        rng, n = self.rand.numpy, self.plan.steps_per_epoch
        lab_chunks = np.array_split(rng.permutation(self.lab_idx), n)
        unl_chunks = np.array_split(rng.permutation(self.unl_idx), n)
        batches = [
            np.concatenate([lc, uc]) if self.full else lc
            for lc, uc in zip(lab_chunks, unl_chunks, strict=True)
        ]
        return [b for b in batches if b.size >= 2]

    def load(self, batches: list[np.ndarray]) -> Iterator[CellBatch]:
        data = self.data
        order = np.concatenate(batches) if batches else np.empty(0, dtype=np.int64)
        order_t = data.to_device(order)  # one copy per stretch
        bounds = np.cumsum([0] + [b.size for b in batches])
        for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            idx = order_t[lo:hi]
            if self.comm is None:
                yield CellBatch(data.batch(batches[b], idx), idx, None)
            else:  # this rank's part of the batch
                shard = self.comm.batch_shard(hi - lo)
                yield CellBatch(data.batch(batches[b][shard.rows], idx[shard.rows]), idx, shard)


def _distributed(net: OrcaNet, device: torch.device, comm: Comm | None):
    """``net`` wrapped for ``DistributedDataParallel`` over ``comm`` (``net`` itself alone)."""
    if comm is None:
        return net
    from torch.nn.parallel import DistributedDataParallel

    ids = [device] if device.type == "cuda" else None
    # buffers (BatchNorm running statistics) move the same on every rank: not broadcast
    return DistributedDataParallel(
        net, device_ids=ids, forward_sync_buffers=False, process_group=comm.group
    )


def _adam(net: OrcaNet, config: OrcaConfig) -> torch.optim.Adam:
    """Adam with its fused kernel where there is one (CPU, CUDA): on 2 CPU threads 0.4 ms per
    step against 6.3 ms for the per-parameter loop.
    """
    kw = {"lr": config.lr}
    trainable = [p for p in net.parameters() if p.requires_grad]  # a frozen first layer is not
    try:
        return torch.optim.Adam(trainable, fused=True, **kw)
    except RuntimeError:  # no fused kernel for this device
        return torch.optim.Adam(trainable, **kw)
