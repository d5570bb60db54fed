"""ORCA's objective on the cells of the training matrix (paper Eq. 1): the margin refreshed every
epoch from the unlabelled cells' uncertainty (Eq. 4), the pairwise and entropy terms, and the
anchor term of the first open-world epochs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ._ablation import LAB, MAX_MARGIN, Ablation
from ._cells import (
    CellMatrix,
    _affordable,
    uncertainty_batches,
)
from ._config import OrcaConfig
from ._discover.labels import query_batch_cells
from ._dist import BatchShard, Comm, active_shard
from ._engine import stage
from .losses import (
    adaptive_margin,
    joint_cosine_features,
    margin_cross_entropy,
    masked_margin_cross_entropy,
    orca_objective,
    split_cosine_similarity,
)
from .module import OrcaNet, SparseRows, dense_input


@torch.no_grad()
def mean_uncertainty(
    net: OrcaNet,
    data: CellMatrix,
    rows: np.ndarray,
    comm: Comm | None = None,
    batches: list | None = None,
) -> float:
    """Paper Eq. 4: mean over ``rows`` of ``1 - max softmax``, in eval mode (each rank of
    ``comm`` takes its share of ``rows``; the sum is taken over the ranks). ``batches``: those of
    :func:`uncertainty_batches` for the same rows, where the caller keeps them.
    """
    if rows.size == 0:
        return 0.0
    net.eval()
    if batches is None:
        batches = uncertainty_batches(data, rows, comm)
    total = torch.zeros((), device=data.device)
    for x in batches:
        logits, _ = net(x)
        total += (1 - F.softmax(logits, dim=1).amax(dim=1)).sum()
    if comm is not None:
        total = float(comm.sum(np.array([float(total)]))[0])
    return float(total) / rows.size


@dataclass(frozen=True)
class CellBatch:
    """One mini-batch of cells: the model's input ``x`` (this rank's rows), the batch's rows
    of the training matrix on the device ``rows``, and this rank's ``shard`` (``None``: one
    process).
    """

    x: torch.Tensor | SparseRows
    rows: torch.Tensor
    shard: BatchShard | None


class OrcaLoss:
    """ORCA's objective on the cells of ``data`` (paper Eq. 1; :func:`orca_loss_terms`), with
    the state it keeps over a phase: the margin, set at the start of every epoch from the
    unlabelled cells' mean uncertainty (Eq. 4, over a fixed sample of at most
    :data:`UNCERTAINTY_CELLS`); the regulariser's ``prior``; the anchored cells' heads
    ``y_anchor`` (``(n_cells,)``, ``-1``: not anchored; used in the first ``plan.anchor``
    epochs after the warm-up, which the stopping rule never cuts); the fixed
    ``pair_features`` ``(n_cells, P)`` and the cells that look for partners in it alone,
    ``pair_fixed_only`` ``(n_cells,)``; the labelled cells' pair partners drawn from
    ``generator``. ``full=False``: the warm-up's supervised term alone.
    """

    terms = ("loss", "supervised", "pairwise", "regularizer", "anchor")

    def __init__(
        self, data: CellMatrix, labels: np.ndarray, config: OrcaConfig, plan: Any, comm,
        *, full: bool, prior=None, y_anchor=None, pair_features=None, generator=None,
        pair_fixed_only=None, lab: Ablation = LAB, cluster_targets=None,
    ) -> None:  # fmt: skip
        self.data, self.config, self.plan, self.full = data, config, plan, full
        self.lab = lab
        self.comm = comm if comm is not None and comm.active else None
        self.y_all = torch.as_tensor(labels, device=data.device)
        self.u_rows = _uncertainty_rows(np.flatnonzero(labels < 0), config.seed)
        self.prior, self.y_anchor, self.pair_features = prior, y_anchor, pair_features
        self.generator, self.pair_fixed_only = generator, pair_fixed_only
        self.margin, self.anchored = 0.0, False
        #: the unlabelled cells a warm-up's mini-batches hold beside the labelled ones, for its
        #: reconstruction term (weight ``lab.warmup_recon``, cells ``lab.warmup_recon_cells``)
        #: or its cluster term (weight ``lab.warmup_clusters``, the cells with a cluster)
        self.unlabelled_rows = None
        self.recon = 0.0 if full else float(lab.warmup_recon)
        if self.recon:
            unl = labels < 0
            if lab.warmup_recon_cells == "labelled_batches":
                unl &= ~query_batch_cells(labels, data.domain_np)
            self.unlabelled_rows = np.flatnonzero(unl)
        self.clusters, self.c_all = 0.0, None
        if not full and lab.warmup_clusters and cluster_targets is not None:
            self.clusters = float(lab.warmup_clusters)
            self.c_all = torch.as_tensor(cluster_targets, device=data.device)
            self.unlabelled_rows = np.flatnonzero((cluster_targets >= 0) & (labels < 0))
        self._u_batches: list | None = None  # built at the first refresh, read at every one

    def start_epoch(self, net: OrcaNet, epoch: int) -> dict:
        lab = self.lab
        with stage("margin refresh"):
            if self._u_batches is None and _affordable(self.data, self.u_rows.size):
                self._u_batches = uncertainty_batches(self.data, self.u_rows, self.comm)
            u = mean_uncertainty(net, self.data, self.u_rows, self.comm, self._u_batches)
        self.margin = adaptive_margin(lab.margin, u, lab.lam, MAX_MARGIN, lab.fixed_margin)
        plan = self.plan
        self.anchored = self.y_anchor is not None and epoch < plan.warmup + plan.anchor
        return {"uncertainty": u, "margin": self.margin, "warmup": not self.full,
                "anchored": self.anchored}  # fmt: skip

    def may_stop(self, epoch: int) -> bool:
        return not self.anchored  # the anchor epochs are a fixed part of the objective

    def __call__(self, model: torch.nn.Module, item: CellBatch) -> tuple[torch.Tensor, ...]:
        idx = item.rows
        if self.clusters:
            return warmup_cluster_terms(
                model, item.x, self.y_all[idx], self.c_all[idx], self.margin, self.clusters
            )
        if self.recon:
            return warmup_recon_terms(
                model, item.x, self.y_all[idx], self.data.domain[idx], self.margin, self.recon
            )
        return orca_loss_terms(
            model, item.x, self.y_all[idx], self.margin, self.lab, self.generator,
            full=self.full, prior=self.prior,
            y_anchor=self.y_anchor[idx] if self.anchored else None,
            pair_features=self.pair_features[idx] if self.pair_features is not None else None,
            pair_fixed_only=(self.pair_fixed_only[idx] if self.pair_fixed_only is not None
                             else None),
        )  # fmt: skip


#: the margin's mean uncertainty is taken over at most this many unlabelled cells (a fixed
#: sample): the standard error of a mean of values in [0, 1] is then below 0.005
UNCERTAINTY_CELLS = 10_000


def _uncertainty_rows(unl_idx: np.ndarray, seed: int) -> np.ndarray:
    """The unlabelled cells whose mean uncertainty sets the margin (all, or a fixed sample)."""
    if unl_idx.size <= UNCERTAINTY_CELLS:
        return unl_idx
    rng = np.random.default_rng([seed, 0x0CE7])
    return np.sort(rng.choice(unl_idx, size=UNCERTAINTY_CELLS, replace=False))


def warmup_recon_terms(net, x, y, batch, margin: float, weight: float) -> tuple[torch.Tensor, ...]:
    """The warm-up's supervised term on the labelled cells of a batch that holds every kind of
    cell, plus ``weight`` times the mean squared error of the net's decoder
    (:class:`orca_sc.module.BatchDecoder`, given each cell's embedding and ``batch``) against
    the input of every cell (``Ablation.warmup_recon``; one process). Returns the five terms of
    :func:`orca_loss_terms`, the reconstruction in the regulariser's place.
    """
    if active_shard() is not None:
        raise NotImplementedError("warmup_recon runs on one process")
    logits, z = net(x)
    sup = masked_margin_cross_entropy(logits, y, margin)
    rec = F.mse_loss(net.decoder(z, batch), dense_input(x))
    zero = logits.sum() * 0.0
    return sup + weight * rec, sup, zero, rec, zero


def warmup_cluster_terms(net, x, y, c, margin: float, weight: float) -> tuple[torch.Tensor, ...]:
    """The warm-up's supervised term on the labelled cells of a batch that holds unlabelled
    cells too, plus ``weight`` times the mean cross-entropy of the net's cluster head against
    the Leiden cluster ``c`` of each cell that has one (``-1``: none;
    ``Ablation.warmup_clusters``; one process). Returns the five terms of
    :func:`orca_loss_terms`, the cluster term in the regulariser's place.
    """
    if active_shard() is not None:
        raise NotImplementedError("warmup_clusters runs on one process")
    logits, z = net(x)
    sup = masked_margin_cross_entropy(logits, y, margin)
    aux = F.cross_entropy(net.cluster_head(z), c, ignore_index=-1, reduction="sum")
    aux = aux / (c >= 0).sum().clamp_min(1)
    zero = logits.sum() * 0.0
    return sup + weight * aux, sup, zero, aux, zero


def orca_loss_terms(
    net, x, y, margin: float, lab: Ablation, gen: torch.Generator | None, *, full: bool,
    prior=None, y_anchor=None, pair_features=None, pair_fixed_only=None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Eq. 1 on one batch: L = L_S + eta1 L_P + eta2 R, each term switchable (``full=False``:
    the warm-up's supervised term alone). ``prior``, ``y_anchor`` and ``pair_features``: the
    phase's per-cell tensors taken for this batch. With ``y_anchor`` (``-1`` for cells not
    anchored) ``anchor_weight`` times the plain cross-entropy of the anchored candidate novel
    cells towards their clusters' heads is added (no margin: the margin eases seen classes, not
    candidates). Returns ``(loss, supervised, pairwise, regulariser, anchor)``.

    In a step on several processes (:func:`orca_sc._dist.active_shard`) ``x`` is this rank's
    part of the batch whose labels etc. are given; the net's outputs are gathered, so the loss
    is that of the whole batch.
    """
    shard = active_shard()
    if not full:  # the warm-up's batches hold labelled cells only
        logits, _ = net(x)  # (B, K)
        if shard is not None:
            logits = shard.gather(logits)
        zero = logits.sum() * 0.0
        sup = margin_cross_entropy(logits, y, margin) if lab.supervised else zero
        return sup, sup, zero, zero, zero
    (logits, feat), (logits2, _) = net(x, views=2)  # two dropout masks
    if shard is not None:  # one exchange for the three
        k, d = logits.shape[1], feat.shape[1]
        joined = shard.gather(torch.cat([logits, logits2, feat], dim=1))
        logits, logits2, feat = joined[:, :k], joined[:, k : 2 * k], joined[:, 2 * k : 2 * k + d]
    zero = logits.sum() * 0.0
    anchor = zero
    if y_anchor is not None:
        anchor = masked_margin_cross_entropy(logits, y_anchor, 0.0)
    similarity = None
    if pair_features is None:  # pair_space="embedding"
        space = feat
    elif lab.pair_space == "query_pca" and pair_fixed_only is not None:
        space = feat  # its shape only: the partners are read in the two similarities
        similarity = split_cosine_similarity(pair_features, feat, pair_fixed_only)
    elif lab.pair_space in ("both", "query_pca"):  # "query_pca" without a query cell
        space = joint_cosine_features(pair_features, feat)
    else:
        space = pair_features
    terms = orca_objective(
        logits,
        logits2,
        space,
        y,
        margin,
        eta1=lab.eta1,
        eta2=lab.eta2,
        prior=prior,
        generator=gen,
        mutual=lab.mutual_pairs,
        supervised=lab.supervised,
        regularizer=lab.regularizer,
        pair_similarity=similarity,
    )
    loss = terms.loss + lab.anchor_weight * anchor
    return loss, terms.supervised, terms.pairwise, terms.regularizer, anchor
