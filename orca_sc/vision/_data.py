"""Image datasets for :mod:`orca_sc.vision`: CIFAR-10/100 archives, scikit-learn's digits,
ImageNet-100 from an image-folder tree, and ``npz:PATH`` arrays.

In-memory sets hold uint8 ``(N, C, H, W)`` tensors; :class:`ImageFolderSource` decodes JPEGs in
DataLoader workers. Both yield uint8 batches on the training device from
:meth:`ImageSource.batches`, so the augmentations run batched on the device.
"""

from __future__ import annotations

import io
import logging
import pickle
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .._errors import OrcaInputError
from ..datasets._download import fetch, get_manifest
from ._augment import AugmentSpec

logger = logging.getLogger(__name__)

DATASETS = ("cifar10", "cifar100", "digits", "imagenet100", "npz:PATH")
_CIFAR_STATS = {  # per-channel mean / std of the training images (as the reference code)
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761)),
}
_IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
_IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png"}


class ImageSource:
    """Images addressed by index; :meth:`batches` yields uint8 ``(B, C, H, W)`` on ``device``."""

    shape: tuple[int, int, int]

    def __len__(self) -> int:
        raise NotImplementedError

    def batches(
        self, index_batches: Sequence[np.ndarray], device: torch.device, workers: int = 0
    ) -> Iterator[torch.Tensor]:
        raise NotImplementedError


class TensorSource(ImageSource):
    """Images held in memory; moved to the device once and indexed there."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.shape = tuple(x.shape[1:])
        self._on: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def on(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self._on:
            self._on = {key: self.x.to(device)}
        return self._on[key]

    def batches(self, index_batches, device, workers=0):
        x = self.on(device)
        for idx in index_batches:
            yield x[torch.as_tensor(idx, device=device)]


class ImageFolderSource(ImageSource):
    """JPEG/PNG files decoded with Pillow in DataLoader workers, resized to ``side`` on the short
    side and centre-cropped to ``side``×``side`` (uint8, RGB).
    """

    def __init__(self, files: Sequence[str], side: int = 256) -> None:
        self.files = list(files)
        self.side = side
        self.shape = (3, side, side)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        try:
            from PIL import Image
        except ImportError:  # pragma: no cover - Pillow comes with matplotlib / the extra
            raise OrcaInputError(
                'Reading image folders needs Pillow: pip install "orca_sc[vision]".'
            ) from None
        with Image.open(self.files[i]) as im:
            im = im.convert("RGB")
            w, h = im.size
            s = self.side / min(w, h)
            im = im.resize((max(self.side, round(w * s)), max(self.side, round(h * s))))
            w, h = im.size
            left, top = (w - self.side) // 2, (h - self.side) // 2
            im = im.crop((left, top, left + self.side, top + self.side))
            arr = np.asarray(im, dtype=np.uint8)
        return torch.from_numpy(arr.copy()).permute(2, 0, 1)

    def batches(self, index_batches, device, workers=0):
        loader = torch.utils.data.DataLoader(
            self,
            batch_sampler=[list(map(int, b)) for b in index_batches],
            num_workers=workers,
            pin_memory=device.type == "cuda",
        )
        for x in loader:
            yield x.to(device, non_blocking=True)


@dataclass(frozen=True)
class ImageData:
    """A labelled image dataset with a training and a test split.

    ``train``/``test``: :class:`ImageSource`; ``y_train``/``y_test``: int64 class indices;
    ``classes``: class names in index order; ``augment``: how its images are augmented.
    """

    name: str
    train: ImageSource
    y_train: np.ndarray
    test: ImageSource
    y_test: np.ndarray
    classes: tuple[str, ...]
    augment: AugmentSpec

    @property
    def n_classes(self) -> int:
        return len(self.classes)

    @property
    def in_channels(self) -> int:
        return int(self.train.shape[0])


def load_images(
    dataset: str, *, data_dir: str | Path | None = None, cache_dir: str | Path | None = None
) -> ImageData:
    """Load an image dataset by name: ``"cifar10"``, ``"cifar100"`` (downloaded once into the
    ``orca_sc.datasets`` cache, checksum-verified), ``"digits"`` (bundled with scikit-learn),
    ``"imagenet100"`` (``data_dir`` = a folder with ``train/<wnid>/`` and ``val/<wnid>/``) or
    ``"npz:PATH"`` (arrays ``x_train``, ``y_train``, ``x_test``, ``y_test``, optional ``classes``;
    images uint8 ``(N, H, W, C)``, ``(N, C, H, W)`` or ``(N, H, W)``).
    """
    if not isinstance(dataset, str) or not dataset:
        raise OrcaInputError(f"dataset must be one of {', '.join(DATASETS)}, not {dataset!r}.")
    if dataset.startswith("npz:"):
        return _load_npz(Path(dataset[4:]).expanduser())
    if dataset in ("cifar10", "cifar100"):
        return _load_cifar(dataset, cache_dir)
    if dataset == "digits":
        return _load_digits()
    if dataset == "imagenet100":
        if data_dir is None:
            raise OrcaInputError(
                "ImageNet-100 is read from an image-folder tree: pass data_dir= (CLI: --data-dir) "
                "pointing to a folder with train/<wnid>/ and val/<wnid>/ (see "
                "data_manifests/imagenet100.json)."
            )
        return _load_imagenet100(Path(data_dir).expanduser())
    raise OrcaInputError(f"Unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}.")


def _as_nchw(x: np.ndarray, what: str) -> torch.Tensor:
    x = np.asarray(x)
    if x.dtype != np.uint8:
        raise OrcaInputError(f"{what} must be uint8 images (0-255), not {x.dtype}.")
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4:
        raise OrcaInputError(f"{what} must have shape (N, H, W, C) or (N, C, H, W), not {x.shape}.")
    if x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
        x = x.transpose(0, 3, 1, 2)
    if x.shape[1] not in (1, 3):
        raise OrcaInputError(f"{what} must have 1 or 3 channels; got shape {x.shape}.")
    return torch.from_numpy(np.ascontiguousarray(x))


def _labels(y: np.ndarray, n: int, what: str) -> np.ndarray:
    y = np.asarray(y)
    if y.shape != (n,) or not np.issubdtype(y.dtype, np.integer) or (n and y.min() < 0):
        raise OrcaInputError(f"{what} must be {n} non-negative integer class indices.")
    return y.astype(np.int64)


def _stats(x: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    f = x.float() / 255.0
    mean = f.mean(dim=(0, 2, 3))
    std = f.std(dim=(0, 2, 3)).clamp_min(1e-3)
    return tuple(round(float(v), 4) for v in mean), tuple(round(float(v), 4) for v in std)


def _from_arrays(name, x_train, y_train, x_test, y_test, classes, augment=None) -> ImageData:
    xt = _as_nchw(x_train, f"{name}: x_train")
    xs = _as_nchw(x_test, f"{name}: x_test")
    if xt.shape[1:] != xs.shape[1:]:
        raise OrcaInputError(
            f"{name}: train and test images differ in shape ({tuple(xt.shape[1:])} vs "
            f"{tuple(xs.shape[1:])})."
        )
    yt = _labels(y_train, xt.shape[0], f"{name}: y_train")
    ys = _labels(y_test, xs.shape[0], f"{name}: y_test")
    n_labels = int(max(yt.max(initial=-1), ys.max(initial=-1))) + 1
    if classes is None:
        classes = [str(i) for i in range(n_labels)]
    classes = tuple(str(c) for c in classes)  # may list classes absent from a subset
    if len(classes) < n_labels or len(set(classes)) != len(classes):
        raise OrcaInputError(f"{name}: 'classes' must name each of the {n_labels} classes once.")
    n_classes = len(classes)
    if len(np.unique(yt)) < 2:
        raise OrcaInputError(f"{name}: the training images hold fewer than 2 classes.")
    if augment is None:
        side = int(xt.shape[-1])
        mean, std = _stats(xt)
        augment = AugmentSpec(
            size=side,
            mean=mean,
            std=std,
            padding=max(1, side // 8),
            simclr_scale=(0.2, 1.0) if side < 32 else (0.08, 1.0),
        )
    return ImageData(name, TensorSource(xt), yt, TensorSource(xs), ys, classes[:n_classes], augment)


def _load_npz(path: Path) -> ImageData:
    if not path.is_file():
        raise OrcaInputError(f"npz dataset {path} does not exist or is not a file.")
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise OrcaInputError(f"Cannot read {path} as an .npz file: {e}") from None
    with z:
        missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in z.files]
        if missing:
            raise OrcaInputError(
                f"{path} lacks the arrays {', '.join(missing)}; an npz dataset needs x_train, "
                "y_train, x_test, y_test (and optionally classes)."
            )
        classes = z["classes"].tolist() if "classes" in z.files else None
        return _from_arrays(
            f"npz:{path}", z["x_train"], z["y_train"], z["x_test"], z["y_test"], classes
        )


def _load_digits() -> ImageData:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = np.clip(np.round(d.images * 16.0), 0, 255).astype(np.uint8)  # 0-16 -> 0-255
    y = d.target.astype(np.int64)
    rng = np.random.default_rng(0)
    test = np.zeros(y.size, dtype=bool)
    for c in np.unique(y):  # stratified 80/20
        idx = rng.permutation(np.flatnonzero(y == c))
        test[idx[: round(0.2 * idx.size)]] = True
    aug = AugmentSpec(
        size=8, mean=(0.3,), std=(0.38,), padding=1, flip=False, simclr_scale=(0.4, 1.0)
    )
    classes = [str(c) for c in d.target_names]
    return _from_arrays("digits", x[~test], y[~test], x[test], y[test], classes, aug)


def _read_member(tar: tarfile.TarFile, name: str) -> dict:
    f = tar.extractfile(name)
    if f is None:
        raise OrcaInputError(f"The archive lacks {name}; delete it from the cache and retry.")
    # the archive's checksum was verified by fetch() before it is unpickled
    return pickle.load(io.BytesIO(f.read()), encoding="latin1")


def _load_cifar(name: str, cache_dir) -> ImageData:
    manifest = get_manifest(name)
    (path,) = fetch(manifest, cache_dir=cache_dir).values()
    with tarfile.open(path, "r:gz") as tar:
        if name == "cifar10":
            parts = [_read_member(tar, f"cifar-10-batches-py/data_batch_{i}") for i in range(1, 6)]
            test = _read_member(tar, "cifar-10-batches-py/test_batch")
            classes = _read_member(tar, "cifar-10-batches-py/batches.meta")["label_names"]
            key = "labels"
        else:
            parts = [_read_member(tar, "cifar-100-python/train")]
            test = _read_member(tar, "cifar-100-python/test")
            classes = _read_member(tar, "cifar-100-python/meta")["fine_label_names"]
            key = "fine_labels"
    x_train = np.concatenate([p["data"] for p in parts]).reshape(-1, 3, 32, 32)
    y_train = np.concatenate([np.asarray(p[key]) for p in parts])
    x_test = np.asarray(test["data"]).reshape(-1, 3, 32, 32)
    mean, std = _CIFAR_STATS[name]
    aug = AugmentSpec(size=32, mean=mean, std=std, padding=4)
    return _from_arrays(name, x_train, y_train, x_test, np.asarray(test[key]), classes, augment=aug)


def imagenet100_classes() -> list[str]:
    """The 100 WordNet ids of the ORCA reference code's ImageNet-100, in its order."""
    return list(get_manifest("imagenet100").raw["classes"])


def _load_imagenet100(root: Path) -> ImageData:
    wnids = imagenet100_classes()
    splits = {}
    for split in ("train", "val"):
        files, labels, missing = [], [], []
        for i, wnid in enumerate(wnids):
            folder = root / split / wnid
            found = (
                sorted(p for p in folder.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
                if folder.is_dir()
                else []
            )
            if not found:
                missing.append(wnid)
            files += [str(p) for p in found]
            labels += [i] * len(found)
        if missing:
            raise OrcaInputError(
                f"ImageNet-100: {len(missing)} of the 100 classes have no images under "
                f"{root / split} (first: {missing[0]}); expected {root}/{split}/<wnid>/*.JPEG."
            )
        splits[split] = (ImageFolderSource(files), np.asarray(labels, dtype=np.int64))
    aug = AugmentSpec(
        size=224, mean=_IMAGENET_STATS[0], std=_IMAGENET_STATS[1], padding=0, test_crop=224 / 256
    )
    logger.info(
        "ImageNet-100: %d training and %d validation images",
        len(splits["train"][0]),
        len(splits["val"][0]),
    )
    return ImageData(
        "imagenet100", splits["train"][0], splits["train"][1], splits["val"][0], splits["val"][1],
        tuple(wnids), aug,
    )  # fmt: skip
