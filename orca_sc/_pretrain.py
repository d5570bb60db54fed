"""Self-supervised pretraining of the backbone on every cell, labelled or not (a study of "ORCA
core 5": ``Ablation.pretrain``; off by default).

The paper pretrains its image backbones with SimCLR on the labelled and unlabelled images
together and then freezes the first layers (Cao et al. 2022, §4 "Self-supervised
pretraining"); its single-cell runs start from random weights. Cells have no crops or colour
jitter: the two views of a cell are its expression with a random share of its genes replaced by
the same genes' values in other cells of the mini-batch (SCARF, Bahri et al. 2022), and the
backbone with a small projection head learns to tell which two views come from the same cell
(NT-Xent, the SimCLR loss). A backbone trained on the labelled types alone keeps only what
separates them, so a novel type its head claims looks like that type; one trained to tell every
cell from every other keeps the query's own structure.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch
from torch import nn

from ._ablation import Ablation
from ._cells import CellMatrix
from ._config import OrcaConfig
from .losses import nt_xent
from .module import MLPBackbone, Projector

#: width of the projection head's output (the contrastive loss reads it, nothing else does)
PROJECTION_DIM = 64
#: the NT-Xent temperature (SCARF's)
TEMPERATURE = 1.0


def corrupt(
    x: torch.Tensor, rate: float, gen: torch.Generator, kind: str = "scarf"
) -> torch.Tensor:
    """A view of a batch ``(B, G)``: each value, with probability ``rate``, replaced by the same
    gene's value in a cell of the batch drawn at random (``kind="scarf"``, SCARF's), or by zero
    (``"mask"``: the gene not detected, as in a shallower library).
    """
    shape, dev = x.shape, x.device
    replace = torch.rand(shape, generator=gen, device=gen.device).to(dev) < rate
    if kind == "mask":
        return x.masked_fill(replace, 0.0)
    donor = torch.randint(0, shape[0], shape, generator=gen, device=gen.device).to(dev)
    return torch.where(replace, torch.gather(x, 0, donor), x)


def batch_partners(pcs: np.ndarray, labels: np.ndarray, domain: np.ndarray, k: int = 20,
                   vouch: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Each cell's partners in other batches (``pretrain_pairs="mnn"``): the mutual nearest
    neighbours (cosine in the PCA ``pcs``, ``k`` each way) between the cells of the batches with
    labelled cells and those of each batch without any. With ``vouch`` (a label per cell, -1
    for none; ``pretrain_pairs="vouched"``, :func:`vouched_labels`) only the pairs of a labelled
    cell and a query cell vouched for as its type are kept. Returns ``(ptr, idx)``: cell ``i``'s
    partners are ``idx[ptr[i]:ptr[i + 1]]`` (none for most cells of a type one side lacks).
    """
    from ._discover.labels import query_batch_cells
    from ._integrate import _mnn_pairs, _unit

    n = pcs.shape[0]
    query = query_batch_cells(labels, domain)
    ref = np.flatnonzero(~query)
    src, dst = [], []
    for d in np.unique(domain[query]):  # loop over query batches, not cells
        q = np.flatnonzero(domain == d)
        i, j = _mnn_pairs(_unit(pcs[ref]), _unit(pcs[q]), k)
        if vouch is not None:
            keep = (vouch[q[j]] >= 0) & (labels[ref[i]] == vouch[q[j]])
            i, j = i[keep], j[keep]
        src += [ref[i], q[j]]
        dst += [q[j], ref[i]]
    src = np.concatenate(src) if src else np.empty(0, dtype=np.int64)
    dst = np.concatenate(dst) if dst else np.empty(0, dtype=np.int64)
    order = np.argsort(src, kind="stable")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.add.at(ptr, src + 1, 1)
    return np.cumsum(ptr), dst[order]


def vouched_labels(
    similarity: np.ndarray, labels: np.ndarray, quantile: float = 0.05
) -> np.ndarray:
    """The label each unlabelled cell is vouched for (-1 where none): the seen head that scores
    it best (``similarity``, ``(n, n_seen)``, cosines of a warm-up net), where its cosine is at
    least the ``quantile`` of that head's labelled cells' own best cosines (in sample); a
    labelled cell vouches for its label.
    """
    best, head = similarity.max(axis=1), similarity.argmax(axis=1)
    lab = labels >= 0
    bar = np.full(similarity.shape[1], np.inf)
    for t in np.unique(labels[lab]):  # loop over types, not cells
        own = lab & (labels == t) & (head == t)
        if own.any():
            bar[t] = np.quantile(best[own], quantile)
    return np.where(lab, labels, np.where(best >= bar[head], head, -1))


def pretrain_backbone(
    cells: CellMatrix, config: OrcaConfig, lab: Ablation, seed: int,
    rows: np.ndarray | None = None, partners: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:  # fmt: skip
    """A backbone trained for ``lab.pretrain_steps`` steps of NT-Xent on views
    (:func:`corrupt`, ``lab.pretrain_corruption`` of the genes replaced) of mini-batches drawn
    from the cells ``rows`` of ``cells`` (all by default), with its own random streams
    (``seed``; the caller's are left as they were). With ``partners`` (:func:`batch_partners`)
    a cell that has some is paired with one of them drawn at random (its second view is the
    partner's), so that the two views of a pair share a type across batches, not one cell.
    Returns its ``state_dict`` (which the warm-ups start from) and a record: the settings, the
    cells read, the share of views that were a partner's, the loss over the first and the last
    tenth of the steps, and the seconds.
    """
    t0 = time.perf_counter()
    dev = cells.device
    rows = np.arange(cells.shape[0]) if rows is None else np.asarray(rows, dtype=np.int64)
    n = rows.size
    size = min(config.batch_size, n)
    rng = np.random.default_rng([seed, 0x5CA2F])
    gen_device = dev if dev.type == "cuda" else torch.device("cpu")
    gen = torch.Generator(device=gen_device).manual_seed(seed + 0x5CA2F)
    devices = [dev] if dev.type == "cuda" else []
    losses, n_paired = [], 0
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + 0x5CA2F)
        backbone = MLPBackbone(cells.shape[1], config.hidden_dims, config.dropout).to(dev)
        d = config.hidden_dims[1]
        projection = Projector(d, PROJECTION_DIM).to(dev)
        params = itertools.chain(backbone.parameters(), projection.parameters())
        opt = torch.optim.Adam(params, lr=config.lr)
        backbone.train()
        for _ in range(lab.pretrain_steps):  # loop over optimiser steps, not cells
            idx = rows[np.sort(rng.choice(n, size, replace=False))]
            x = cells.dense_batch(idx)
            rate, kind = lab.pretrain_corruption, lab.pretrain
            a = projection(backbone(corrupt(x, rate, gen, kind)))
            if partners is not None and partners[1].size:
                ptr, pidx = partners
                count = ptr[idx + 1] - ptr[idx]
                pick = ptr[idx] + np.floor(rng.random(idx.size) * count).astype(np.int64)
                other = np.where(count > 0, pidx[np.minimum(pick, pidx.size - 1)], idx)
                x = cells.dense_batch(other)
                n_paired += int((count > 0).sum())
            b = projection(backbone(corrupt(x, rate, gen, kind)))
            loss = nt_xent(a, b, TEMPERATURE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    state = {k: v.detach().clone() for k, v in backbone.state_dict().items()}
    tenth = max(1, len(losses) // 10)
    values = torch.stack(losses).cpu().numpy() if losses else np.zeros(1)
    record = {
        "method": lab.pretrain,
        "steps": lab.pretrain_steps,
        "corruption": lab.pretrain_corruption,
        "cells": int(n),
        "pairs": lab.pretrain_pairs,
        "paired_share": n_paired / max(1, lab.pretrain_steps * size),
        "frozen_first_layer": lab.pretrain_freeze,
        "loss_first": float(values[:tenth].mean()),
        "loss_last": float(values[-tenth:].mean()),
        "seconds": time.perf_counter() - t0,
    }
    return state, record


def start_from(net: nn.Module, state: dict[str, torch.Tensor] | None, freeze: bool) -> None:
    """``net``'s backbone set to the pretrained ``state`` (nothing where it is ``None``) and,
    with ``freeze``, its first layer and that layer's BatchNorm scale and shift kept fixed from
    then on (the paper freezes the pretrained first layers; their BatchNorm statistics still
    follow the batches).
    """
    if state is None:
        return
    net.backbone.load_state_dict(state)
    if freeze:
        bb = net.backbone
        for p in itertools.chain(bb.first_layer.parameters(), bb.first_norm.parameters()):
            p.requires_grad_(False)
