"""Datasets: a realistic count simulator, public datasets from ``data_manifests/`` with a
checksummed downloader.
"""

from ._download import DownloadError, Manifest, default_cache_dir, fetch, load, manifests
from ._simulate import simulate

__all__ = [
    "DownloadError",
    "Manifest",
    "default_cache_dir",
    "fetch",
    "load",
    "manifests",
    "simulate",
]
