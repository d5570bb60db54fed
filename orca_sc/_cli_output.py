"""What the commands print and write: the option groups they share (results, output), the summary
and metrics on stdout, the staged writing of the annotated file and the report.
"""

from __future__ import annotations

from pathlib import Path

import click

from . import __version__
from ._cli_common import (
    CliError,
    write_json,
)


def _echo_summary(summary: dict, metrics: dict | None, notes: bool = False) -> None:
    """What the run found first (the novel clusters, the cells per label, the self-check and
    metrics), the evidence below it: each novel cluster's verdicts in one line and, with
    ``notes`` (a run whose log held them back), the notes' lines.
    """
    n, novel = summary["n_cells"], summary["novel"]
    in_novel = sum(rec["size"] for rec in novel)
    n_known = len(summary["label_counts"]) - len(novel)
    click.echo(
        f"Annotated {n:,} cells: {len(novel)} novel cluster(s) ({in_novel:,} cells, "
        f"{in_novel / max(n, 1):.0%}) and {n_known} known type(s); mean confidence "
        f"{summary['mean_confidence']:.3f}."
    )
    if novel:
        click.echo("Novel clusters (closest known types; top markers):")
        width = max(len(rec["name"]) for rec in novel)
        for rec in novel:
            close = ", ".join(f"{c['type']} {c['similarity']:.2f}" for c in rec["closest"])
            markers = f"; {', '.join(rec['markers'])}" if rec["markers"] else ""
            click.echo(f"  {rec['name']:<{width}}  {rec['size']:>7,} cells  {close}{markers}")
    else:
        click.echo("No novel clusters: every cell was assigned to a known type.")
    click.echo("Cells per predicted label:")
    width = max(len(k) for k in summary["label_counts"])
    for label, c in summary["label_counts"].items():
        click.echo(f"  {label:<{width}}  {c:>7}  ({c / n:6.1%})")
    check = summary.get("self_check")
    if check is not None:
        click.echo(
            f"Self-check (hidden reference types: {', '.join(check['hidden_types'])}): "
            f"{check['novel_called']:.0%} of their cells called novel, in "
            f"{check['hidden_clusters_found']} cluster(s) for {check['hidden_types_true']} "
            f"type(s); {check['known_called_novel']:.0%} of {check['n_known_cells']} held-out "
            "known-type cells called novel."
        )
    if metrics is not None:
        click.echo(_metrics_table(metrics))
    evidence = [_evidence_line(rec) for rec in novel]
    evidence = [e for e in evidence if e]
    lines = summary.get("notes", []) if notes else []
    if evidence or lines:
        click.echo("Evidence (details in uns['orca']):")
        for line in [*evidence, *lines]:
            click.echo(f"  {line}")


def _evidence_line(rec: dict) -> str:
    """One novel cluster's verdicts in a line: the novelty test's, and the reason when the
    data cannot support the call (empty when both are unremarkable).
    """
    test = rec.get("supported", "not tested")
    if rec.get("evidence") == "cannot tell":
        return f"{rec['name']}: cannot tell: {rec['reason']} (novelty test: {test})"
    if test == "not significant":
        return f"{rec['name']}: novelty test not significant (no evidence either way)"
    return ""


def _metrics_table(m: dict) -> str:
    lines = [
        "Metrics (Cao et al. 2022 protocol):",
        f"  seen accuracy    {m['seen_accuracy']:.3f}   ({m['n_seen_cells']} cells of known types)",
        f"  novel accuracy   {m['novel_accuracy']:.3f}   ({m['n_novel_cells']} cells of novel types)",
        f"  novel NMI        {m['novel_nmi']:.3f}",
        f"  all accuracy     {m['all_accuracy']:.3f}",
        f"  novel clusters   {m['n_novel_found']} found, {m['n_novel_true']} true novel types",
    ]
    return "\n".join(lines)


def _stage_results(adata, outputs, out_path, report_path, report: dict, layer, truth_key):
    """Summary (+ metrics with a truth column), then the annotated file and the report, staged
    in ``outputs`` (the caller commits every staged file together). Returns
    ``(summary, metrics)``.
    """
    from .tl import summarize

    summary = summarize(adata, layer=layer)
    metrics = _truth_metrics(adata, truth_key)
    outputs.add(out_path, lambda p: adata.write_h5ad(p))
    if report_path is not None and report_path.suffix.lower() in (".html", ".htm"):
        from .tl import report as html_report

        outputs.add(
            report_path,
            lambda p: html_report(adata, p, truth_key=truth_key, layer=layer),
        )
    elif report_path is not None:
        rep = {**report, "output": str(out_path), "summary": summary, "metrics": metrics,
               "version": __version__}  # fmt: skip
        outputs.add(report_path, write_json(rep))
    return summary, metrics


def _default_output(query: str) -> Path:
    q = Path(query)
    return q.with_name(f"{q.stem}.orca.h5ad")


def _truth_metrics(adata, truth_key: str | None) -> dict | None:
    from . import metrics

    if truth_key is None:
        return None
    return metrics.report(adata, truth_key)


def _check_obs_key(adata, key: str | None, what: str, option: str) -> None:
    if key is not None and key not in adata.obs.columns:
        cols = ", ".join(map(repr, adata.obs.columns)) or "none"
        raise CliError(f"{option} {key!r} is not a column of the {what}'s obs; columns: {cols}.")


# options shared by annotate and predict
_result_opts = [
    click.option(
        "--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N or mps."
    ),
    click.option(
        "--truth-key",
        default=None,
        help="obs column of the query with true types: print the paper's metrics.",
    ),
    click.option(
        "--report",
        default=None,
        help="Write a report of the run here: a self-contained HTML page (run.html: summary, "
        "plots, novel clusters, notes) or the summary and metrics as JSON (any other name).",
    ),
    click.option(
        "--on-disk",
        is_flag=True,
        help="Leave the expression matrices on disk and read them 10,000 cells at a time, "
        "holding only the genes used (for data larger than memory; .h5ad or .zarr inputs).",
    ),
]


_output_opts = [
    click.option("--overwrite", is_flag=True, help="Replace output files that already exist."),
    click.option("--quiet", "-q", is_flag=True, help="No progress bar or log messages."),
]


def _add(options):
    def deco(f):
        for o in reversed(options):
            f = o(f)
        return f

    return deco
