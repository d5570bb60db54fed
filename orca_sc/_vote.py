"""Majority voting over an over-clustering of the annotated cells (``majority_vote=True``), as
CellTypist refines its per-cell predictions: the cells are over-clustered (Leiden on the kNN
graph of the ORCA embedding, at CellTypist's resolutions), and every cell of a cluster takes the
cluster's most common label, unless no label holds at least :data:`MIN_SHARE` of the cluster:
such a *mixed* cluster keeps its per-cell labels and is flagged. Arrays in, arrays out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: a cluster whose most common label holds less than this share of its cells is mixed
MIN_SHARE = 0.5


def overcluster_resolution(n_cells: int) -> float:
    """CellTypist's over-clustering resolution for ``n_cells`` cells."""
    return (
        5.0 if n_cells < 5_000 else 10.0 if n_cells < 20_000 else 15.0 if n_cells < 40_000 else 20.0
    )


@dataclass(frozen=True)
class Vote:
    """``labels``: the voted label of every cell; ``cluster``: its over-cluster; ``mixed``:
    whether its cluster is mixed (labels kept per cell); ``record``: figures for ``uns``.
    """

    labels: np.ndarray
    cluster: np.ndarray
    mixed: np.ndarray
    record: dict[str, Any]


def majority_vote(
    embedding: np.ndarray, labels: np.ndarray, *, seed: int = 0, max_cells: int = 50_000
) -> Vote:
    """Majority vote of ``labels`` over Leiden clusters of ``embedding`` (rows: the cells to
    vote on). Beyond ``max_cells`` cells a random sample of them is clustered and every other
    cell joins the cluster of its nearest sampled cell.
    """
    from sklearn.neighbors import NearestNeighbors

    from ._discover import leiden, subsample_rows

    n = labels.shape[0]
    resolution = overcluster_resolution(n)
    rows = subsample_rows(n, seed, max_cells)
    cluster = np.empty(n, dtype=np.int64)
    cluster[rows] = leiden(embedding[rows], resolution=resolution, seed=seed)
    if rows.size < n:
        rest = np.setdiff1d(np.arange(n), rows)
        nearest = NearestNeighbors(n_neighbors=1).fit(embedding[rows]).kneighbors(embedding[rest])
        cluster[rest] = cluster[rows][nearest[1][:, 0]]
    names, code = np.unique(labels.astype(str), return_inverse=True)
    n_clusters = int(cluster.max()) + 1
    table = np.zeros((n_clusters, names.size), dtype=np.int64)
    np.add.at(table, (cluster, code), 1)  # cells per (cluster, label)
    top = table.argmax(axis=1)
    share = table.max(axis=1) / np.maximum(table.sum(axis=1), 1)
    mixed_cluster = share < MIN_SHARE
    mixed = mixed_cluster[cluster]
    voted = np.where(mixed, labels, names[top][cluster]).astype(object)
    record = {
        "resolution": resolution,
        "n_clusters": n_clusters,
        "n_mixed_clusters": int(mixed_cluster.sum()),
        "min_share": MIN_SHARE,
        "n_changed": int(np.sum(voted != labels)),
        "n_cells_mixed": int(mixed.sum()),
    }
    return Vote(voted, cluster, mixed, record)
