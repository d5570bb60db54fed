"""Plots of an open-world annotation, in scanpy's manner: ``show=False`` returns the Axes (or
the scanpy plot object), ``save=True`` or a suffix (``save="_run1.pdf"``) writes
``{sc.settings.figdir}/{plot}{suffix}``, and every panel colours a label alike (from
``uns['orca_label_colors']``, written by ``tl.annotate``).

* :func:`embedding` — cells on an embedding, known types muted, novel clusters highlighted;
* :func:`confidence` — distribution of ``orca_confidence`` per label;
* :func:`correspondence` — truth (or reference label) vs ORCA label, as a row-normalised heatmap;
* :func:`reliability` — with a truth column: accuracy against confidence (is it calibrated?);
* :func:`novel_markers` — dot plot of the top marker genes of each novel cluster;
* :func:`match_colors` — colours of another label column (e.g. the truth) matched to
  ``orca_label``'s, for scanpy's own plots.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

__all__ = [
    "confidence",
    "correspondence",
    "embedding",
    "match_colors",
    "novel_markers",
    "reliability",
]


def _plt():
    import matplotlib.pyplot as plt

    return plt


def _finish(obj, show: bool | None, save: bool | str | None, name: str):
    """Save and/or show a plot as scanpy does: ``save=True`` writes
    ``{sc.settings.figdir}/{name}.{sc.settings.file_format_figs}``, ``save="_x.png"``
    ``{figdir}/{name}_x.png`` (the suffix's extension, if any, sets the format). ``obj`` is
    matplotlib ``Axes`` or a scanpy plot object (which has its own ``savefig`` and ``show``).
    Returns ``obj`` only with ``show=False`` (with ``show=None`` a saved plot is not shown).
    """
    if save:
        from pathlib import Path

        import scanpy as sc

        suffix, ext = ("", sc.settings.file_format_figs) if save is True else (str(save), "")
        for candidate in ("png", "pdf", "svg", "jpg", "jpeg", "tif", "tiff", "eps"):
            if suffix.lower().endswith("." + candidate):
                suffix, ext = suffix[: -len(candidate) - 1], candidate
                break
        ext = ext or sc.settings.file_format_figs
        figdir = Path(sc.settings.figdir)
        figdir.mkdir(parents=True, exist_ok=True)
        target = obj if hasattr(obj, "savefig") else obj.figure
        target.savefig(figdir / f"{name}{suffix}.{ext}", dpi=150, bbox_inches="tight")
    if show or (show is None and not save):
        if hasattr(obj, "show"):
            obj.show()
        else:
            _plt().show()
    return obj if show is False else None


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


def _palette(adata: Any, key_added: str, labels: list[str], novel: list[str]) -> dict[str, Any]:
    """Each label's colour: ``uns['{key_added}_label_colors']`` (written by ``tl.annotate``),
    or, for results written without it, known types and novel clusters from their palettes.
    """
    from .._colors import label_colors

    stored = adata.uns.get(f"{key_added}_label_colors")
    if stored is not None and len(stored) == len(labels):
        return dict(zip(labels, stored, strict=True))
    known = [label for label in labels if label not in novel]
    return dict(zip(labels, label_colors(labels, known, novel), strict=True))


def match_colors(adata: Any, key: str, *, key_added: str = "orca") -> list[str]:
    """Colour the categories of ``obs[key]`` (e.g. the true or the reference's labels) as
    ``orca_label`` colours them: a category named as a known type takes that type's colour, a
    novel cluster's name its colour, any other category (e.g. a type the reference lacks) a dark
    tone of its own. Writes ``uns[f"{key}_colors"]`` (what ``sc.pl.umap(color=key)`` uses) and
    returns it, so that scanpy's panels of ``key`` and of ``orca_label`` agree; a column of
    strings is made categorical first, as scanpy's plots do.
    """
    if key not in adata.obs.columns:
        cols = ", ".join(map(repr, adata.obs.columns))
        raise KeyError(f"{key!r} is not an obs column; columns: {cols}.")
    if not isinstance(adata.obs[key].dtype, pd.CategoricalDtype):
        adata.obs[key] = adata.obs[key].astype(str).astype("category")
    categories, colors = _matched_colors(adata, key, key_added)
    adata.uns[f"{key}_colors"] = colors
    return colors


def _matched_colors(adata: Any, key: str, key_added: str) -> tuple[list[str], list[str]]:
    """The categories of ``obs[key]`` and their colours matched to ``orca_label``'s (see
    :func:`match_colors`), without writing anything.
    """
    from .._colors import colors_of

    lab, novel = _labels(adata, key_added)
    col = adata.obs[key]
    cats = col.cat.categories if isinstance(col.dtype, pd.CategoricalDtype) else pd.unique(
        col.astype(str)
    )  # fmt: skip
    pal = _palette(adata, key_added, [str(c) for c in lab.cat.categories], novel)
    cats = [str(c) for c in cats]
    return cats, colors_of(cats, pal)


def _scatter(ax, xy: np.ndarray, values: np.ndarray, order: list[str], pal: dict[str, Any],
             novel: list[str], size: float) -> None:  # fmt: skip
    """Cells at ``xy`` coloured by ``values``: known categories first, novel clusters on top
    with an outline; a legend beside the axes.
    """
    for c in order:
        if c in novel:
            continue
        m = values == c
        ax.scatter(xy[m, 0], xy[m, 1], s=size, color=pal[c], label=c, linewidths=0)
    for c in novel:
        m = values == c
        ax.scatter(xy[m, 0], xy[m, 1], s=size * 1.6, color=pal[c], label=f"{c} (novel)",
                   edgecolors="0.15", linewidths=0.3)  # fmt: skip
    ax.set_xticks([])
    ax.set_yticks([])
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False,
              markerscale=2.0)  # fmt: skip


def _point_size(n: int) -> float:
    return max(2.0, 120000 / max(n, 1) ** 1.1)


def embedding(
    adata: Any,
    basis: str = "umap",
    *,
    key_added: str = "orca",
    size: float | None = None,
    ax=None,
    show: bool | None = None,
    save: bool | str | None = None,
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
    pal = _palette(adata, key_added, cats, novel)
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 5))
    s = size if size is not None else _point_size(adata.n_obs)
    _scatter(ax, xy, lab.astype(str).to_numpy(), cats, pal, novel, s)
    ax.set_xlabel(f"{basis.upper()}1")
    ax.set_ylabel(f"{basis.upper()}2")
    ax.set_title(f"{key_added}_label")
    return _finish(ax, show, save, "embedding")


def confidence(
    adata: Any,
    *,
    key_added: str = "orca",
    ax=None,
    show: bool | None = None,
    save: bool | str | None = None,
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
    pal = _palette(adata, key_added, cats, novel)
    for patch, c in zip(bp["boxes"], cats, strict=True):
        patch.set_facecolor(pal[c])
    ax.set_xticks(np.arange(1, len(cats) + 1), cats, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel(f"{key_added}_confidence")
    ax.set_ylim(0, 1.02)
    return _finish(ax, show, save, "confidence")


def correspondence(
    adata: Any,
    truth_key: str,
    *,
    key_added: str = "orca",
    normalize: bool = True,
    ax=None,
    show: bool | None = None,
    save: bool | str | None = None,
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
    return _finish(ax, show, save, "correspondence")


def reliability(
    adata: Any,
    truth_key: str,
    *,
    key_added: str = "orca",
    n_bins: int = 10,
    ax=None,
    show: bool | None = None,
    save: bool | str | None = None,
):
    """Reliability diagram of ``orca_confidence`` over the cells labelled a known type, against
    a column of true labels: per bin of confidence, the share of labels that are right, beside
    the diagonal of perfect calibration; the expected calibration error (ECE) in the title.
    ``uns['orca']['confidence']`` gives the same check on held-out labelled cells, without a
    truth column.
    """
    from .._calibration import calibration_bins

    plt = _plt()
    lab, novel = _labels(adata, key_added)
    if truth_key not in adata.obs.columns:
        cols = ", ".join(map(repr, adata.obs.columns))
        raise KeyError(f"truth_key {truth_key!r} is not an obs column; columns: {cols}.")
    label = lab.astype(str).to_numpy()
    known = ~np.isin(label, novel)
    conf = adata.obs[f"{key_added}_confidence"].to_numpy(dtype=np.float64)[known]
    right = (label == adata.obs[truth_key].astype(str).to_numpy())[known].astype(np.float64)
    n, n_right, sum_conf = calibration_bins(conf, right, n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc, mean_conf = n_right / n, sum_conf / n
    if ax is None:
        _, ax = plt.subplots(figsize=(4.2, 4))
    edges = np.linspace(0, 1, n_bins + 1)
    has = n > 0
    ax.bar(edges[:-1][has], acc[has], width=1 / n_bins, align="edge", color="#6baed6",
           edgecolor="white", label="share right")  # fmt: skip
    ax.plot([0, 1], [0, 1], color="0.3", linestyle="--", linewidth=1, label="calibrated")
    ax.scatter(mean_conf[has], acc[has], s=12 + 80 * n[has] / max(n.max(), 1), color="#d62728",
               zorder=3, label="bin (size: cells)")  # fmt: skip
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(f"{key_added}_confidence")
    ax.set_ylabel(f"share of labels right ({truth_key})")
    ece = np.abs(n_right - sum_conf).sum() / n.sum() if n.sum() else float("nan")
    ax.set_title(f"ECE {ece:.3f} over {int(known.sum())} cells labelled a known type", fontsize=9)
    ax.legend(loc="upper left", fontsize=7, frameon=False)
    return _finish(ax, show, save, "reliability")


def novel_markers(
    adata: Any,
    *,
    key_added: str = "orca",
    n_genes: int = 5,
    layer: str | None = None,
    show: bool | None = None,
    save: bool | str | None = None,
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
    return _finish(dp, show, save, "novel_markers")
