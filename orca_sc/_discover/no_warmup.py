"""The paper's literal recipe (``warmup_epochs=0``): the number of novel types from Leiden clusters
of all cells that lack labels, heads at random directions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._ablation import DiscoveryRules
from ._stage import Discovery
from .graph import leiden, resolve_resolution

_DEFAULTS = DiscoveryRules()


def _smallest_cluster(n_unlabeled: int) -> int:
    """Smallest cluster the estimate counts: 5 cells or 0.5% of the unlabelled cells. Without a
    warm-up no anchors drop small incoherent clusters (after a warm-up they do, and there no size
    limit is needed), so the count of the expression clusters needs one.
    """
    return max(5, int(np.ceil(0.005 * n_unlabeled)))


def discover_without_warmup(
    labels: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    dim: int,
    *,
    n_novel: int | str = "auto",
    cfg: DiscoveryRules = _DEFAULTS,
    seed: int = 0,
) -> Discovery:
    """The paper's literal recipe (``warmup_epochs=0``): the number of novel heads is given or
    estimated from the expression alone (:func:`estimate_n_novel`); heads start at random
    ``(k, dim)`` directions and the regulariser's prior is uniform.
    """
    diagnostics: dict[str, Any] = {}
    if n_novel == "auto":
        diagnostics = estimate_n_novel(labels, pca_of, seed=seed, cfg=cfg)
        k = diagnostics["n_novel"]
    else:
        k = int(n_novel)
    protos = np.random.default_rng(seed).normal(size=(k, dim))
    protos /= np.linalg.norm(protos, axis=1, keepdims=True)
    none = np.empty(0, dtype=np.int64)
    sizes = tuple(diagnostics.get("cluster_sizes", ()))
    return Discovery(
        assign=np.full(labels.size, -1, dtype=np.int64),
        sizes=sizes,
        n_novel=diagnostics.get("n_novel", -1),
        prototypes=protos,
        prior=None,
        anchor_cells=none,
        anchor_heads=none,
        diagnostics=diagnostics,
    )


def estimate_n_novel(
    labels: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    seed: int = 0,
    cfg: DiscoveryRules = _DEFAULTS,
) -> dict:
    """Estimate the number of novel types without a warm-up: :func:`novel_clusters` of the PCA
    of all the given cells (``pca_of(idx)``) at the resolution of ``cfg``.
    """
    labeled = labels >= 0
    resolution, _ = resolve_resolution(labels, pca_of, seed=seed, cfg=cfg)
    sizes = novel_clusters(
        pca_of(np.arange(labels.size)),
        labeled,
        resolution=resolution,
        rel_threshold=cfg.no_warmup_rel_threshold,
        min_size=_smallest_cluster(int((~labeled).sum())),
        seed=seed,
        n_neighbors=cfg.n_neighbors,
    )
    return {"n_novel": len(sizes), "cluster_sizes": sizes, "space": "pca"}


def novel_clusters(
    emb: np.ndarray,
    labeled: np.ndarray,
    *,
    resolution: float = 1.0,
    rel_threshold: float = _DEFAULTS.no_warmup_rel_threshold,
    min_size: int | None = None,
    seed: int = 0,
    n_neighbors: int = _DEFAULTS.n_neighbors,
) -> list[int]:
    """Sizes (unlabelled cells, largest first) of the Leiden clusters of ``emb`` that look like
    novel types: at least ``min_size`` unlabelled cells and a labelled fraction below
    ``rel_threshold`` times the overall one.
    """
    clusters = leiden(emb, resolution, seed, n_neighbors=n_neighbors)
    if min_size is None:
        min_size = _smallest_cluster(int((~labeled).sum()))
    frac_all = labeled.mean()
    found = []
    for c in np.unique(clusters):  # loop over clusters, not cells
        in_c = clusters == c
        n_c_unl = int((in_c & ~labeled).sum())
        if n_c_unl >= min_size and labeled[in_c].mean() < rel_threshold * frac_all:
            found.append(n_c_unl)
    return sorted(found, reverse=True)
