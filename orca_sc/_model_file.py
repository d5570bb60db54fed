"""What a saved model file holds, checked when it is loaded: its format, configuration, net,
centroids, novel names and confidence map; and its metadata as plain JSON.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from ._config import OrcaConfig
from ._errors import OrcaInputError
from .module import OrcaNet

FORMAT = "orca_sc.model/1"


def _confidence_map(value: Any, what: str) -> tuple[list[float], list[float]] | None:
    """A saved ``confidence_map`` (absent in older files: ``None``), checked."""
    if value is None:
        return None
    ok = isinstance(value, list) and len(value) == 2 and all(isinstance(v, list) for v in value)
    if ok:
        x, y = (np.asarray(v, dtype=np.float64) for v in value)
        ok = x.shape == y.shape and np.isfinite(x).all() and np.isfinite(y).all()
        ok = ok and bool(np.all(np.diff(x) >= 0)) and bool(((y >= 0) & (y <= 1)).all())
    if not ok:
        msg = f"{what} is damaged or was edited: its confidence map is not two lists of knots."
        raise OrcaInputError(msg + " Retrain it, or re-save it with orca_sc.")
    return value[0], value[1]


_NOVEL_NAME = re.compile(r"novel_[0-9]+")


def _check_model(payload: dict, meta: dict, what: str) -> tuple[OrcaConfig, OrcaNet, np.ndarray]:
    """The config, network and centroids of a loaded model file, after checking that its
    metadata and tensors are complete, consistent and finite (:class:`OrcaInputError` if not).
    """

    def bad(problem: str) -> OrcaInputError:
        return OrcaInputError(
            f"{what} is damaged or was edited: {problem}. Retrain it, or re-save it with orca_sc."
        )

    missing = [k for k in ("config", "genes", "classes", "head_names", "n_heads") if k not in meta]
    missing += [k for k in ("state_dict", "centroids") if k not in payload]
    if missing:
        raise bad(f"it has no {', '.join(map(repr, missing))}")
    genes, classes, names, n_heads = (
        meta["genes"], meta["classes"], meta["head_names"], meta["n_heads"]
    )  # fmt: skip

    def strings(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(v, str) for v in x)

    if not strings(genes) or not genes or len(set(genes)) != len(genes):
        raise bad("'genes' must be a non-empty list of unique gene names")
    if not strings(classes) or len(classes) < 2 or len(set(classes)) != len(classes):
        raise bad("'classes' must be a list of at least two unique cell-type names")
    if not (isinstance(n_heads, int) and not isinstance(n_heads, bool)):
        raise bad(f"'n_heads' is {n_heads!r}, not an integer")
    if not isinstance(names, list) or len(names) != n_heads or n_heads < len(classes):
        raise bad(
            f"'head_names' must list the {n_heads} heads (at least the {len(classes)} classes)"
        )
    if names[: len(classes)] != classes:
        raise bad("the first head names must be the classes")
    for name in names[len(classes) :]:
        if name is not None and not (
            isinstance(name, str) and (name in classes or _NOVEL_NAME.fullmatch(name))
        ):
            raise bad(f"head name {name!r} is neither a class nor a novel cluster (novel_N)")
    try:
        config = OrcaConfig.from_dict(meta["config"])
    except (ValueError, TypeError) as e:
        raise bad(f"its configuration is invalid ({e})") from None
    net = OrcaNet(len(genes), n_heads, config.hidden_dims, config.dropout)
    state = payload["state_dict"]
    expected = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    if not isinstance(state, dict) or set(state) != set(expected):
        raise bad("its weights are not those of an orca_sc network")
    for k, shape in expected.items():
        v = state[k]
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise bad(f"weight {k!r} has shape {got}, expected {shape} for {n_heads} heads")
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise bad(f"weight {k!r} holds NaN or infinite values")
    centroids = payload["centroids"]
    if not isinstance(centroids, torch.Tensor) or tuple(centroids.shape) != (
        len(classes),
        len(genes),
    ):
        raise bad("its class centroids do not match its classes and genes")
    if not torch.isfinite(centroids).all():
        raise bad("its class centroids hold NaN or infinite values")
    net.load_state_dict(state)
    net.eval()
    return config, net, centroids.numpy()


def _to_builtin(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    msg = f"Cannot store {type(obj).__name__} in model metadata."
    raise TypeError(msg)
