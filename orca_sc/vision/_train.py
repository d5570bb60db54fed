"""ORCA on images (paper Sec. 4, App. A) and SimCLR pretraining, sharing the single-cell core's
objective (:func:`orca_sc.losses.orca_objective`) and head (:class:`orca_sc.module.NormedLinear`).

Per step: the labelled and unlabelled images of the mini-batch (in proportion) are augmented
twice on the device; the first view's logits and features and the second view's logits go to
:func:`~orca_sc.losses.orca_objective` (margin from the unlabelled images' mean uncertainty,
refreshed every epoch; positive pairs: same class for labelled images, cosine nearest neighbour
in the batch for unlabelled ones). SGD with momentum, step decay of the learning rate. No host
synchronisation inside an epoch: loss terms are summed on the device.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from .._cells import reproducibly, resolve_device
from .._engine import Callback, fit_phase
from .._errors import OrcaInputError
from ..losses import adaptive_margin, nt_xent, orca_objective
from ..module import Projector
from ._config import PretrainConfig, VisionConfig, preset
from ._data import ImageData, ImageSource
from ._eval import embed, evaluate_heads, predict, score
from ._nets import VisionOrcaNet, freeze_all_but_last_block, make_backbone
from ._split import OpenWorldSplit, open_world_split

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ results
@dataclass
class VisionRun:
    """A trained net with its split and per-epoch history (see :func:`train_orca`)."""

    net: VisionOrcaNet
    split: OpenWorldSplit
    config: VisionConfig
    classes: tuple[str, ...]
    history: list[dict] = field(default_factory=list)

    def head_names(self) -> list[str]:
        n_seen = self.split.n_seen
        return list(self.classes[:n_seen]) + [
            f"novel_{k + 1}" for k in range(self.net.head.weight.shape[0] - n_seen)
        ]


# ----------------------------------------------------------------------------- ORCA training
def _autocast(device: torch.device, amp: bool):
    if amp and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class _Streams:
    """The random streams of a run: augmentations (a generator on the device), labelled images'
    pair partners (CPU generator) and batch order (numpy); torch's global stream (weight
    initialisation) is saved with them.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.aug = torch.Generator(device=device).manual_seed(seed)
        self.pairs = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)

    def state(self) -> tuple[dict, dict]:
        """``(tensors, numpy state)``: the first goes in the checkpoint, the second in its JSON."""
        state = {
            "torch": torch.random.get_rng_state(),
            "aug": self.aug.get_state(),
            "pairs": self.pairs.get_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state, self.rng.bit_generator.state

    def restore(self, state: dict, np_state: dict) -> None:
        torch.random.set_rng_state(state["torch"].cpu())
        self.aug.set_state(state["aug"].cpu())
        self.pairs.set_state(state["pairs"].cpu())
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"].cpu())
        self.rng.bit_generator.state = np_state


def _restore(state, meta, modules: dict, opt, sched, streams: _Streams) -> tuple[list[dict], int]:
    """Load a checkpoint's modules, optimiser, schedule and random streams; returns the history
    so far and the number of epochs done.
    """
    for key, module in modules.items():
        module.load_state_dict(state[key])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    streams.restore(state["rng"], meta["numpy_rng"])
    return list(meta["history"]), int(meta["epoch"])


class _ImageBatches:
    """The mini-batches of an image run, drawn from ``rng``: ORCA's (``labelled`` and
    ``unlabelled`` images mixed in proportion in ``steps`` batches) or SimCLR's (all ``n``
    images in batches of ``batch_size``, the last incomplete one dropped).
    """

    def __init__(self, source: ImageSource, device, workers: int, rng, *, labelled=None,
                 unlabelled=None, steps: int = 0, n: int = 0, batch_size: int = 0) -> None:  # fmt: skip
        self.source, self.device, self.workers, self.rng = source, device, workers, rng
        self.labelled, self.unlabelled, self.steps = labelled, unlabelled, steps
        self.n, self.batch_size = n, batch_size
        self.images = 0  # images in the last epoch's batches

    def epoch(self, epoch: int) -> list[np.ndarray]:
        if self.labelled is None:
            perm, bs = self.rng.permutation(self.n), self.batch_size
            batches = [perm[i : i + bs] for i in range(0, self.n - bs + 1, bs)]
        else:
            lab = np.array_split(self.rng.permutation(self.labelled), self.steps)
            unl = np.array_split(self.rng.permutation(self.unlabelled), self.steps)
            batches = [np.concatenate([a, b]) for a, b in zip(lab, unl, strict=True)]
            batches = [b for b in batches if b.size >= 2]
        self.images = sum(b.size for b in batches)
        return batches

    def load(self, batches: list[np.ndarray]):
        images = self.source.batches(batches, self.device, self.workers)
        return zip(batches, images, strict=True)


class _ImageOrcaLoss:
    """ORCA's objective on two augmented views of each image; the margin from the unlabelled
    images' mean uncertainty ``u_conf`` (their max softmax, refreshed after every epoch).
    """

    terms = ("loss", "supervised", "pairwise", "regularizer")

    def __init__(self, config: VisionConfig, targets, aug, streams, opt, u_conf) -> None:
        self.config, self.targets, self.aug, self.streams, self.opt = (
            config, targets, aug, streams, opt,
        )  # fmt: skip
        self.u_conf = u_conf
        self.margin = 0.0

    def start_epoch(self, net, epoch: int) -> dict:
        c = self.config
        u = float(1.0 - self.u_conf.mean()) if self.u_conf.size else 0.0
        self.margin = adaptive_margin(c.margin, u, c.lam, c.max_margin, c.fixed_margin)
        return {"uncertainty": u, "margin": self.margin, "lr": self.opt.param_groups[0]["lr"]}

    def may_stop(self, epoch: int) -> bool:
        return True

    def __call__(self, model, item):
        idx, x = item
        y = self.targets[torch.as_tensor(idx, device=self.targets.device)]
        v1 = self.aug.orca_view(x, self.streams.aug)
        v2 = self.aug.orca_view(x, self.streams.aug)
        with _autocast(x.device, self.config.amp):
            logits, feat = model(v1)
            logits2, _ = model(v2)
        c = self.config
        return tuple(orca_objective(
            logits.float(), logits2.float(), feat.float(), y, self.margin,
            eta1=c.eta1, eta2=c.eta2, generator=self.streams.pairs,
        ))  # fmt: skip


class _SimclrLoss:
    """SimCLR's NT-Xent loss on two augmented views of each image (``model``: backbone then
    projector).
    """

    terms = ("loss",)

    def __init__(self, config: PretrainConfig, aug, streams, opt) -> None:
        self.config, self.aug, self.streams, self.opt = config, aug, streams, opt

    def start_epoch(self, net, epoch: int) -> dict:
        return {"lr": self.opt.param_groups[0]["lr"]}

    def may_stop(self, epoch: int) -> bool:
        return True

    def __call__(self, model, item):
        _, x = item
        v1, v2 = (
            self.aug.simclr_view(x, self.streams.aug),
            self.aug.simclr_view(x, self.streams.aug),
        )
        with _autocast(x.device, self.config.amp):
            z = model(torch.cat([v1, v2]))
        z1, z2 = z.float().chunk(2)
        return (nt_xent(z1, z2, self.config.temperature),)


class _ImageEpochEnd(Callback):
    """After each epoch of an image run: the learning-rate schedule's step, images per
    second, the scores (``score(epoch)``: entries for the record, ORCA only) and the
    checkpoint (``save(epochs_done)``; ``None``: no checkpoint).
    """

    def __init__(self, sched, batches: _ImageBatches, save=None, score=None) -> None:
        self.sched, self.batches, self.save, self.score = sched, batches, save, score

    def on_epoch_end(self, phase: str, net, record: dict) -> None:
        t_end = time.perf_counter()
        self.sched.step()
        train_s = record["seconds"]
        record["train_seconds"] = train_s
        record["images_per_s"] = self.batches.images / train_s
        if self.score is not None:
            record.update(self.score(record["epoch"] - 1))
        record["seconds"] = train_s + time.perf_counter() - t_end
        if self.save is not None:
            self.save(record["epoch"])


def _score_epoch(net, data, split, dev, config, epoch: int, loss: _ImageOrcaLoss) -> dict:
    """:func:`score` after ``epoch`` (the test split every epoch with ``eval_test``, else the
    last); the unlabelled images' max softmax sets the next epoch's margin.
    """
    test = config.eval_test or epoch + 1 == config.epochs
    scores, loss.u_conf = score(net, data, split, dev, test=test, workers=config.workers)
    return scores


@reproducibly
def train_orca(
    data: ImageData,
    config: VisionConfig | None = None,
    *,
    pretrained: str | Path | None = None,
    device: str = "auto",
    progress: bool = True,
    checkpoint: str | Path | None = None,
    resume: str | Path | None = None,
) -> VisionRun:
    """Train ORCA on ``data`` with the paper's open-world split and return a :class:`VisionRun`.

    ``pretrained``: a SimCLR checkpoint from :func:`pretrain_simclr` whose backbone starts the
    run. ``checkpoint``: written after every epoch (``.pt`` state + ``.json`` metadata);
    ``resume``: a checkpoint of an interrupted run to continue (same data and configuration; the
    continued run matches an uninterrupted one on the same device). Each epoch's history
    record holds the loss terms, margin, learning rate, images/s and the metrics of
    :func:`evaluate_heads` on the unlabelled training images (``u_*``, transductive, as the
    paper) and on the test split (``t_*``, inductive).
    """
    from . import _checkpoint as C

    config = config or preset(data.name)
    dev = resolve_device(device)
    state = None
    if resume is not None:
        state, meta = C.load_checkpoint(resume, kind="orca", device=dev)
        C.check_same_run(meta, asdict(config), data)
    split = open_world_split(
        data.y_train, data.n_classes, config.seen_fraction, config.labelled_fraction, config.seed
    )
    n_heads = config.head_multiplier * data.n_classes
    targets = torch.as_tensor(split.targets(data.y_train), device=dev)
    freeze = config.freeze if config.freeze is not None else pretrained is not None
    aug = data.augment
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(config.seed)
        net = VisionOrcaNet(config.arch, n_heads, data.in_channels).to(dev)
        if pretrained is not None and state is None:
            C.load_backbone(net.backbone, pretrained, config.arch, data.in_channels, dev)
        params = freeze_all_but_last_block(net) if freeze else list(net.parameters())
        opt = torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, list(config.milestones), gamma=0.1)
        streams = _Streams(config.seed, dev)
        history: list[dict] = []
        start = 0
        if state is not None:
            history, start = _restore(state, meta, {"model": net}, opt, sched, streams)
        run = VisionRun(net, split, config, data.classes, history)
        steps = max(1, math.ceil(len(data.train) / config.batch_size))
        _, u_conf, _ = predict(net, data.train, aug, dev, split.unlabelled, workers=config.workers)
        loss = _ImageOrcaLoss(config, targets, aug, streams, opt, u_conf)
        batches = _ImageBatches(
            data.train,
            dev,
            config.workers,
            streams.rng,
            labelled=split.labelled,
            unlabelled=split.unlabelled,
            steps=steps,
        )

        def save(epochs_done: int) -> None:
            rng_state, np_state = streams.state()
            C.save_checkpoint(
                checkpoint,
                {"model": net.state_dict(), "optimizer": opt.state_dict(),
                 "scheduler": sched.state_dict(), "rng": rng_state},
                C.orca_meta(run, data, epochs_done, np_state),
            )  # fmt: skip

        end = _ImageEpochEnd(
            sched, batches, save if checkpoint is not None else None,
            score=lambda epoch: _score_epoch(net, data, split, dev, config, epoch, loss),
        )  # fmt: skip
        fit_phase(
            net, loss, batches, opt, range(start, config.epochs), phase="orca (images)",
            callbacks=[end], history=history, desc="ORCA (images)", progress=progress,
        )  # fmt: skip
    net.eval()
    return run


# ---------------------------------------------------------------------------------- SimCLR
@dataclass
class PretrainRun:
    backbone: torch.nn.Module
    projector: Projector
    config: PretrainConfig
    history: list[dict] = field(default_factory=list)


@reproducibly
def pretrain_simclr(
    data: ImageData,
    config: PretrainConfig | None = None,
    *,
    device: str = "auto",
    progress: bool = True,
    checkpoint: str | Path | None = None,
    resume: str | Path | None = None,
) -> PretrainRun:
    """SimCLR pretraining of a backbone on all training images of ``data`` (labelled and
    unlabelled; the test split is never seen). ``checkpoint``/``resume`` as in :func:`train_orca`.
    """
    from . import _checkpoint as C

    config = config or PretrainConfig()
    dev = resolve_device(device)
    state = meta = None
    if resume is not None:
        state, meta = C.load_checkpoint(resume, kind="simclr", device=dev)
        C.check_same_run(meta, asdict(config), data)
    if len(data.train) < 2:
        raise OrcaInputError("SimCLR needs at least 2 training images.")
    aug = data.augment
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(config.seed)
        backbone = make_backbone(config.arch, data.in_channels).to(dev)
        projector = Projector(backbone.out_dim, config.proj_dim).to(dev)
        params = list(backbone.parameters()) + list(projector.parameters())
        opt = torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=config.epochs)
        streams = _Streams(config.seed, dev)
        history: list[dict] = []
        start = 0
        if state is not None:
            modules = {"backbone": backbone, "projector": projector}
            history, start = _restore(state, meta, modules, opt, sched, streams)
        run = PretrainRun(backbone, projector, config, history)
        n = len(data.train)
        bs = min(config.batch_size, n)
        loss = _SimclrLoss(config, aug, streams, opt)
        batches = _ImageBatches(data.train, dev, config.workers, streams.rng, n=n, batch_size=bs)

        def save(epochs_done: int) -> None:
            rng_state, np_state = streams.state()
            C.save_checkpoint(
                checkpoint,
                {"backbone": backbone.state_dict(), "projector": projector.state_dict(),
                 "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "rng": rng_state},
                C.simclr_meta(run, data, epochs_done, np_state),
            )  # fmt: skip

        end = _ImageEpochEnd(sched, batches, save if checkpoint is not None else None)
        both = torch.nn.Sequential(backbone, projector)
        fit_phase(
            both, loss, batches, opt, range(start, config.epochs), phase="simclr",
            callbacks=[end], history=history, desc="SimCLR", progress=progress,
        )  # fmt: skip
    backbone.eval()
    return run


# --------------------------------------------------------------------------- KMeans baseline
@reproducibly
def kmeans_baseline(
    backbone: torch.nn.Module,
    data: ImageData,
    split: OpenWorldSplit,
    *,
    device: str = "auto",
    seed: int = 0,
) -> dict[str, float]:
    """The paper's K-means baseline on frozen (SimCLR) features: K-means with one cluster per
    class on the L2-normalised features of all training images; clusters are matched one-to-one
    to seen classes by the labelled images (Hungarian), the others are novel clusters. Scored by
    :func:`evaluate_heads` on the unlabelled images (``u_*``) and on the test split, each test
    image in its nearest centroid's cluster (``t_*``).
    """
    from scipy.optimize import linear_sum_assignment
    from sklearn.cluster import KMeans

    dev = resolve_device(device)
    feats = embed(backbone, data.train, data.augment, dev)
    km = KMeans(n_clusters=data.n_classes, n_init=10, random_state=seed).fit(feats)
    cl = km.labels_
    lab = split.labelled
    w = np.zeros((data.n_classes, split.n_seen), dtype=np.int64)
    np.add.at(w, (cl[lab], data.y_train[lab]), 1)
    rows, cols = linear_sum_assignment(w, maximize=True)
    head_of = np.full(data.n_classes, -1, dtype=np.int64)
    head_of[rows] = cols  # matched cluster -> its seen class
    rest = np.flatnonzero(head_of < 0)
    head_of[rest] = split.n_seen + np.arange(rest.size)
    out = evaluate_heads(
        data.y_train[split.unlabelled], head_of[cl[split.unlabelled]], split.n_seen
    )
    test_cl = km.predict(embed(backbone, data.test, data.augment, dev))
    test = evaluate_heads(data.y_test, head_of[test_cl], split.n_seen)
    return {f"u_{k}": v for k, v in out.items()} | {f"t_{k}": v for k, v in test.items()}
