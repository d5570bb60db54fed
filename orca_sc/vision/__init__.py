"""ORCA on images: the paper's CIFAR-10/100 and ImageNet-100 benchmarks on CNN backbones.

Optional (``pip install "orca_sc[vision]"``); ``import orca_sc`` never imports it. The objective
and the normalised head are the single-cell core's (:func:`orca_sc.losses.orca_objective`,
:class:`orca_sc.module.NormedLinear`).

>>> from orca_sc import vision
>>> data = vision.load_images("digits")
>>> run = vision.train_orca(data, vision.preset("digits", epochs=5))
>>> run.history[-1]["u_novel"]  # Hungarian accuracy on the unlabelled novel-class images
"""

from ._augment import AugmentSpec, color_jitter, random_crop, random_flip, random_resized_crop
from ._checkpoint import load_checkpoint, load_orca
from ._config import METHOD_NAMES, PretrainConfig, VisionConfig, preset
from ._data import ImageData, imagenet100_classes, load_images
from ._eval import embed, evaluate_heads, predict, score
from ._nets import SmallCNN, VisionOrcaNet, freeze_all_but_last_block, resnet18, resnet50
from ._report import write_report
from ._split import OpenWorldSplit, open_world_split
from ._train import VisionRun, kmeans_baseline, nt_xent, pretrain_simclr, train_orca

__all__ = [
    "METHOD_NAMES",
    "AugmentSpec",
    "ImageData",
    "OpenWorldSplit",
    "PretrainConfig",
    "SmallCNN",
    "VisionConfig",
    "VisionOrcaNet",
    "VisionRun",
    "color_jitter",
    "embed",
    "evaluate_heads",
    "freeze_all_but_last_block",
    "imagenet100_classes",
    "kmeans_baseline",
    "load_checkpoint",
    "load_images",
    "load_orca",
    "nt_xent",
    "open_world_split",
    "predict",
    "preset",
    "pretrain_simclr",
    "random_crop",
    "random_flip",
    "random_resized_crop",
    "resnet18",
    "resnet50",
    "score",
    "train_orca",
    "write_report",
]
