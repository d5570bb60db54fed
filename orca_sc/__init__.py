"""orca_sc: open-world cell-type annotation with ORCA (Cao, Brbić & Leskovec, ICLR 2022)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("orca_sc")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.1.0"

from . import datasets, metrics, pl, tl  # noqa: E402
from ._config import HEAD_SCALE, DiscoveryConfig, OrcaConfig  # noqa: E402
from ._data import OrcaInputError  # noqa: E402
from ._io import read_lazy  # noqa: E402
from ._model import OrcaModel  # noqa: E402
from ._train import TrainingDivergedError  # noqa: E402

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
