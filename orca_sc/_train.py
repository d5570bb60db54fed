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
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from ._config import OrcaConfig
from ._errors import ConfigError
from .module import (
    OrcaNet,
    adaptive_margin,
    joint_cosine_features,
    margin_cross_entropy,
    orca_objective,
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
    if device.startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        if index >= n:
            have = f"{n} CUDA GPU(s)" if n else "no CUDA GPU"
            raise ConfigError("device", device, f"'cpu' or 'auto': this machine has {have}")
    if device == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ConfigError("device", device, "'cpu' or 'auto': MPS is not available here")
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


@dataclass(frozen=True)
class Schedule:
    """Batches per epoch and the number of epochs of each phase (see :func:`schedule`)."""

    steps_per_epoch: int
    n_epochs: int
    warmup: int
    anchor: int


def schedule(n_cells: int, config: OrcaConfig) -> Schedule:
    """At least ``min_steps`` optimiser steps (epochs are added for small data); warm-up and
    anchor phases scale with the number of epochs.
    """
    steps_per_epoch = max(1, math.ceil(n_cells / config.batch_size))
    n_epochs = max(config.epochs, math.ceil(config.min_steps / steps_per_epoch))
    warmup = round(config.warmup_epochs * n_epochs / config.epochs)
    anchor = round(config.anchor_epochs * n_epochs / config.epochs)
    return Schedule(steps_per_epoch, n_epochs, warmup, anchor)


class TrainRandom:
    """The random streams of one training run, carried from the warm-up to the open-world phase
    so that the two phases together draw exactly as one run would: mini-batch order (numpy),
    labelled cells' pair partners (a torch generator) and torch's global stream (weight
    initialisation, dropout), which is saved on leaving a phase and restored on entering the next
    (the caller's global state is left as it was).
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.numpy = np.random.default_rng(seed)
        self.pairs = torch.Generator().manual_seed(seed)
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
    data: DeviceCSR,
    labels: np.ndarray,
    n_seen: int,
    config: OrcaConfig,
    plan: Schedule,
    rand: TrainRandom,
) -> tuple[OrcaNet, list[dict]]:
    """A new :class:`OrcaNet` with one head per seen class, trained for ``plan.warmup`` epochs on
    the labelled cells with the supervised term alone (the margin follows the unlabelled cells'
    uncertainty as in the full objective). Returns the net and one history record per epoch.
    """
    with rand.torch_stream():
        net = OrcaNet(data.shape[1], n_seen, config.hidden_dims, config.dropout).to(data.device)
        history = _run_epochs(net, data, labels, range(plan.warmup), plan, config, rand, full=False)
    return net, history


def fit_open_world(
    net: OrcaNet,
    data: DeviceCSR,
    labels: np.ndarray,
    novel: NovelHeads,
    config: OrcaConfig,
    plan: Schedule,
    rand: TrainRandom,
    pair_features: np.ndarray | None = None,
) -> tuple[OrcaNet, list[dict]]:
    """ORCA's open-world phase (paper Algorithm 1) on all cells: a new net with ``net``'s
    backbone and seen heads plus the novel heads of ``novel``, trained with the full objective
    for the epochs after the warm-up (the first ``plan.anchor`` of them with the anchor term).
    ``pair_features`` ``(n_cells, P)``: a fixed space in which unlabelled cells' pairwise
    partners are also looked for (``config.pair_space``). ``net`` is left as it is.
    """
    dev = data.device
    with rand.torch_stream():
        net = net.with_novel_heads(torch.as_tensor(novel.prototypes, dtype=torch.float32))
        net = net.to(dev)
        prior = None
        if config.prior == "data" and novel.prior is not None:
            prior = torch.as_tensor(novel.prior, dtype=torch.float32, device=dev)
        y_anchor = None
        if novel.anchor_rows.size:
            y_anchor = torch.full((data.shape[0],), -1, dtype=torch.int64, device=dev)
            y_anchor[torch.as_tensor(novel.anchor_rows, device=dev)] = torch.as_tensor(
                novel.anchor_heads, dtype=torch.int64, device=dev
            )
        feats = None
        if pair_features is not None:
            feats = torch.as_tensor(pair_features, dtype=torch.float32, device=dev)
        epochs = range(plan.warmup, plan.n_epochs)
        history = _run_epochs(
            net, data, labels, epochs, plan, config, rand, True, prior, y_anchor, feats
        )
    net.eval()
    return net, history


def epoch_bar(epochs, desc: str, enabled: bool):
    """A tqdm bar over ``epochs`` on stderr; in a log file (stderr not a terminal) it refreshes
    every 10 s instead of many times a second.
    """
    from tqdm import tqdm

    tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    return tqdm(
        epochs,
        desc=desc,
        unit="epoch",
        disable=not enabled,
        leave=False,
        mininterval=0.1 if tty else 10.0,
    )


def _run_epochs(
    net, data, labels, epochs, plan, config, rand, full, prior=None, y_anchor=None, pair_feats=None
) -> list[dict]:
    """Train ``net`` in place over ``epochs`` (epoch numbers of the whole run)."""
    device = data.device
    y_all = torch.as_tensor(labels, device=device)
    lab_idx = np.flatnonzero(labels >= 0)
    unl_idx = np.flatnonzero(labels < 0)
    unl_t = torch.as_tensor(unl_idx, device=device)
    opt = torch.optim.Adam(net.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    history: list[dict] = []
    bar = epoch_bar(epochs, "ORCA" if full else "ORCA warm-up", config.progress)
    for epoch in bar:
        t_epoch = time.perf_counter()
        u = mean_uncertainty(net, data, unl_t)
        margin = adaptive_margin(
            config.margin, u, config.lam, config.max_margin, config.fixed_margin
        )
        anchored = y_anchor is not None and epoch < plan.warmup + plan.anchor
        net.train()
        # mini-batches mix labelled and unlabelled cells in proportion; balanced sizes, so the
        # last batch is never tiny
        lab_chunks = np.array_split(rand.numpy.permutation(lab_idx), plan.steps_per_epoch)
        unl_chunks = np.array_split(rand.numpy.permutation(unl_idx), plan.steps_per_epoch)
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
            parts = _losses(net, x, y, margin, full, config, rand.pairs, prior, pf, ya)
            loss = parts[0]
            if not torch.isfinite(loss):
                msg = (
                    f"The training loss became {float(loss.detach())} at epoch {epoch + 1}; "
                    "lower the learning rate (lr=...) or check the input for extreme values."
                )
                raise TrainingDivergedError(msg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
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
            "steps": n_done,
            "seconds": time.perf_counter() - t_epoch,
        }
        history.append(rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", u=f"{u:.3f}", refresh=False)
    bar.close()
    return history


def _losses(net, x, y, margin, full, config, gen, prior, pair_feats=None, y_anchor=None):
    """Eq. 1: L = L_S + eta1 L_P + eta2 R, each term switchable. During the anchor epochs
    (``y_anchor`` given) ``anchor_weight`` times the plain cross-entropy of the anchored candidate
    novel cells towards their clusters' heads is added (no margin: the margin eases seen classes,
    not candidates). Returns ``(loss, supervised, pairwise, regulariser, anchor)``.
    """
    logits, feat = net(x)  # (B, K), (B, D)
    zero = logits.sum() * 0.0
    if not full:
        lab = y >= 0
        sup = margin_cross_entropy(logits[lab], y[lab], margin) if config.supervised else zero
        return sup, sup, zero, zero, zero
    anchored = y_anchor >= 0 if y_anchor is not None else None
    if anchored is not None and bool(anchored.any()):
        anchor = F.cross_entropy(logits[anchored], y_anchor[anchored])
    else:
        anchor = zero
    logits2, _ = net(x)  # second view: another dropout mask
    if pair_feats is None:  # pair_space="embedding"
        space = feat
    elif config.pair_space == "both":
        space = joint_cosine_features(pair_feats, feat)
    else:
        space = pair_feats
    terms = orca_objective(
        logits,
        logits2,
        space,
        y,
        margin,
        eta1=config.eta1,
        eta2=config.eta2,
        prior=prior,
        generator=gen,
        mutual=config.mutual_pairs,
        supervised=config.supervised,
        regularizer=config.regularizer,
    )
    loss = terms.loss + config.anchor_weight * anchor
    return loss, terms.supervised, terms.pairwise, terms.regularizer, anchor


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
