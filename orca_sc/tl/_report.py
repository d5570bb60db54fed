"""``orca_sc.tl.report``: one self-contained HTML page of an annotation run (images inline, no
network, no script), to read and to share.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

import numpy as np

from .._annotation import RunRecord


def report(
    adata: Any,
    path: str | Path,
    *,
    key_added: str = "orca",
    truth_key: str | None = None,
    basis: str | None = None,
    layer: str | None = None,
) -> Path:
    """Write the run's report as one HTML file: the summary, an embedding coloured by label (and
    by ``truth_key`` when given), each novel cluster's size, markers (a dot plot), closest known
    types and what the novelty test supports, the confidence and novelty distributions (and the
    reliability diagram with a truth column), the self-check when run, the notes and warnings,
    the parameters and the versions.

    Parameters
    ----------
    adata
        AnnData annotated by :func:`orca_sc.tl.annotate` (or :func:`orca_sc.tl.predict`).
    path
        The ``.html`` file to write (replaced if it exists).
    key_added
        The prefix used when annotating.
    truth_key
        ``obs`` column with true labels, to show beside ORCA's.
    basis
        ``obsm['X_{basis}']`` to draw the cells on (default: ``umap`` if computed, else the first
        two principal components of ``obsm['X_{key_added}']``).
    layer
        Expression layer for the markers (default ``.X``).

    Returns
    -------
    The path written.

    """
    from .._errors import OrcaInputError, check_output_path
    from ._summary import summarize

    out = check_output_path(path, "report")
    if f"{key_added}_label" not in adata.obs.columns:
        msg = f"obs['{key_added}_label'] not found; run orca_sc.tl.annotate(...) first."
        raise OrcaInputError(msg)
    if truth_key is not None and truth_key not in adata.obs.columns:
        raise OrcaInputError(f"truth_key {truth_key!r} is not a column of obs.")
    summary = summarize(adata, key_added=key_added, layer=layer)
    page = _Page(adata, key_added, truth_key, summary)
    text = page.render(_coordinates(adata, key_added, basis), layer)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    return out


def _coordinates(adata: Any, key_added: str, basis: str | None) -> tuple[str, np.ndarray]:
    """(name, 2-D coordinates of every cell) to draw on."""
    if basis is None and "X_umap" in adata.obsm:
        basis = "umap"
    if basis is not None:
        key = f"X_{basis}"
        if key not in adata.obsm:
            from .._errors import OrcaInputError

            raise OrcaInputError(f"obsm[{key!r}] not found; compute it or leave basis unset.")
        return basis.upper(), np.asarray(adata.obsm[key])[:, :2]
    emb = np.asarray(adata.obsm[f"X_{key_added}"], dtype=np.float64)
    emb = emb - emb.mean(axis=0)
    _, _, vt = np.linalg.svd(emb[:: max(1, emb.shape[0] // 20000)], full_matrices=False)
    return f"PC of X_{key_added}", emb @ vt[:2].T


def _png(fig) -> str:
    """A matplotlib figure as an inline ``<img>`` (the figure is closed)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="figure" src="data:image/png;base64,{data}">'


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows
    )  # cells are escaped by the caller (some hold markup)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _e(x: Any) -> str:
    return html.escape(str(x))


class _Page:
    """The sections of the report, from the annotated AnnData and its summary."""

    def __init__(self, adata: Any, key: str, truth_key: str | None, summary: dict) -> None:
        from ..pl import _labels, _palette

        self.adata, self.key, self.truth_key, self.summary = adata, key, truth_key, summary
        self.record = RunRecord.from_uns(adata.uns.get(key))
        self.labels, self.novel = _labels(adata, key)
        self.cats = [str(c) for c in self.labels.cat.categories]
        self.colors = _palette(adata, key, self.cats, self.novel)  # one colour per label

    def render(self, coords: tuple[str, np.ndarray], layer: str | None) -> str:
        from .. import __version__

        sections = [
            self._summary(),
            self._embedding(*coords),
            self._novel(layer),
            self._confidence(),
            self._self_check(),
            self._notes(),
            self._parameters(),
        ]
        body = "\n".join(s for s in sections if s)
        title = f"orca_sc annotation report: {self.adata.n_obs:,} cells"
        return (
            "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{_e(title)}</h1><p class='sub'>orca_sc {__version__} · ORCA open-world "
            "annotation (Cao, Brbić &amp; Leskovec, ICLR 2022)</p>"
            f"{body}</body></html>\n"
        )

    def _summary(self) -> str:
        s = self.summary
        novel = {r["name"] for r in s["novel"]}
        colors = self.colors
        rows = []
        for label, n in s["label_counts"].items():
            swatch = f"<span class='sw' style='background:{colors.get(label, '#999')}'></span>"
            kind = "novel cluster" if label in novel else "known type"
            rows.append([swatch + _e(label), f"{n:,}", f"{n / s['n_cells']:.1%}", kind])
        n_novel_cells = sum(s["label_counts"].get(n, 0) for n in novel)
        mode = self.record.mode
        lead = (
            f"<p>{s['n_cells']:,} cells ({_e(mode)} mode): {len(s['label_counts']) - len(novel)} "
            f"known types and <b>{len(novel)} novel clusters</b> ({n_novel_cells:,} cells, "
            f"{n_novel_cells / max(s['n_cells'], 1):.1%}). Mean confidence "
            f"{s['mean_confidence']:.3f}.</p>"
        )
        return "<h2>Summary</h2>" + lead + _table(["label", "cells", "share", "kind"], rows)

    def _embedding(self, name: str, xy: np.ndarray) -> str:
        import matplotlib.pyplot as plt

        from ..pl import _matched_colors, _point_size, _scatter

        panels = 2 if self.truth_key else 1
        fig, axes = plt.subplots(1, panels, figsize=(8.5 * panels, 5.2), squeeze=False)
        fig.subplots_adjust(wspace=0.75)  # room for the first panel's legend
        size = _point_size(self.adata.n_obs) / 3
        _scatter(axes[0, 0], xy, self.labels.astype(str).to_numpy(), self.cats, self.colors,
                 self.novel, size)  # fmt: skip
        axes[0, 0].set_title(f"{self.key}_label")
        if self.truth_key:
            t_cats, t_colors = _matched_colors(self.adata, self.truth_key, self.key)
            truth = self.adata.obs[self.truth_key].astype(str).to_numpy()
            pal = dict(zip(t_cats, t_colors, strict=True))
            _scatter(axes[0, 1], xy, truth, t_cats, pal, [], size)
            axes[0, 1].set_title(self.truth_key)
        for ax in axes[0]:
            ax.set_xlabel(f"{name} 1")
            ax.set_ylabel(f"{name} 2")
        text = (
            "<p>Known types are drawn muted, novel clusters in strong colours on top; a type has "
            "one colour in every panel.</p>"
        )
        return "<h2>Cells</h2>" + text + _png(fig)

    def _novel(self, layer: str | None) -> str:
        novel = self.summary["novel"]
        if not novel:
            return "<h2>Novel clusters</h2><p>No novel cluster: every cell got a known type.</p>"
        test = self.record.novelty_test or {}
        shares = dict(
            zip(
                test.get("clusters", {}).get("cluster", []),
                test.get("clusters", {}).get("share_p_below_alpha", []),
                strict=False,
            )
        )
        colors = self.colors
        rows = []
        for r in novel:
            swatch = f"<span class='sw' style='background:{colors.get(r['name'], '#999')}'></span>"
            closest = ", ".join(f"{_e(c['type'])} {c['similarity']:.2f}" for c in r["closest"])
            share = shares.get(r["name"])
            verdict = _e(r["supported"]) + (f" ({share:.0%} of cells p ≤ α)" if share is not None
                                           else "")  # fmt: skip
            if r.get("evidence") == "cannot tell":
                verdict += f"; <b>the data cannot support this call</b>: {_e(r['reason'])}"
            rows.append([swatch + _e(r["name"]), f"{r['size']:,}", _e(", ".join(r["markers"])),
                         closest, verdict])  # fmt: skip
        alpha = test.get("alpha")
        lead = (
            "<p>Each novel cluster: its size, top markers (Wilcoxon, the cluster against the rest), "
            "the known types whose mean expression it resembles most (centred correlation), and "
            "whether the conformal novelty test finds its cells unlike the reference"
            + (f" at α = {alpha}" if alpha is not None else "")
            + ": <i>significant</i> supports a new type; <i>not significant</i> is no evidence "
            "either way (little power for types close to a known one); <i>cannot tell</i>: too "
            "few labelled cells to calibrate the test. Where the test does not confirm a cluster "
            "and the cluster is small or its closest known type has few labels, the data cannot "
            "support the call, and the row says why.</p>"
        )
        premise = test.get("premise", {})
        failed = [b for b, h in zip(premise.get("batch", []), premise.get("holds", []),
                                    strict=False) if h == "fails"]  # fmt: skip
        if failed:
            lead += (
                f"<p><b>In {_e(', '.join(failed))} the test's premise fails</b>: cells labelled a "
                "known type there have p ≤ α more often than cells like the reference's ever do "
                "(2α), so a cluster of that batch is compared with those cells instead (Fisher's "
                "exact test).</p>"
            )
        out = "<h2>Novel clusters</h2>" + lead
        out += _table(["cluster", "cells", "markers", "closest known types", "novelty test"], rows)
        try:
            from ..pl import novel_markers

            dp = novel_markers(self.adata, key_added=self.key, n_genes=4, layer=layer, show=False)
            out += "<h3>Markers across all labels</h3>" + _png(dp.make_figure() or dp.fig)
        except (ValueError, KeyError) as e:  # no markers to draw
            out += f"<p>No marker dot plot: {_e(e)}</p>"
        return out

    def _confidence(self) -> str:
        import matplotlib.pyplot as plt

        from ..pl import confidence, reliability

        rec = self.record.confidence or {}
        obs = self.adata.obs
        panels = 3 if self.truth_key else 2
        fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4), squeeze=False)
        confidence(self.adata, key_added=self.key, ax=axes[0, 0], show=False)
        ax = axes[0, 1]
        ax.hist(obs[f"{self.key}_novelty"].to_numpy(), bins=30, color="#6baed6",
                label=f"{self.key}_novelty")  # fmt: skip
        pcol = f"{self.key}_novelty_pvalue"
        if pcol in obs:
            p = obs[pcol].to_numpy()
            ax.hist(p[np.isfinite(p)], bins=30, color="#d62728", alpha=0.5, label="p-value")
        ax.set_xlabel("value")
        ax.set_ylabel("cells")
        ax.legend(fontsize=7, frameon=False)
        if self.truth_key:
            reliability(self.adata, self.truth_key, key_added=self.key, ax=axes[0, 2], show=False)
        fig.tight_layout()
        meaning = rec.get("meaning", "")
        ece = rec.get("ece_heldout")
        text = f"<p><b>{self.key}_confidence</b>: {_e(meaning)}."
        if ece is not None:
            text += (
                f" Expected calibration error on held-out labelled cells {ece:.3f} (the "
                f"uncalibrated softmax: {rec.get('ece_heldout_uncalibrated', float('nan')):.3f})."
            )
        text += (
            f" <b>{self.key}_novelty</b>: about uniform on known types, near 1 for cells unlike "
            "every known type; p-values: small for cells unlike the reference.</p>"
        )
        return "<h2>Confidence and novelty</h2>" + text + _png(fig)

    def _self_check(self) -> str:
        check = self.summary.get("self_check")
        if not check:
            return ""
        rows = [[_e(k), _e(round(v, 4) if isinstance(v, float) else v)] for k, v in check.items()]
        lead = (
            "<p>Some reference types were hidden and treated as novel, to see how the discovery "
            "rules do on this data (the annotation is unchanged).</p>"
        )
        return "<h2>Self-check</h2>" + lead + _table(["figure", "value"], rows)

    def _notes(self) -> str:
        notes = self.record.notes
        if not notes:
            return (
                "<h2>Notes</h2><p>None: the run raised no warning about what the data support.</p>"
            )
        items = "".join(
            f"<li><b>{_e(n.line)}</b>" + (f"<br>{_e(n)}" if str(n) != n.line else "") + "</li>"
            for n in notes
        )
        return f"<h2>Notes and warnings</h2><ul class='notes'>{items}</ul>"

    def _parameters(self) -> str:
        from .._card import _versions

        rec = self.record
        params = rec.params
        rows = []
        for k, v in params.items():
            if isinstance(v, dict):
                rows += [[_e(f"{k}.{kk}"), _e(vv)] for kk, vv in v.items()]
            else:
                rows.append([_e(k), _e(v)])
        versions = ", ".join(f"{k} {v}" for k, v in _versions().items())
        training = rec.training or {}
        seed = "?" if rec.seed is None else rec.seed
        lead = (
            f"<p>Annotated with orca_sc {_e(rec.version)}, seed {_e(seed)}, on {_e(training.get('device', '?'))} in "
            f"{training.get('seconds', float('nan')):.1f} s of training. This report: "
            f"{_e(versions)}.</p>"
        )
        return "<h2>Parameters and versions</h2>" + lead + _table(["option", "value"], rows)


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:0}.sub{color:#666;margin-top:.2em}
h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.8em}
table{border-collapse:collapse;font-size:.9em;margin:.5em 0}
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f4f4f4}img{max-width:100%;height:auto;display:block;margin:.5em 0}
.sw{display:inline-block;width:.8em;height:.8em;margin-right:.4em;border-radius:2px;
vertical-align:middle}
.notes li{margin:.3em 0}
"""
