"""Where discovery's dense arithmetic runs: its PCAs and exact neighbour searches run with
NumPy and scikit-learn on the CPU, or with torch on the run's GPU.

The pipeline sets the device for a run's duration (:func:`on_device`); discovery's functions
take arrays and return arrays either way. On a GPU the dense rows of the PCA (the aligned
expression or the Pearson residuals) are built on the device from the sparse rows, the PCA is
the top eigenvectors of their float64 covariance, and the neighbours are exact (blocks of
squared distances and their ``topk``): the same quantities as on the CPU, computed in another
order, so a GPU run's labels can differ from a CPU run's as its training already does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from .._ambient import ambient, current

#: squared distances computed at once by :func:`kneighbors` on a device (256 MiB of float32)
_BLOCK_VALUES = 1 << 26


@contextmanager
def on_device(device: Any, *, force: bool = False) -> Iterator[None]:
    """Run discovery's PCAs and neighbour searches on ``device`` (a ``torch.device``) for the
    duration: on a CUDA device; on another, only with ``force`` (the tests run the torch path on
    the CPU), and without it the setting around the call is kept.
    """
    if not (force or getattr(device, "type", None) == "cuda"):
        yield
        return
    with ambient(device=device):
        yield


@contextmanager
def neighbours_once() -> Iterator[None]:
    """For the duration, :func:`kneighbors` of a set of points among themselves is searched once
    per number of neighbours and returned again when asked again (discovery reads one PCA's
    graph in several tests: at 100,000 cells the same 17,832 x 15 search ran twice, 0.8 s each
    on 2 CPU threads). The search is exact and deterministic, so the answer is the same.
    """
    with ambient(found={}):
        yield


def device() -> Any:
    """The torch device discovery computes on, or ``None`` (NumPy and scikit-learn)."""
    return current().device


def kneighbors(emb: np.ndarray, k: int, queries: np.ndarray | None = None) -> np.ndarray:
    """Indices ``(m, k)`` of the ``k`` nearest rows of ``emb`` (Euclidean, nearest first) to each
    row of ``queries``; without ``queries``, to each row of ``emb``, itself left out (as
    scikit-learn's ``kneighbors()`` without ``X``).
    """
    found = current().found
    if found is not None and queries is None:
        emb = np.ascontiguousarray(emb)
        key = (emb.shape, emb.dtype.str, int(k), hashlib.sha1(emb.view(np.uint8)).digest())
        if key not in found:
            found[key] = _kneighbors(emb, k, None)
        return found[key].copy()
    return _kneighbors(emb, k, queries)


def _kneighbors(emb: np.ndarray, k: int, queries: np.ndarray | None) -> np.ndarray:
    dev = device()
    if dev is None:
        from sklearn.neighbors import NearestNeighbors

        nn = NearestNeighbors(n_neighbors=k).fit(emb)
        return nn.kneighbors(queries, return_distance=False)
    return _kneighbors_torch(emb, k, queries, dev)


def _kneighbors_torch(emb: np.ndarray, k: int, queries: np.ndarray | None, dev: Any) -> np.ndarray:
    import torch

    with torch.no_grad():
        ref = torch.as_tensor(np.asarray(emb, dtype=np.float32), device=dev)
        q_all = (
            ref
            if queries is None
            else torch.as_tensor(np.asarray(queries, dtype=np.float32), device=dev)
        )
        ref_sq = (ref * ref).sum(dim=1)
        out = torch.empty((q_all.shape[0], k), dtype=torch.int64, device=dev)
        step = max(1, _BLOCK_VALUES // max(1, ref.shape[0]))
        for lo in range(0, q_all.shape[0], step):
            q = q_all[lo : lo + step]
            d2 = (q * q).sum(dim=1, keepdim=True) - 2.0 * (q @ ref.T) + ref_sq
            if queries is None:  # the cell itself is no neighbour
                i = torch.arange(q.shape[0], device=dev)
                d2[i, lo + i] = torch.inf
            out[lo : lo + q.shape[0]] = d2.topk(k, dim=1, largest=False, sorted=True).indices
        return out.cpu().numpy()
