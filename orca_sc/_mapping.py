"""A separate query mapped onto the frozen reference nets (``Ablation.query_mapping="frozen"``,
a study of "ORCA core 5", not the default).

As scArches maps a query onto a reference model, the nets trained on the labelled cells alone
(the warm-up and the cross-fitted warm-ups) are frozen and each batch without labelled cells
learns only parameters of its own: an offset of the first layer's input, added to the batch's
alignment (the centroid shift), so that no query cell can move a known head, and discovery reads
novelty against the frozen reference. The offset is confined to the reference's principal
directions (the leading components of the labelled cells' aligned expression: ``n_comps``
coefficients, not one per gene) and fitted, by Adam on the frozen nets, to the query cells
matched to a known type with confidence, as :func:`orca_sc._align.centroid_shift` matches them:
each cell's best head is the one its mean cosine over the nets is highest to, and a type keeps
only its ``frac * n / K`` most similar cells (re-matched at every step), so cells of types the
reference lacks, which match no head well, hardly pull. The loss is those cells' cosine
distance to their matched head (what novelty is read on), averaged over the nets, each type
with equal weight.

The PCA behind discovery's graphs keeps the batch's centroid shift (the offset is a parameter of
the nets' input only); a saved model aligns new data with the centroid shift alone, and the
size check of large data repeats discovery without the mapping.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from ._align import aligned_rows
from ._discover.labels import query_batch_cells
from .module import OrcaNet

#: optimiser steps of the query's offset (full batch of its sampled cells)
MAP_STEPS = 100
#: Adam's learning rate, in units of the reference's principal coordinates
MAP_LR = 0.05
#: at most this many cells of a query batch fit its offset, and of the labelled cells its PCA
MAP_CELLS = 4_096
#: a known type keeps this share of ``n / K`` of the cells matched to it (as the centroid shift)
MAP_FRAC = 0.5


def reference_directions(
    X: sp.csr_matrix,
    labels: np.ndarray,
    domain: np.ndarray,
    scale: np.ndarray,
    offset: np.ndarray,
    n_comps: int,
    seed: int,
) -> torch.Tensor:
    """The ``n_comps`` leading principal directions ``(n_comps, G)`` of the labelled cells'
    aligned expression (at most :data:`MAP_CELLS` of them, at random).
    """
    lab = np.flatnonzero(labels >= 0)
    if lab.size > MAP_CELLS:
        lab = np.sort(np.random.default_rng([seed, 0x3A9]).choice(lab, MAP_CELLS, replace=False))
    dense = torch.from_numpy(aligned_rows(X, domain, scale, offset, lab)).double()
    dense -= dense.mean(dim=0)
    _, _, vh = torch.linalg.svd(dense, full_matrices=False)
    return vh[: min(n_comps, vh.shape[0])].float()


def _after_first_layer(net: OrcaNet, h: torch.Tensor) -> torch.Tensor:
    """The frozen net (eval mode) from its first layer's output ``h`` to its cosines to the
    seen heads.
    """
    z = net.backbone.after_first_layer(h)
    return F.normalize(z, dim=1) @ F.normalize(net.head.weight, dim=1).T


def _matched(cos: torch.Tensor, frac: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``cos`` ``(n, K)`` matched to a head with confidence, and the head: each row's best
    head, kept among that head's ``frac * n / K`` most similar rows.
    """
    n, k = cos.shape
    best = cos.argmax(dim=1)
    top = cos.gather(1, best[:, None]).ravel()
    m = max(1, int(np.ceil(frac * n / k)))
    keep = []
    for t in torch.unique(best).tolist():  # loop over known types, not cells
        rows = torch.nonzero(best == t).ravel()
        keep.append(rows[torch.argsort(-top[rows], stable=True)[:m]])
    rows = torch.cat(keep)
    return rows, best[rows]


def fit_query_offsets(
    nets: list[OrcaNet],
    X: sp.csr_matrix,
    labels: np.ndarray,
    domain: np.ndarray,
    scale: np.ndarray,
    offset: np.ndarray,
    *,
    n_comps: int = 30,
    seed: int = 0,
    steps: int = MAP_STEPS,
    lr: float = MAP_LR,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Each batch without labelled cells given an offset of its own on top of ``offset``, fitted
    on the frozen ``nets`` (see the module): returns the new ``(n_batches, G)`` offsets and the
    record (per batch: cells fitted, the offset's norm, the matched cells' mean cosine before
    and after).
    """
    new = np.array(offset, dtype=np.float32, copy=True)
    queries = [int(d) for d in np.unique(domain[query_batch_cells(labels, domain)])]
    record: dict[str, Any] = {"method": "frozen", "steps": steps, "batches": {}}
    if not queries or not nets:
        return new, record
    V = reference_directions(X, labels, domain, scale, offset, n_comps, seed)  # (r, G)
    with _frozen(nets):
        return _fit(nets, X, labels, domain, scale, offset, queries, V, new, record, seed,
                    steps, lr)  # fmt: skip


@contextmanager
def _frozen(nets: list[OrcaNet]) -> Iterator[None]:
    """The nets in eval mode with no gradient of their own (restored after)."""
    params = [p for net in nets for p in net.parameters()]
    flags = [p.requires_grad for p in params]
    modes = [net.training for net in nets]
    try:
        for p in params:
            p.requires_grad_(False)
        for net in nets:
            net.eval()
        yield
    finally:
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)
        for net, mode in zip(nets, modes, strict=True):
            net.train(mode)


def _fit(nets, X, labels, domain, scale, offset, queries, V, new, record, seed, steps, lr):
    """:func:`fit_query_offsets` on frozen nets."""
    dev = nets[0].head.weight.device
    V = V.to(dev)
    with torch.no_grad():
        layers = [net.backbone.first_layer for net in nets]
        moves = [V @ first.weight_t for first in layers]  # (r, H): a unit of each coordinate
    for d in queries:  # loop over batches
        rows = np.flatnonzero(domain == d)
        if rows.size > MAP_CELLS:
            rng = np.random.default_rng([seed, 0x3AA, d])
            rows = np.sort(rng.choice(rows, MAP_CELLS, replace=False))
        x = torch.from_numpy(aligned_rows(X, domain, scale, offset, rows)).float().to(dev)
        with torch.no_grad():
            pre = [layer(x) for layer in layers]  # (n, H) each, the centroid-shifted input
        coef = torch.zeros(V.shape[0], device=dev, requires_grad=True)

        def cosines(coef=coef, pre=pre) -> list[torch.Tensor]:  # each net's, at the offset
            pairs = zip(nets, pre, moves, strict=True)
            return [_after_first_layer(n, p + coef @ mv) for n, p, mv in pairs]

        opt = torch.optim.Adam([coef], lr=lr)
        first_cos = None
        for _ in range(steps):
            cos = cosines()
            with torch.no_grad():
                mean = torch.stack(cos).mean(dim=0)
                matched, head = _matched(mean, MAP_FRAC)
                if first_cos is None:
                    first_cos = float(mean.max(dim=1).values[matched].mean())
                counts = torch.bincount(head, minlength=mean.shape[1]).float()
                weight = 1.0 / (counts[head] * int((counts > 0).sum()))
            loss = sum(((1 - c[matched, head]) * weight).sum() for c in cos) / len(nets)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            delta = (coef.detach() @ V).cpu().numpy()
            cos = torch.stack(cosines()).mean(dim=0)
            matched, _ = _matched(cos, MAP_FRAC)
            last_cos = float(cos.max(dim=1).values[matched].mean())
        new[d] += delta
        record["batches"][str(d)] = {
            "cells": int(rows.size),
            "offset_norm": float(np.linalg.norm(delta)),
            "matched_cosine": [first_cos, last_cos],
        }
    return new, record
