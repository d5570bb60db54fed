"""The options of the image benchmarks (VisionConfig, PretrainConfig) and the paper's presets of
each dataset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .._errors import ConfigError
from ._nets import ARCHS

#: the paper's names of ORCA and its margin ablations, by ``VisionConfig.margin``
METHOD_NAMES = {"adaptive": "ORCA", "fixed": "ORCA-FNM", "zero": "ORCA-ZM"}


_MARGINS = tuple(METHOD_NAMES)


@dataclass(frozen=True)
class VisionConfig:
    """ORCA training on images. Defaults are the paper's CIFAR protocol (App. A); see
    :func:`preset` for ImageNet-100 and the CPU-sized sets.

    ``head_multiplier``: total heads = multiplier × number of classes (paper Table 12: 100, 200,
    400 heads on CIFAR-100). ``freeze``: train only the backbone's last block and the head
    (``None``: freeze when a pretrained backbone is given, as the paper; train everything when
    starting from random weights). ``eval_test``: score the test split after every epoch (it is
    always scored after the last). ``margin``: ``"adaptive"`` (ORCA), ``"zero"`` (ORCA-ZM),
    ``"fixed"`` (ORCA-FNM, ``fixed_margin`` 0.5). ``amp``: bfloat16 autocast on CUDA.
    """

    arch: str = "resnet18"
    epochs: int = 200
    batch_size: int = 512
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    milestones: tuple[int, ...] = (140, 180)
    margin: str = "adaptive"
    lam: float = 1.0
    max_margin: float = 0.5
    fixed_margin: float = 0.5
    eta1: float = 1.0
    eta2: float = 1.0
    head_multiplier: int = 1
    seen_fraction: float = 0.5
    labelled_fraction: float = 0.5
    freeze: bool | None = None
    seed: int = 0
    amp: bool = False
    workers: int = 0
    eval_test: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "milestones", tuple(int(m) for m in self.milestones))
        _check(self.arch in ARCHS, "arch", self.arch, f"one of {', '.join(ARCHS)}")
        _check(self.margin in _MARGINS, "margin", self.margin, f"one of {', '.join(_MARGINS)}")
        for name in ("epochs", "batch_size", "head_multiplier"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v >= 1, name, v, "a positive integer")
        _check(self.batch_size >= 2, "batch_size", self.batch_size, "at least 2")
        _check(0 < self.lr <= 10 and math.isfinite(self.lr), "lr", self.lr, "a number in (0, 10]")
        for name in (
            "momentum",
            "weight_decay",
            "lam",
            "max_margin",
            "fixed_margin",
            "eta1",
            "eta2",
        ):
            v = getattr(self, name)
            _check(math.isfinite(v) and v >= 0, name, v, "a finite number >= 0")
        _check(0 < self.seen_fraction < 1, "seen_fraction", self.seen_fraction, "in (0, 1)")
        _check(
            0 < self.labelled_fraction <= 1,
            "labelled_fraction",
            self.labelled_fraction,
            "in (0, 1]",
        )
        _check(0 <= self.seed < 2**32, "seed", self.seed, "an integer in [0, 2**32)")
        _check(self.workers >= 0, "workers", self.workers, "an integer >= 0")


@dataclass(frozen=True)
class PretrainConfig:
    """SimCLR pretraining (Chen et al. 2020) on all training images, labelled or not: two views
    per image, NT-Xent with ``temperature``, projection head to ``proj_dim``; Adam with a cosine
    learning-rate decay.
    """

    arch: str = "resnet18"
    epochs: int = 200
    batch_size: int = 512
    lr: float = 1e-3
    weight_decay: float = 1e-6
    temperature: float = 0.5
    proj_dim: int = 128
    seed: int = 0
    amp: bool = False
    workers: int = 0

    def __post_init__(self) -> None:
        _check(self.arch in ARCHS, "arch", self.arch, f"one of {', '.join(ARCHS)}")
        for name in ("epochs", "batch_size", "proj_dim"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v >= 1, name, v, "a positive integer")
        _check(self.batch_size >= 2, "batch_size", self.batch_size, "at least 2")
        _check(0 < self.lr <= 10 and math.isfinite(self.lr), "lr", self.lr, "a number in (0, 10]")
        _check(self.temperature > 0, "temperature", self.temperature, "a number > 0")
        _check(0 <= self.seed < 2**32, "seed", self.seed, "an integer in [0, 2**32)")


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(name, value, expected)


_PRESETS: dict[str, dict[str, Any]] = {
    "cifar10": {},
    "cifar100": {},
    "imagenet100": dict(
        arch="resnet50", epochs=90, milestones=(30, 60), weight_decay=1e-4, workers=8
    ),
    "digits": dict(arch="small", epochs=30, batch_size=256, milestones=(20, 25)),
    "npz": dict(arch="small", epochs=50, milestones=(35, 45)),
}


def preset(dataset: str, **overrides: Any) -> VisionConfig:
    """The paper's settings for ``cifar10``/``cifar100`` (ResNet-18, 200 epochs, decay at 140/180,
    weight decay 5e-4) and ``imagenet100`` (ResNet-50, 90 epochs, decay at 30/60, 1e-4); the small
    CNN with shorter schedules for ``digits`` and ``npz:`` arrays. ``overrides`` win.
    """
    key = "npz" if dataset.startswith("npz:") else dataset
    return VisionConfig(**{**_PRESETS.get(key, {}), **overrides})
