"""orca_sc: open-world cell-type annotation with ORCA (Cao, Brbić & Leskovec, ICLR 2022).

The submodules and names below are imported on first use (PEP 562), so ``import orca_sc`` and
``orca-sc --help`` do not pay for torch, scanpy and scikit-learn until something needs them.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("orca_sc")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.2.0"

if TYPE_CHECKING:  # what static tools and IDEs see
    from . import datasets, metrics, pl, tl
    from ._config import HEAD_SCALE, DiscoveryConfig, OrcaConfig
    from ._errors import OrcaInputError, TrainingDivergedError
    from ._io import read_lazy
    from ._model import OrcaModel

_SUBMODULES = ("datasets", "metrics", "pl", "tl")
_NAMES = {
    "HEAD_SCALE": "._config",
    "DiscoveryConfig": "._config",
    "OrcaConfig": "._config",
    "OrcaInputError": "._errors",
    "TrainingDivergedError": "._errors",
    "read_lazy": "._io",
    "OrcaModel": "._model",
}

__all__ = [
    "HEAD_SCALE",
    "DiscoveryConfig",
    "OrcaConfig",
    "OrcaInputError",
    "OrcaModel",
    "TrainingDivergedError",
    "datasets",
    "metrics",
    "pl",
    "read_lazy",
    "tl",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name], __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
