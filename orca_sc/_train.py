"""ORCA's training loop (paper Algorithm 1) and batched inference. Torch and numpy only."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from ._config import HEAD_SCALE, OrcaConfig
from .module import (
    OrcaNet,
    entropy_regularizer,
    joint_cosine_features,
    margin_cross_entropy,
    pairwise_loss,
    select_pairs,
)

logger = logging.getLogger(__name__)

_INFER_CHUNK = 8192


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or infinite."""


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA if available, else MPS, else CPU; explicit requests are checked."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        msg = f"device={device!r} was requested but no CUDA GPU is available; use device='cpu' or 'auto'."
        raise ValueError(msg)
    if device == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            msg = "device='mps' was requested but MPS is not available; use device='cpu' or 'auto'."
            raise ValueError(msg)
    return torch.device(device)


class DeviceCSR:
    """A CSR matrix held as three tensors on the training device; rows are densified per batch.

    ``rows(idx)`` gathers the requested rows into a dense ``(len(idx), G)`` tensor with vectorised
    index arithmetic (no Python loop), then applies the per-batch affine transform.
    """

    def __init__(
        self,
        X: sp.csr_matrix,
        domain: np.ndarray,
        scale: np.ndarray,
        offset: np.ndarray,
        device: torch.device,
    ) -> None:
        self.shape = X.shape
        self.device = device
        self.indptr = torch.as_tensor(X.indptr.astype(np.int64), device=device)
        self.indices = torch.as_tensor(X.indices.astype(np.int64), device=device)
        self.data = torch.as_tensor(X.data.astype(np.float32), device=device)
        self.domain = torch.as_tensor(domain.astype(np.int64), device=device)
        self.scale = torch.as_tensor(scale, dtype=torch.float32, device=device)
        self.offset = torch.as_tensor(offset, dtype=torch.float32, device=device)
        self.identity = bool(np.all(scale == 1) and np.all(offset == 0))

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        start = self.indptr[idx]
        counts = self.indptr[idx + 1] - start  # (B,)
        out = torch.zeros((idx.shape[0], self.shape[1]), device=self.device)
        total = int(counts.sum())
        if total:
            row_of = torch.repeat_interleave(torch.arange(idx.shape[0], device=self.device), counts)
            # position of each gathered entry inside its row, then its global position in data
            first = torch.cumsum(counts, 0) - counts
            pos = torch.arange(total, device=self.device) - first[row_of] + start[row_of]
            out[row_of, self.indices[pos]] = self.data[pos]
        if not self.identity:
            d = self.domain[idx]
            out = out * self.scale[d] + self.offset[d]
        return out


@dataclass
class TrainResult:
    net: OrcaNet
    history: list[dict]
    n_epochs: int
    n_steps: int
    seconds: float
    device: str
    novel_info: dict


def _schedule(n_cells: int, config: OrcaConfig) -> tuple[int, int, int, int]:
    """(batches per epoch, epochs, warm-up epochs, anchor epochs): at least ``min_steps``
    optimiser steps; warm-up and anchor phases scale with the number of epochs.
    """
    steps_per_epoch = max(1, math.ceil(n_cells / config.batch_size))
    n_epochs = max(config.epochs, math.ceil(config.min_steps / steps_per_epoch))
    warmup = round(config.warmup_epochs * n_epochs / config.epochs)
    anchor = round(config.anchor_epochs * n_epochs / config.epochs)
    return steps_per_epoch, n_epochs, warmup, anchor


@torch.no_grad()
def mean_uncertainty(net: OrcaNet, data: DeviceCSR, rows: torch.Tensor) -> float:
    """Paper Eq. 4: mean over ``rows`` of ``1 - max softmax``, in eval mode."""
    if rows.numel() == 0:
        return 0.0
    net.eval()
    total = 0.0
    for chunk in torch.split(rows, _INFER_CHUNK):
        logits, _ = net(data.rows(chunk))
        total += float((1 - F.softmax(logits, dim=1).amax(dim=1)).sum())
    return total / rows.numel()


def train(
    X: sp.csr_matrix,
    labels: np.ndarray,
    domain: np.ndarray,
    scale: np.ndarray,
    offset: np.ndarray,
    n_heads: int,
    config: OrcaConfig,
    novel_init: Callable[[OrcaNet, DeviceCSR], tuple[torch.Tensor, dict]] | None = None,
    pair_features: np.ndarray | None = None,
) -> TrainResult:
    """Fit an :class:`OrcaNet` with the ORCA objective. Same seed and device give the same net.

    With ``novel_init`` and warm-up epochs, the net starts with ``n_heads`` (the seen classes) and
    ``novel_init(net, data)`` is called after the warm-up: it returns the initial weights of the
    novel heads ``(n_novel, D)`` (e.g. prototypes of candidate novel clusters in the warmed-up
    embedding), which are appended to the head before the full objective starts.
    """
    device = resolve_device(config.device)
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(config.seed)
        result = _train(
            X, labels, domain, scale, offset, n_heads, config, device, novel_init, pair_features
        )
    result.seconds = time.perf_counter() - t0
    return result


def _train(
    X, labels, domain, scale, offset, n_heads, config, device, novel_init, pair_features
) -> TrainResult:
    from tqdm import tqdm

    rng = np.random.default_rng(config.seed)
    pair_gen = torch.Generator().manual_seed(config.seed)
    data = DeviceCSR(X, domain, scale, offset, device)
    y_all = torch.as_tensor(labels, device=device)
    lab_idx = np.flatnonzero(labels >= 0)
    unl_idx = np.flatnonzero(labels < 0)
    unl_t = torch.as_tensor(unl_idx, device=device)

    net = OrcaNet(X.shape[1], n_heads, config.hidden_dims, config.dropout).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    steps_per_epoch, n_epochs, warmup, anchor = _schedule(X.shape[0], config)
    history: list[dict] = []
    # in a log file (stderr not a terminal) refresh every 10 s instead of many times a second
    tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    bar = tqdm(
        range(n_epochs),
        desc="ORCA",
        unit="epoch",
        disable=not config.progress,
        leave=False,
        mininterval=0.1 if tty else 10.0,
    )
    n_steps = 0
    pair_feats = None
    if pair_features is not None:  # fixed similarity space for the unlabelled cells' partners
        pair_feats = torch.as_tensor(pair_features, dtype=torch.float32, device=device)
    novel_info: dict = {}
    prior = None  # uniform
    y_anchor = None  # candidate novel cells' cluster heads (-1 elsewhere), for the anchor epochs
    for epoch in bar:
        t_epoch = time.perf_counter()
        if novel_init is not None and warmup > 0 and epoch == warmup:
            protos, novel_info = novel_init(net, data)
            net.head.add_heads(protos.to(device))
            if config.prior == "data" and "prior" in novel_info:
                prior = torch.as_tensor(novel_info["prior"], dtype=torch.float32, device=device)
            if "anchor" in novel_info:  # (rows, heads) of the candidate novel cells
                rows_a, heads_a = novel_info.pop("anchor")
                y_anchor = torch.full_like(y_all, -1)
                y_anchor[torch.as_tensor(rows_a, device=device)] = torch.as_tensor(
                    heads_a, dtype=y_all.dtype, device=device
                )
            opt = torch.optim.Adam(net.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        u = mean_uncertainty(net, data, unl_t)
        if config.margin == "adaptive":
            margin = min(config.lam * u, config.max_margin)
        elif config.margin == "fixed":
            margin = config.fixed_margin
        else:
            margin = 0.0
        full = epoch >= warmup
        anchored = y_anchor is not None and epoch < warmup + anchor
        net.train()
        # mini-batches mix labelled and unlabelled cells in proportion; balanced sizes, so the
        # last batch is never tiny
        lab_chunks = np.array_split(rng.permutation(lab_idx), steps_per_epoch)
        unl_chunks = np.array_split(rng.permutation(unl_idx), steps_per_epoch)
        sums = np.zeros(5)
        n_done = 0
        for lc, uc in zip(lab_chunks, unl_chunks, strict=True):
            idx_np = np.concatenate([lc, uc]) if full else lc
            if idx_np.size < 2:
                continue
            idx = torch.as_tensor(idx_np, device=device)
            x = data.rows(idx)  # (B, G)
            y = y_all[idx]  # (B,)
            ya = y_anchor[idx] if anchored else None
            pf = pair_feats[idx] if pair_feats is not None else None
            parts = _losses(net, x, y, margin, full, config, pair_gen, prior, pf, ya)
            loss = parts[0]
            if not torch.isfinite(loss):
                msg = (
                    f"The training loss became {float(loss.detach())} at epoch {epoch + 1}; lower the learning "
                    "rate (lr=...) or check the input for extreme values."
                )
                raise TrainingDivergedError(msg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            n_steps += 1
            n_done += 1
            sums += np.array([float(p.detach()) for p in parts])
        nb = max(1, n_done)
        rec = {
            "epoch": epoch + 1,
            "loss": sums[0] / nb,
            "supervised": sums[1] / nb,
            "pairwise": sums[2] / nb,
            "regularizer": sums[3] / nb,
            "anchor": sums[4] / nb,
            "uncertainty": u,
            "margin": margin,
            "warmup": not full,
            "anchored": anchored,
            "seconds": time.perf_counter() - t_epoch,
        }
        history.append(rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", u=f"{u:.3f}", refresh=False)
    bar.close()
    net.eval()
    return TrainResult(net, history, n_epochs, n_steps, 0.0, str(device), novel_info)


def _losses(net, x, y, margin, full, config, gen, prior, pair_feats=None, y_anchor=None):
    """Eq. 1: L = L_S + eta1 L_P + eta2 R, each term switchable. During the anchor epochs
    (``y_anchor`` given) ``anchor_weight`` times the plain cross-entropy of the anchored candidate
    novel cells towards their clusters' heads is added (no margin: the margin eases seen classes,
    not candidates). Returns ``(loss, supervised, pairwise, regulariser, anchor)``.
    """
    logits, feat = net(x)  # (B, K), (B, D)
    lab = y >= 0
    zero = logits.sum() * 0.0
    sup = (
        margin_cross_entropy(logits[lab], y[lab], margin, HEAD_SCALE) if config.supervised else zero
    )
    if not full:
        return sup, sup, zero, zero, zero
    anchored = y_anchor >= 0 if y_anchor is not None else None
    if anchored is not None and bool(anchored.any()):
        anchor = F.cross_entropy(logits[anchored], y_anchor[anchored])
    else:
        anchor = zero
    prob = F.softmax(logits, dim=1)
    logits2, _ = net(x)  # second view: another dropout mask
    prob2 = F.softmax(logits2, dim=1)
    if pair_feats is None:  # pair_space="embedding"
        space = feat
    elif config.pair_space == "both":
        space = joint_cosine_features(pair_feats, feat)
    else:
        space = pair_feats
    pair_idx = select_pairs(space, y, gen, mutual=config.mutual_pairs)
    pair = pairwise_loss(prob, prob2[pair_idx])
    reg = entropy_regularizer(prob, prior) if config.regularizer else zero
    loss = sup + config.eta1 * pair + config.eta2 * reg + config.anchor_weight * anchor
    return loss, sup, pair, reg, anchor


@torch.no_grad()
def infer(
    net: OrcaNet, data: DeviceCSR, rows: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax probabilities ``(n, K)`` and L2-normalised embeddings ``(n, D)`` in eval mode."""
    net.eval()
    probs, embs = [], []
    if rows is None:
        all_rows = torch.arange(data.shape[0], device=data.device)
    else:
        all_rows = torch.as_tensor(rows, device=data.device)
    for chunk in torch.split(all_rows, _INFER_CHUNK):
        logits, z = net(data.rows(chunk))
        probs.append(F.softmax(logits, dim=1).cpu())
        embs.append(F.normalize(z, dim=1).cpu())
    return torch.cat(probs).numpy(), torch.cat(embs).numpy()
