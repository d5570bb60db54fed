"""The paper's open-world split of an image dataset (Sec. 4.1)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._errors import ConfigError


@dataclass(frozen=True)
class OpenWorldSplit:
    """A seen/novel split of an image dataset: classes 0 to ``n_seen - 1`` are seen (as in the
    reference code); ``labelled`` holds the indices of the labelled training images (a
    ``labelled_fraction`` of each seen class), ``unlabelled`` the rest of the training set (the
    other seen-class images and every image of a novel class): the transductive evaluation set.
    """

    n_classes: int
    n_seen: int
    labelled: np.ndarray
    unlabelled: np.ndarray
    seed: int
    seen_fraction: float
    labelled_fraction: float

    def targets(self, y: np.ndarray) -> np.ndarray:
        """Training targets: the class for labelled images, ``-1`` for the others."""
        t = np.full(y.shape[0], -1, dtype=np.int64)
        t[self.labelled] = y[self.labelled]
        return t


def open_world_split(
    y: np.ndarray,
    n_classes: int,
    seen_fraction: float = 0.5,
    labelled_fraction: float = 0.5,
    seed: int = 0,
) -> OpenWorldSplit:
    """Seen classes: the first ``round(seen_fraction * n_classes)`` (at least 1, at most
    ``n_classes - 1``); in each, ``round(labelled_fraction * n)`` images (at least 1) drawn at
    random (numpy ``seed``) are labelled. The reference code labels each image by a coin flip;
    a fixed count per class gives every seed the same number of labels.
    """
    if not 0 < seen_fraction < 1:
        raise ConfigError("seen_fraction", seen_fraction, "a number in (0, 1)")
    if not 0 < labelled_fraction <= 1:
        raise ConfigError("labelled_fraction", labelled_fraction, "a number in (0, 1]")
    y = np.asarray(y)
    n_seen = int(min(max(round(seen_fraction * n_classes), 1), n_classes - 1))
    rng = np.random.default_rng(seed)
    labelled = []
    for c in range(n_seen):
        idx = np.flatnonzero(y == c)
        if idx.size == 0:
            continue
        k = max(1, round(labelled_fraction * idx.size))
        labelled.append(np.sort(rng.permutation(idx)[:k]))
    lab = np.concatenate(labelled) if labelled else np.empty(0, dtype=np.int64)
    if lab.size == 0:
        raise ConfigError("seen_fraction", seen_fraction, "a value that leaves labelled images")
    mask = np.zeros(y.shape[0], dtype=bool)
    mask[lab] = True
    return OpenWorldSplit(
        n_classes=n_classes,
        n_seen=n_seen,
        labelled=np.sort(lab).astype(np.int64),
        unlabelled=np.flatnonzero(~mask).astype(np.int64),
        seed=seed,
        seen_fraction=seen_fraction,
        labelled_fraction=labelled_fraction,
    )
