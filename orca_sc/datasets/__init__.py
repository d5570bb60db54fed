"""Datasets: a realistic count simulator, public datasets from ``data_manifests/`` with a
checksummed downloader.
"""

from ._download import DownloadError, Manifest, default_cache_dir, fetch, load, manifests
from ._simulate import simulate
from ._tabula_muris import tabula_muris_cross_tissue

__all__ = [
    "DownloadError",
    "Manifest",
    "default_cache_dir",
    "fetch",
    "load",
    "manifests",
    "simulate",
    "tabula_muris_cross_tissue",
]
