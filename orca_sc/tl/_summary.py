"""``orca_sc.tl.summarize``: what the annotation found, in a form to print or save as JSON."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from .._annotation import RunRecord
from .._read import ChunkReader, get_matrix, on_disk, to_log_normalized


def summarize(
    adata: Any,
    *,
    key_added: str = "orca",
    n_markers: int = 5,
    n_closest: int = 2,
    layer: str | None = None,
) -> dict[str, Any]:
    """Summarise an annotation: cells per label, and for every novel cluster its top markers and
    the known types it is closest to.

    Markers are genes ranked by :func:`scanpy.tl.rank_genes_groups` (Wilcoxon, the cluster against
    all other annotated cells, on log-normalised expression; counts are normalised first). The
    closest known types are those whose mean expression profile is most similar to the novel cluster's (``uns['{key_added}']['novel_similarity']``: centred
    correlation of mean expression after batch alignment), as in MARS's naming of discovered cell
    types.

    Parameters
    ----------
    adata
        AnnData annotated by :func:`orca_sc.tl.annotate` or :func:`orca_sc.tl.predict`.
    key_added
        The prefix used when annotating.
    n_markers
        Marker genes per novel cluster.
    n_closest
        Known types listed per novel cluster.
    layer
        Expression layer for the markers (default ``.X``).

    Returns
    -------
    dict
        A JSON-able dict:

        - ``n_cells``, ``label_counts`` (label → cells, largest first) and
          ``mean_confidence``;
        - ``novel``: one record per novel cluster, ``name``, ``size``, ``markers``,
          ``closest`` as ``[{"type", "similarity"}]``, ``supported`` (the novelty test's
          verdict, ``uns['{key_added}']['novelty_test']``), ``evidence`` and ``reason``
          (whether the data can support the call, ``uns['{key_added}']['novel_evidence']``);
        - ``notes``: where the data cannot support a call, one line each naming the ``uns``
          key with the detail (the paragraphs are in the sections' ``notes``, e.g.
          ``uns['{key_added}']['estimate']['notes']``, and in :func:`orca_sc.tl.report`);
        - ``self_check`` when the run made one (``annotate(..., self_check=True)``): the
          hidden types, the share of their cells called novel, the share of held-out
          known-type cells called novel, the clusters found.

    """
    col = f"{key_added}_label"
    if col not in adata.obs.columns:
        msg = (
            f"obs[{col!r}] not found; run orca_sc.tl.annotate(..., key_added={key_added!r}) first."
        )
        raise KeyError(msg)
    labels = adata.obs[col].astype(str)
    counts = labels.value_counts()
    record = RunRecord.from_uns(adata.uns.get(key_added))
    sim = record.novel_similarity
    clusters = [str(c) for c in sim.get("clusters", [])]
    types = [str(t) for t in sim.get("types", [])]
    values = np.asarray(sim.get("similarity", []), dtype=float).reshape(len(clusters), len(types))
    novel_names = [n for n in adata.obs[f"{key_added}_novel"].cat.categories if n in counts.index]
    markers = _markers(adata, labels, novel_names, n_markers, layer) if n_markers > 0 else {}
    test = (record.novelty_test or {}).get("clusters", {})
    support = dict(zip(test.get("cluster", []), test.get("supported", []), strict=False))
    ev = record.novel_evidence or {}
    evidence = dict(zip(ev.get("cluster", []), zip(ev.get("evidence", []), ev.get("reason", []),
                                                    strict=False), strict=False))  # fmt: skip
    novel = []
    for name in novel_names:
        row = values[clusters.index(name)] if name in clusters else np.zeros(0)
        closest = [(types[i], row[i]) for i in np.argsort(-row, kind="stable")[:n_closest]]
        novel.append(
            {
                "name": name,
                "size": int(counts[name]),
                "markers": markers.get(name, []),
                "closest": [{"type": t, "similarity": round(float(v), 3)} for t, v in closest],
                "supported": str(support.get(name, "not tested")),
                "evidence": str(evidence.get(name, ("not tested", ""))[0]),
                "reason": str(evidence.get(name, ("", ""))[1]),
            }
        )
    out = {
        "n_cells": int(adata.n_obs),
        "label_counts": {str(k): int(v) for k, v in counts.items()},
        "mean_confidence": float(np.mean(adata.obs[f"{key_added}_confidence"])),
        "novel": novel,
        "notes": [n.line for n in record.notes],
    }
    check = record.self_check
    if check is not None and "novel_called" in check:
        keys = ("hidden_types", "novel_called", "known_called_novel", "hidden_accuracy",
                "hidden_clusters_found", "hidden_types_true", "n_known_cells")  # fmt: skip
        out["self_check"] = {k: _plain(check[k]) for k in keys}
    return out


def _plain(v: Any) -> Any:
    """A value read back from h5ad (numpy arrays and scalars) as plain JSON."""
    v = v.tolist() if isinstance(v, np.ndarray) else v
    return v.item() if isinstance(v, np.generic) else v


def _markers(
    adata: Any, labels: pd.Series, groups: list[str], n: int, layer: str | None
) -> dict[str, list[str]]:
    """Top ``n`` Wilcoxon markers of each group in ``groups`` against the rest."""
    sizes = labels.value_counts()
    if not any(sizes.get(g, 0) >= 2 for g in groups) or len(sizes) < 2:
        return {}  # nothing to rank: skip normalising the matrix
    return marker_genes(lognormalized(adata, labels, layer), groups, n)


#: on data read from disk, markers are ranked on at most this many random cells of each label
#: (every cell of a smaller one)
MARKER_CELLS_PER_GROUP = 2_000


def marker_sample(labels: np.ndarray, per_group: int, seed: int = 0) -> np.ndarray:
    """Sorted rows: every cell of a label with at most ``per_group`` cells, ``per_group`` random
    cells of a larger one.
    """
    rng = np.random.default_rng(seed)
    codes, inverse = np.unique(labels.astype(str), return_inverse=True)
    rows = []
    for k in range(codes.size):
        members = np.flatnonzero(inverse == k)
        if members.size > per_group:
            members = rng.choice(members, per_group, replace=False)
        rows.append(members)
    return np.sort(np.concatenate(rows))


def lognormalized(adata: Any, labels: pd.Series, layer: str | None, key: str = "label"):
    """A new AnnData with ``adata``'s expression log-normalised (counts are normalised to 10⁴
    first; log-normalised values kept) and ``obs[key] = labels`` — for markers and dot plots.
    """
    import anndata as ad

    if on_disk(adata, layer):  # a sample read from disk: Wilcoxon ranks on every cell do not scale
        rows = marker_sample(labels.to_numpy(), MARKER_CELLS_PER_GROUP)
        reader = ChunkReader(adata, layer, "annotated data", 1e4, rows=rows)
        X = sp.vstack([m for _, _, m in reader])
        adata, labels = adata[rows], labels.iloc[rows]
    else:
        X, _ = to_log_normalized(get_matrix(adata, layer, "annotated data"), 1e4)
    obs = pd.DataFrame({key: labels.to_numpy()}, index=adata.obs_names.astype(str))
    if not isinstance(obs[key].dtype, pd.CategoricalDtype):
        obs[key] = pd.Categorical(obs[key])
    return ad.AnnData(X=X, obs=obs, var=pd.DataFrame(index=adata.var_names.astype(str)))


def marker_genes(view: Any, groups: list[str], n: int, key: str = "label") -> dict[str, list[str]]:
    """Top ``n`` Wilcoxon markers (vs the rest) of each group of ``view.obs[key]`` in ``groups``
    that has at least 2 cells; ``view`` from :func:`lognormalized`.
    """
    import scanpy as sc

    sizes = view.obs[key].value_counts()
    groups = [g for g in groups if sizes.get(g, 0) >= 2]
    if not groups or (sizes > 0).sum() < 2:
        return {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scanpy's own notices about the data do not concern users
        sc.tl.rank_genes_groups(
            view, key, groups=groups, reference="rest", method="wilcoxon", n_genes=n
        )
    names = view.uns["rank_genes_groups"]["names"]
    return {g: [str(x) for x in names[g]] for g in groups}
