"""A trained image model read out: its heads' predictions and embedding of a split, and the paper's
accuracies (seen, novel and all classes, novel clusters matched by the Hungarian algorithm).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .. import metrics as M
from ._data import ImageData, ImageSource
from ._nets import VisionOrcaNet
from ._split import OpenWorldSplit


def evaluate_heads(y_true: np.ndarray, heads: np.ndarray, n_seen: int) -> dict[str, float]:
    """Open-world metrics of head predictions ``heads`` against class indices ``y_true``.

    ``seen``: accuracy on seen-class images; ``novel``: Hungarian accuracy on novel-class images;
    ``all``: Hungarian accuracy over all; ``novel_nmi``; ``novel_called_novel``: share of
    novel-class images given a novel head; ``seen_called_novel``: share of seen-class images
    given a novel head; ``novel_found``: novel heads holding at least 1% of the novel-class images
    (or one image), to set beside the true number of novel classes.
    """
    y_true = np.asarray(y_true)
    heads = np.asarray(heads)
    pred = np.where(heads < n_seen, heads, n_seen + 1_000_000 + heads)  # novel heads never a class
    seen = [str(c) for c in range(n_seen)]
    is_seen = y_true < n_seen
    called_novel = heads >= n_seen
    n_novel_imgs = int((~is_seen).sum())
    counts = np.bincount(heads[called_novel] - n_seen) if called_novel.any() else np.zeros(0)
    found = int((counts >= max(1, 0.01 * n_novel_imgs)).sum())
    return {
        "seen": M.seen_accuracy(y_true, pred, seen),
        "novel": M.novel_accuracy(y_true, pred, seen),
        "all": M.all_accuracy(y_true, pred),
        "novel_nmi": M.novel_nmi(y_true, pred, seen),
        "novel_called_novel": float(called_novel[~is_seen].mean()) if n_novel_imgs else math.nan,
        "seen_called_novel": float(called_novel[is_seen].mean()) if is_seen.any() else math.nan,
        "novel_found": found,
        "novel_true": int(np.unique(y_true[~is_seen]).size),
    }


@torch.no_grad()
def predict(
    net: VisionOrcaNet,
    source: ImageSource,
    augment,
    device: torch.device,
    rows: np.ndarray | None = None,
    batch_size: int = 1024,
    features: bool = False,
    workers: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Head index, max softmax and (``features=True``) L2-normalised backbone features of the
    images ``rows`` (default all), in eval mode on the test view.
    """
    net.eval()
    rows = np.arange(len(source)) if rows is None else np.asarray(rows)
    heads, conf, feats = [], [], []
    batches = [rows[i : i + batch_size] for i in range(0, rows.size, batch_size)]
    for x in source.batches(batches, device, workers):
        logits, z = net(augment.test_view(x))
        p = F.softmax(logits.float(), dim=1)
        c, h = p.max(dim=1)
        heads.append(h)
        conf.append(c)
        if features:
            feats.append(F.normalize(z.float(), dim=1))
    cat = lambda xs: torch.cat(xs).cpu().numpy() if xs else np.zeros(0)  # noqa: E731
    return cat(heads).astype(np.int64), cat(conf), (cat(feats) if features else None)


@torch.no_grad()
def embed(
    backbone: torch.nn.Module,
    source: ImageSource,
    augment,
    device: torch.device,
    batch_size: int = 1024,
    workers: int = 0,
) -> np.ndarray:
    """L2-normalised backbone features ``(N, D)`` of all images of ``source`` (test view)."""
    backbone.eval()
    n = len(source)
    batches = [np.arange(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    out = [
        F.normalize(backbone(augment.test_view(x)).float(), dim=1).cpu()
        for x in source.batches(batches, device, workers)
    ]
    return torch.cat(out).numpy()


def score(
    net: VisionOrcaNet,
    data: ImageData,
    split: OpenWorldSplit,
    device: torch.device,
    *,
    test: bool = True,
    workers: int = 0,
) -> tuple[dict[str, float], np.ndarray]:
    """:func:`evaluate_heads` on the unlabelled training images (keys ``u_*``) and, with
    ``test``, on the test split (``t_*``); also the unlabelled images' max softmax (whose mean
    sets the next epoch's margin).
    """
    u_heads, u_conf, _ = predict(
        net, data.train, data.augment, device, split.unlabelled, workers=workers
    )
    ev = evaluate_heads(data.y_train[split.unlabelled], u_heads, split.n_seen)
    out = {f"u_{k}": v for k, v in ev.items()}
    if test:
        t_heads, _, _ = predict(net, data.test, data.augment, device, workers=workers)
        ev = evaluate_heads(data.y_test, t_heads, split.n_seen)
        out |= {f"t_{k}": v for k, v in ev.items()}
    return out, u_conf
