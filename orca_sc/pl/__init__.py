"""Plots of an open-world annotation (scanpy-style: ``ax``, ``show``, ``save``).

* :func:`embedding` — cells on an embedding, known types muted, novel clusters highlighted;
* :func:`confidence` — distribution of ``orca_confidence`` per label;
* :func:`correspondence` — truth (or reference label) vs ORCA label, as a row-normalised heatmap;
* :func:`novel_markers` — dot plot of the top marker genes of each novel cluster.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

__all__ = ["confidence", "correspondence", "embedding", "novel_markers"]


def _plt():
    import matplotlib.pyplot as plt

    return plt


def _finish(obj, show: bool | None, save: str | None):
    """Save and/or show a plot: ``obj`` is matplotlib ``Axes`` or a scanpy plot object (which
    has its own ``savefig`` and ``show``). Returns ``obj`` unless it was shown.
    """
    if save:
        target = obj if hasattr(obj, "savefig") else obj.figure
        target.savefig(save, dpi=150, bbox_inches="tight")
    if show is None:
        show = not save
    if show:
        if hasattr(obj, "show"):
            obj.show()
        else:
            _plt().show()
        return None
    return obj


def _labels(adata: Any, key_added: str) -> tuple[pd.Series, list[str]]:
    col = f"{key_added}_label"
    if col not in adata.obs.columns:
        msg = (
            f"obs[{col!r}] not found; run orca_sc.tl.annotate(..., key_added={key_added!r}) first."
        )
        raise KeyError(msg)
    lab = adata.obs[col]
    novel_col = f"{key_added}_novel"
    novel = list(adata.obs[novel_col].cat.categories) if novel_col in adata.obs.columns else []
    return lab, [str(n) for n in novel]


def _palette(labels: list[str], novel: list[str]) -> dict[str, Any]:
    """Known types in muted pastel colours, novel clusters in saturated ones."""
    plt = _plt()
    known = [label for label in labels if label not in novel]
    muted = plt.get_cmap("tab20c")
    bright = plt.get_cmap("tab10")
    pal = {k: muted((i * 4 + 3) % 20 if i < 5 else (i * 4 + 2) % 20) for i, k in enumerate(known)}
    pal.update({n: bright(i % 10) for i, n in enumerate(novel)})
    return pal


def embedding(
    adata: Any,
    basis: str = "umap",
    *,
    key_added: str = "orca",
    size: float | None = None,
    ax=None,
    show: bool | None = None,
    save: str | None = None,
):
    """Cells on ``obsm['X_{basis}']`` coloured by ``orca_label``: known types muted, novel clusters
    in strong colours drawn on top with a dark outline, so discoveries stand out.

    Compute the embedding first, e.g. ``sc.pp.neighbors(adata, use_rep="X_orca");
    sc.tl.umap(adata)``. Returns the axes if ``show=False``.
    """
    plt = _plt()
    key = f"X_{basis}"
    if key not in adata.obsm:
        msg = (
            f"obsm[{key!r}] not found; compute it first, e.g. sc.pp.neighbors(adata, "
            f"use_rep='X_{key_added}') and sc.tl.{basis}(adata)."
        )
        raise KeyError(msg)
    xy = np.asarray(adata.obsm[key])[:, :2]
    lab, novel = _labels(adata, key_added)
    cats = [str(c) for c in lab.cat.categories]
    pal = _palette(cats, novel)
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 5))
    s = size if size is not None else max(2.0, 120000 / max(adata.n_obs, 1) ** 1.1)
    values = lab.astype(str).to_numpy()
    for c in cats:  # known first, novel on top
        if c in novel:
            continue
        m = values == c
        ax.scatter(xy[m, 0], xy[m, 1], s=s, color=pal[c], label=c, linewidths=0)
    for c in novel:
        m = values == c
        ax.scatter(xy[m, 0], xy[m, 1], s=s * 1.6, color=pal[c], label=f"{c} (novel)",
                   edgecolors="0.15", linewidths=0.3)  # fmt: skip
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(f"{basis.upper()}1")
    ax.set_ylabel(f"{basis.upper()}2")
    ax.set_title(f"{key_added}_label")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False,
              markerscale=2.0)  # fmt: skip
    return _finish(ax, show, save)


def confidence(
    adata: Any,
    *,
    key_added: str = "orca",
    ax=None,
    show: bool | None = None,
    save: str | None = None,
):
    """Box plot of ``orca_confidence`` (max softmax probability) per label; novel clusters
    highlighted. Low-confidence known-type labels are the ones to check by hand.
    """
    plt = _plt()
    lab, novel = _labels(adata, key_added)
    conf = adata.obs[f"{key_added}_confidence"].to_numpy()
    cats = [str(c) for c in lab.cat.categories]
    values = lab.astype(str).to_numpy()
    data = [conf[values == c] for c in cats]
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4, 0.45 * len(cats) + 1.5), 3.5))
    bp = ax.boxplot(data, patch_artist=True, showfliers=False, widths=0.6)
    pal = _palette(cats, novel)
    for patch, c in zip(bp["boxes"], cats, strict=True):
        patch.set_facecolor(pal[c])
    ax.set_xticks(np.arange(1, len(cats) + 1), cats, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel(f"{key_added}_confidence")
    ax.set_ylim(0, 1.02)
    return _finish(ax, show, save)


def correspondence(
    adata: Any,
    truth_key: str,
    *,
    key_added: str = "orca",
    normalize: bool = True,
    ax=None,
    show: bool | None = None,
    save: str | None = None,
):
    """Heatmap of ``obs[truth_key]`` (rows) against ``orca_label`` (columns): where each true or
    reference type went. With ``normalize``, rows sum to 1 and the cell counts are annotated.
    """
    plt = _plt()
    if truth_key not in adata.obs.columns:
        cols = ", ".join(map(repr, adata.obs.columns))
        raise KeyError(f"truth_key {truth_key!r} is not an obs column; columns: {cols}.")
    lab, _ = _labels(adata, key_added)
    tab = pd.crosstab(adata.obs[truth_key].astype(str), lab.astype(str))
    cols = [str(c) for c in lab.cat.categories if str(c) in tab.columns]
    tab = tab[cols]
    shown = tab.div(tab.sum(axis=1), axis=0) if normalize else tab
    if ax is None:
        _, ax = plt.subplots(figsize=(0.5 * len(cols) + 3, 0.4 * len(tab) + 1.5))
    im = ax.imshow(shown.to_numpy(), cmap="Blues", aspect="auto", vmin=0)
    ax.set_xticks(np.arange(len(cols)), cols, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(np.arange(len(tab)), tab.index, fontsize=8)
    for i in range(tab.shape[0]):
        for j in range(tab.shape[1]):
            n = tab.iat[i, j]
            if n:
                dark = shown.iat[i, j] > 0.6 * np.nanmax(shown.to_numpy())
                ax.text(j, i, str(n), ha="center", va="center", fontsize=6,
                        color="white" if dark else "black")  # fmt: skip
    ax.set_xlabel(f"{key_added}_label")
    ax.set_ylabel(truth_key)
    ax.figure.colorbar(im, ax=ax, fraction=0.04, label="fraction of row" if normalize else "cells")
    return _finish(ax, show, save)


def novel_markers(
    adata: Any,
    *,
    key_added: str = "orca",
    n_genes: int = 5,
    layer: str | None = None,
    show: bool | None = None,
    save: str | None = None,
    **kwargs: Any,
):
    """Dot plot (``sc.pl.dotplot``) of the top ``n_genes`` markers of every novel cluster (the
    markers of :func:`orca_sc.tl.summarize`), across all ORCA labels. Returns the scanpy
    ``DotPlot`` if ``show=False``.
    """
    import scanpy as sc

    from ..tl._summary import lognormalized, marker_genes

    lab, novel = _labels(adata, key_added)
    key = f"{key_added}_label"
    view = lognormalized(adata, lab, layer, key=key)
    markers = {g: m for g, m in marker_genes(view, novel, n_genes, key=key).items() if m}
    if not markers:
        raise ValueError("no novel cluster with markers to plot (no novel clusters found).")
    dp = sc.pl.dotplot(view, markers, groupby=key, show=False, return_fig=True, **kwargs)
    return _finish(dp, show, save)
