"""Checkpoints of :mod:`orca_sc.vision`: ``PATH`` (tensors only, read with
``torch.load(weights_only=True)``) and ``PATH.json`` beside it (what the run was: kind,
backbone, dataset, classes, configuration, epoch, history, numpy random state). Both are written
to temporary files and renamed, so an interrupted save never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from .._errors import OrcaInputError, check_input_file

FORMAT = "orca_sc.vision/1"


def meta_path(path: str | Path) -> Path:
    p = Path(path)
    return p.with_name(p.name + ".json")


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    return obj


def save_checkpoint(path: str | Path, tensors: dict, meta: dict) -> None:
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise OrcaInputError(f"Cannot write {path}: the folder {path.parent} does not exist.")
    mp = meta_path(path)
    tmp_t = path.with_name(f".{path.name}.tmp")
    tmp_m = mp.with_name(f".{mp.name}.tmp")
    try:
        torch.save(tensors, tmp_t)
        tmp_m.write_text(json.dumps(_json_safe({"format": FORMAT, **meta}), indent=1))
        os.replace(tmp_t, path)
        os.replace(tmp_m, mp)
    finally:
        tmp_t.unlink(missing_ok=True)
        tmp_m.unlink(missing_ok=True)


def load_checkpoint(
    path: str | Path, *, kind: str | None = None, device: torch.device | str = "cpu"
) -> tuple[dict, dict]:
    """``(tensors, metadata)`` of a checkpoint; ``kind`` (``"orca"``/``"simclr"``) is checked."""
    p = check_input_file(path, "Checkpoint", "a checkpoint file (.pt)")
    mp = meta_path(p)
    if not mp.is_file():
        raise OrcaInputError(f"Checkpoint {p} has no metadata file {mp} beside it.")
    try:
        meta = json.loads(mp.read_text())
    except (OSError, ValueError) as e:
        raise OrcaInputError(f"Cannot read the checkpoint metadata {mp}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise OrcaInputError(f"{mp} is not orca_sc.vision checkpoint metadata ({FORMAT}).")
    if kind is not None and meta.get("kind") != kind:
        what = {"orca": "an ORCA training", "simclr": "a SimCLR pretraining"}[kind]
        raise OrcaInputError(
            f"Checkpoint {p} is from {meta.get('kind')!r}, but {what} checkpoint is needed here."
        )
    try:
        tensors = torch.load(p, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for damaged files
        raise OrcaInputError(f"Checkpoint {p} is damaged or not a torch file: {e}") from None
    return tensors, meta


_MAY_CHANGE_ON_RESUME = {"epochs", "eval_test", "workers", "amp"}


def check_same_run(meta: dict, config: dict, data) -> None:
    """A resumed run must use the checkpoint's data and configuration (only the number of
    epochs and how the run is executed may change).
    """
    if meta.get("dataset") != data.name or list(meta.get("classes", [])) != list(data.classes):
        raise OrcaInputError(
            f"The checkpoint was trained on {meta.get('dataset')!r}, not {data.name!r}; resume "
            "it on the same dataset."
        )
    saved = meta.get("config", {})
    diff = [
        f"{k}={saved.get(k)!r} (now {v!r})"
        for k, v in config.items()
        if k not in _MAY_CHANGE_ON_RESUME and _norm(saved.get(k)) != _norm(v)
    ]
    if diff:
        raise OrcaInputError(
            "The checkpoint was trained with other settings: " + ", ".join(diff) + "; resume with "
            "the same settings (only epochs may change)."
        )
    if int(meta.get("epoch", 0)) > config.get("epochs", 0):
        raise OrcaInputError(
            f"The checkpoint has {meta.get('epoch')} epochs already; ask for more epochs to resume."
        )


def _norm(v):
    return list(v) if isinstance(v, tuple) else v


def load_backbone(backbone, path, arch: str, in_channels: int, device) -> None:
    """Load the backbone of a SimCLR checkpoint into ``backbone`` (same architecture)."""
    tensors, meta = load_checkpoint(path, kind="simclr", device=device)
    if meta.get("arch") != arch or meta.get("in_channels") != in_channels:
        raise OrcaInputError(
            f"The pretrained checkpoint {path} holds a {meta.get('arch')} for "
            f"{meta.get('in_channels')}-channel images; this run uses a {arch} for "
            f"{in_channels}-channel images (set arch= / --arch to match)."
        )
    try:
        backbone.load_state_dict(tensors["backbone"])
    except (KeyError, RuntimeError) as e:
        raise OrcaInputError(f"Checkpoint {path} does not fit the {arch} backbone: {e}") from None


def _common(data, epoch: int, np_state: dict, history: list) -> dict:
    return {
        "orca_sc_version": __version__,
        "dataset": data.name,
        "classes": list(data.classes),
        "in_channels": data.in_channels,
        "epoch": epoch,
        "numpy_rng": np_state,
        "history": history,
    }


def orca_meta(run, data, epoch: int, np_state: dict) -> dict:
    return {
        "kind": "orca",
        "arch": run.config.arch,
        "n_heads": int(run.net.head.weight.shape[0]),
        "n_seen": run.split.n_seen,
        "head_names": run.head_names(),
        "config": asdict(run.config),
        **_common(data, epoch, np_state, run.history),
    }


def simclr_meta(run, data, epoch: int, np_state: dict) -> dict:
    return {
        "kind": "simclr",
        "arch": run.config.arch,
        "config": asdict(run.config),
        **_common(data, epoch, np_state, run.history),
    }


def load_orca(path: str | Path, device="cpu"):
    """The trained :class:`~orca_sc.vision.VisionOrcaNet` and metadata of an ORCA checkpoint."""
    from ._nets import VisionOrcaNet

    tensors, meta = load_checkpoint(path, kind="orca", device=device)
    try:
        net = VisionOrcaNet(meta["arch"], int(meta["n_heads"]), int(meta["in_channels"]))
        net.load_state_dict(tensors["model"])
    except (KeyError, RuntimeError, ValueError, TypeError) as e:
        raise OrcaInputError(f"Checkpoint {path} is damaged or was edited: {e}") from None
    return net.to(device).eval(), meta
