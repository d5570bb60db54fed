"""The ``orca-sc`` command line: a thin shell over the Python API.

Results go to stdout, progress and logs to stderr. Bad input ends with one ``Error: ...`` line on
stderr and exit code 2 (no traceback unless ``orca-sc --debug``), before anything is written.
Outputs are written to temporary files in the target directory and renamed only when all of them
are complete, so an error or Ctrl-C leaves no partial output; input files are only read.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
from pathlib import Path

import click

from . import __version__
from ._card import command_line
from ._cli_common import (
    CliError,
    Group,
    Outputs,
    cli_logging,
    errors,
    rank,
    read_h5ad,
    reported_by_rank0,
    write_json,
)
from ._cli_vision import vision

logger = logging.getLogger("orca_sc")


def _parse_n_novel(value: str) -> int | str:
    v = value.strip().lower()
    if v == "auto":
        return "auto"
    try:
        n = int(v)
    except ValueError:
        n = -1
    if n < 0:
        raise CliError(f"--n-novel must be a non-negative integer or 'auto', got {value!r}.")
    return n


def _check_device(device: str) -> None:
    from ._config import OrcaConfig
    from ._train import resolve_device

    resolve_device(OrcaConfig(device=device).device)  # ConfigError: reported as --device


def _echo_summary(summary: dict, metrics: dict | None) -> None:
    n = summary["n_cells"]
    click.echo(f"Annotated {n} cells; mean confidence {summary['mean_confidence']:.3f}.")
    click.echo("Cells per predicted label:")
    width = max(len(k) for k in summary["label_counts"])
    for label, c in summary["label_counts"].items():
        click.echo(f"  {label:<{width}}  {c:>7}  ({c / n:6.1%})")
    if summary["novel"]:
        click.echo("Novel clusters:")
        for rec in summary["novel"]:
            close = ", ".join(f"{c['type']} {c['similarity']:.2f}" for c in rec["closest"])
            click.echo(
                f"  {rec['name']} ({rec['size']} cells) — closest: {close}; "
                f"novelty test: {rec.get('supported', 'not tested')}"
            )
            if rec["markers"]:
                click.echo(f"      top markers: {', '.join(rec['markers'])}")
            if rec.get("evidence") == "cannot tell":
                click.echo(f"      the data cannot support this call: {rec['reason']}")
    else:
        click.echo("No novel clusters: every cell was assigned to a known type.")
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


# ----------------------------------------------------------------------------------- commands
@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="orca-sc")
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
def main(debug: bool) -> None:
    """Open-world cell-type annotation with ORCA (Cao, Brbić & Leskovec, ICLR 2022).

    Every query cell is assigned to a known type of a labelled reference or to a newly
    discovered novel cluster.

    \b
    Examples:
      orca-sc demo
      orca-sc annotate kidney.h5ad marrow.h5ad --labels-key cell_type -o marrow.orca.h5ad
      orca-sc predict model.pt new_cells.h5ad
    """


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


@main.command()
@click.argument("reference", metavar="REF.h5ad")
@click.argument("query", metavar="QUERY.h5ad...", nargs=-1, required=True)
@click.option(
    "--labels-key", required=True, help="obs column of the reference with the cell types."
)
@click.option(
    "-o",
    "--output",
    default=None,
    help="Annotated query (default: QUERY.orca.h5ad beside the query).",
)
@click.option(
    "--n-novel",
    default="auto",
    show_default=True,
    help="Expected number of novel types, or 'auto' to estimate it.",
)
@click.option(
    "--n-genes",
    default=2000,
    show_default=True,
    type=int,
    help="Highly variable genes to use (0: all shared genes).",
)
@click.option("--layer", default=None, help="Use this layer instead of .X (in both files).")
@click.option(
    "--batch-key", default=None, help="obs column with batches (gene selection and alignment)."
)
@click.option(
    "--unlabeled-category",
    multiple=True,
    default=("Unknown",),
    show_default=True,
    help="Reference label values meaning 'unlabelled' (repeatable).",
)
@click.option("--epochs", default=20, show_default=True, type=int, help="Training epochs.")
@click.option(
    "--warmup-epochs",
    default=5,
    show_default=True,
    type=int,
    help="Supervised warm-up epochs before novel heads are added (< --epochs).",
)
@click.option(
    "--batch-size", default=512, show_default=True, type=int, help="Cells per mini-batch."
)
@click.option("--lr", default=1e-3, show_default=True, type=float, help="Adam learning rate.")
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=int,
    help="Random seed (same seed and device: same labels).",
)
@click.option(
    "--save-model", default=None, help="Also save the trained model here (for 'orca-sc predict')."
)
@click.option(
    "--self-check",
    is_flag=True,
    help="Also hide some reference types, treat them as novel and report how the discovery "
    "rules did on them (one more warm-up; the annotation is unchanged).",
)
@click.option(
    "--novelty-alpha",
    default=0.05,
    show_default=True,
    type=float,
    help="Level of the conformal novelty test (obs 'orca_novelty_pvalue'): known-type cells "
    "like the reference's get p <= alpha at most this often.",
)
@click.option(
    "--novelty-folds",
    default=5,
    show_default=True,
    type=int,
    help="Folds of labelled cells that cross-fit the novelty p-values, one warm-up each "
    "(0: no p-values).",
)
@click.option(
    "--integration",
    type=click.Choice(["none", "harmony", "mnn"]),
    default="none",
    show_default=True,
    help="harmony: discovery reads reference and query integrated by Harmony on their joint "
    "PCA; mnn: each query batch moved onto the reference by its mutual nearest neighbours, "
    "per neighbourhood (recorded in uns 'orca' 'estimate' 'integration').",
)
@click.option(
    "--pca-input",
    type=click.Choice(["log", "pearson", "auto"]),
    default="auto",
    show_default=True,
    help="What discovery's PCA reads: log-normalised values, Pearson residuals of the counts, "
    "or auto (the residuals where the labelled cells are told apart better in them; recorded "
    "in uns 'orca' 'estimate' 'integration').",
)
@click.option(
    "--discovery-cells",
    default=20_000,
    show_default=True,
    type=int,
    help="Above this many cells the warm-ups and discovery run on a random sample of this many, "
    "so that novel types are called as on data of that size (0: on every cell; recorded in "
    "uns 'orca' 'estimate' 'sample').",
)
@click.option(
    "--use-rep",
    default=None,
    metavar="KEY",
    help="Discovery reads your own joint embedding obsm KEY (e.g. X_scVI), present in reference "
    "and query alike, instead of a PCA.",
)
@click.option(
    "--majority-vote",
    is_flag=True,
    help="Refine the labels by majority voting over an over-clustering of the query "
    "(CellTypist's rule); the per-cell labels are kept in obs 'orca_label_per_cell'.",
)
@_add(_result_opts)
@_add(_output_opts)
@click.pass_context
def annotate(ctx, reference, query, labels_key, output, n_novel, n_genes, layer, batch_key,
             unlabeled_category, epochs, warmup_epochs, batch_size, lr, device, seed, save_model, self_check,
             novelty_alpha, novelty_folds, integration, pca_input, discovery_cells, use_rep, majority_vote, truth_key,
             report, on_disk, overwrite, quiet):  # fmt: skip
    """Annotate QUERY.h5ad (one or several) with the cell types of REF.h5ad, discovering
    novel types.

    Both files may hold raw counts or log-normalised values; genes are matched by name. The query
    is written with obs 'orca_label' (known type or novel_1, novel_2, ...), 'orca_novel',
    'orca_confidence', obsm 'X_orca' and uns 'orca'. A summary (cells per label, novel
    clusters with their top markers and closest known types) is printed on stdout. Several
    queries train one model (a novel type found in several gets one name); each is written
    beside itself as QUERY.orca.h5ad.

    \b
    Examples:
      orca-sc annotate kidney.h5ad marrow.h5ad --labels-key cell_type
      orca-sc annotate atlas.h5ad sample1.h5ad sample2.h5ad --labels-key cell_type
      orca-sc annotate ref.h5ad query.h5ad --labels-key cell_type -o out.h5ad \\
          --n-novel 3 --save-model model.pt --truth-key true_type --report report.json
    """
    from ._config import DEFAULT, MIN_DISCOVERY_CELLS, resolve_config
    from .tl import annotate as tl_annotate

    rank0 = rank() == 0  # under torchrun, rank 0 logs and writes
    quiet = quiet or not rank0
    with reported_by_rank0(), errors(ctx), cli_logging(quiet, silent=not rank0):
        n_novel_v = _parse_n_novel(n_novel)
        if discovery_cells < 0 or 0 < discovery_cells < MIN_DISCOVERY_CELLS:
            raise CliError(
                f"--discovery-cells must be 0 (every cell) or at least {MIN_DISCOVERY_CELLS} "
                f"cells, got {discovery_cells}."
            )
        if n_genes < 0:
            raise CliError(
                f"--n-genes must be a non-negative integer (0: all shared genes), got {n_genes}."
            )
        # --warmup-epochs left at its default counts as not given: a short --epochs run then
        # shortens the warm-up (resolve_config's rule) instead of failing
        default = ctx.get_parameter_source("warmup_epochs") is click.core.ParameterSource.DEFAULT
        cfg = resolve_config(
            None,
            "orca-sc annotate",
            n_novel=n_novel_v,
            n_genes=n_genes or None,
            layer=layer,
            batch_key=batch_key,
            unlabeled_category=tuple(unlabeled_category),
            epochs=epochs,
            warmup_epochs=DEFAULT if default else warmup_epochs,
            batch_size=batch_size,
            lr=lr,
            device=device,
            seed=seed,
            progress=not quiet,
            self_check=self_check,
            novelty_alpha=novelty_alpha,
            novelty_folds=novelty_folds,
            integration=integration,
            pca_input=pca_input,
            discovery_cells=discovery_cells or None,
            use_rep=use_rep,
            majority_vote=majority_vote,
        )
        _check_device(device)
        several = len(query) > 1
        if several and (output is not None or report is not None):
            raise CliError(
                "-o/--output and --report take one query; with several queries each is written "
                "beside its own file as QUERY.orca.h5ad (drop -o and --report)."
            )
        outputs = Outputs(overwrite, [reference, *query])
        out_paths = [
            outputs.claim(output if output is not None else _default_output(q), "Output file")
            for q in query
        ]
        model_path = outputs.claim(save_model, "Model file") if save_model is not None else None
        report_path = outputs.claim(report, "Report file") if report is not None else None

        ref = read_h5ad(reference, "Reference", on_disk)
        adatas = [read_h5ad(q, "Query", on_disk) for q in query]
        for a in adatas:
            _check_obs_key(a, truth_key, "query", "--truth-key")
        try:  # the model file is staged by rank 0 and committed with the other outputs
            with command_line(ctx.meta.get("orca_argv", sys.argv[1:])):  # the model's card
                tl_annotate(adatas if several else adatas[0], ref, labels_key=labels_key,
                            config=cfg, save_model=outputs.staged(model_path) if rank0 else None)  # fmt: skip
            if not rank0:
                return
            # each query to its own file (a report only with one query), committed together
            results = [_stage_results(
                a, outputs, path, report_path,
                {"command": "annotate", "reference": reference, "query": q,
                 "n_novel": dict(a.uns["orca"]["n_novel"])},
                layer, truth_key,
            ) for a, path, q in zip(adatas, out_paths, query, strict=True)]  # fmt: skip
            outputs.commit()
        finally:
            outputs.discard()

    for q, (summary, metrics) in zip(query, results, strict=True):
        if several:
            click.echo(f"== {q}")
        _echo_summary(summary, metrics)
    click.echo(
        f"Wrote {', '.join(map(str, out_paths))}"
        + (f", {model_path}" if model_path else "")
        + (f", {report_path}" if report_path else "")
    )


@main.command()
@click.argument("model", metavar="MODEL")
@click.argument("query", metavar="QUERY.h5ad", required=False)
@click.option(
    "--info",
    is_flag=True,
    help="Print the model's card (reference, per-type accuracy, novel clusters, versions) and "
    "exit; QUERY is not needed.",
)
@click.option(
    "-o",
    "--output",
    default=None,
    help="Labelled query (default: QUERY.orca.h5ad beside the query).",
)
@click.option("--layer", default=None, help="Use this layer instead of .X.")
@click.option(
    "--batch-key",
    default=None,
    help="obs column with batches of the new cells (each aligned separately).",
)
@_add(_result_opts)
@_add(_output_opts)
@click.pass_context
def predict(
    ctx,
    model,
    query,
    info,
    output,
    layer,
    batch_key,
    device,
    truth_key,
    report,
    on_disk,
    overwrite,
    quiet,
):
    """Label QUERY.h5ad with a model saved by 'orca-sc annotate --save-model' (no retraining).

    Genes are matched by name; model genes missing from the query are reported and set to zero
    (an error when fewer than half of them are present). Cells get the known types and novel
    clusters of the model.

    \b
    Examples:
      orca-sc predict model.pt new_cells.h5ad
      orca-sc predict model.pt new_cells.h5ad -o labelled.h5ad --batch-key sample
      orca-sc predict model.pt --info
    """
    from ._model import OrcaModel
    from .tl import predict as tl_predict

    if info:
        with errors(ctx):
            click.echo(OrcaModel.load(model).describe())
        return
    if query is None:
        raise click.UsageError("Missing argument 'QUERY.h5ad' (or pass --info).")
    with errors(ctx), cli_logging(quiet):
        from ._dist import launched

        if launched():
            raise CliError(
                "predict runs in one process; run 'orca-sc predict' without torchrun "
                "(torchrun is for training: 'torchrun ... -m orca_sc annotate')."
            )
        _check_device(device)
        outputs = Outputs(overwrite, [model, query])
        out_path = outputs.claim(
            output if output is not None else _default_output(query), "Output file"
        )
        report_path = outputs.claim(report, "Report file") if report is not None else None
        m = OrcaModel.load(model)
        adata = read_h5ad(query, "Query", on_disk)
        _check_obs_key(adata, truth_key, "query", "--truth-key")
        tl_predict(adata, m, layer=layer, batch_key=batch_key, device=device)
        n_missing = adata.uns["orca"]["n_genes_missing"]
        logger.info(
            "%d of the model's %d genes found in the query.", len(m.genes) - n_missing, len(m.genes)
        )
        summary, metrics = _stage_results(
            adata, outputs, out_path, report_path,
            {"command": "predict", "model": model, "query": query, "n_genes_missing": n_missing},
            layer, truth_key,
        )  # fmt: skip
        outputs.commit()

    _echo_summary(summary, metrics)
    click.echo(f"Wrote {out_path}" + (f", {report_path}" if report_path else ""))


@main.command()
@click.option(
    "--outdir",
    default="orca_demo",
    show_default=True,
    help="Directory for the annotated file and the UMAP plot (created; its demo files are replaced).",
)
@click.option("--seed", default=0, show_default=True, type=int, help="Random seed.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or log messages.")
@click.pass_context
def demo(ctx, outdir, seed, quiet):
    """Run the built-in example on real data shipped with scanpy (no download).

    pbmc68k_reduced: 700 PBMCs of 10 FACS-sorted types. Three types (CD14+ Monocyte, CD19+ B,
    Dendritic) are hidden from the labels, half of the cells of the other types are labelled, and
    ORCA annotates the rest. Prints the paper's metrics, writes OUTDIR/pbmc68k_orca.h5ad and
    OUTDIR/pbmc68k_orca_umap.png (UMAP of the ORCA embedding coloured by truth and orca_label).

    \b
    Example:
      orca-sc demo --outdir demo_out
    """
    from ._demo import DEMO_NOVEL, run_demo, umap_figure
    from .tl import summarize

    with errors(ctx), cli_logging(quiet):
        d = Path(outdir)
        if d.exists() and not d.is_dir():
            raise CliError(f"--outdir {outdir!r} exists and is not a directory.")
        d.mkdir(parents=True, exist_ok=True)
        outputs = Outputs(True, [])
        h5 = outputs.claim(d / "pbmc68k_orca.h5ad", "Output file")
        png = outputs.claim(d / "pbmc68k_orca_umap.png", "Plot file")
        res = run_demo(seed=seed, progress=not quiet)
        adata, metrics = res["adata"], res["report"]
        summary = summarize(adata)
        fig = umap_figure(adata)
        outputs.add(h5, lambda p: adata.write_h5ad(p))
        outputs.add(png, lambda p: fig.savefig(p, dpi=120, bbox_inches="tight"))
        outputs.commit()

    click.echo(f"pbmc68k_reduced: {adata.n_obs} cells; hidden types: {', '.join(DEMO_NOVEL)}")
    _echo_summary(summary, metrics)
    click.echo(f"Wrote {h5} and {png}")


def _csv_list(value: str | None, cast=str) -> list | None:
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    try:
        return [cast(v) for v in items]
    except ValueError:
        raise CliError(
            f"expected a comma-separated list of {cast.__name__}s, got {value!r}."
        ) from None


@main.command()
@click.option(
    "--outdir",
    default="orca_benchmark",
    show_default=True,
    help="Directory for report.md, CSVs and plots.",
)
@click.option(
    "--data-dir",
    default=None,
    help="Directory with the shared real datasets (tasks for the files found there).",
)
@click.option("--task", "tasks", multiple=True, help="Run only these built-in tasks (repeatable).")
@click.option(
    "--h5ad",
    default=None,
    help="Benchmark on your own labelled h5ad instead of the built-in tasks.",
)
@click.option("--labels-key", default=None, help="With --h5ad: obs column with the cell types.")
@click.option(
    "--batch-key",
    default=None,
    help="With --h5ad: obs column with batches/tissues (cross-batch split).",
)
@click.option(
    "--reference-batches", default=None, help="With --batch-key: comma-separated reference batches."
)
@click.option(
    "--seen-fraction",
    default=0.5,
    show_default=True,
    type=float,
    help="Protocol split: fraction of classes seen.",
)
@click.option(
    "--labeled-fraction",
    default=0.5,
    show_default=True,
    type=float,
    help="Protocol split: fraction of each seen class labelled.",
)
@click.option(
    "--seen-classes",
    default=None,
    help="Protocol split: comma-separated seen classes (instead of drawing them).",
)
@click.option(
    "--novel-classes",
    default=None,
    help="Cross-batch split: classes hidden from the reference (comma-separated).",
)
@click.option(
    "--method", "methods", multiple=True, help="Run only these methods (repeatable; see report)."
)
@click.option("--seeds", default="0,1,2", show_default=True, help="Comma-separated seeds.")
@click.option(
    "--ablation-seeds",
    default="0",
    show_default=True,
    help="Seeds for the ablations and over-provisioned heads (each run costs as much as ORCA).",
)
@click.option(
    "--suite",
    type=click.Choice(["builtin", "dev"]),
    default="builtin",
    show_default=True,
    help="builtin: the shared real tasks; dev: the development suite (real tasks both ways, "
    "their hard corners: novel types beside a close known type, 5-25 labels per type, queries "
    "of 15 cells per type, queries without novel types; the protocol, and a simulator sweep), "
    "reported in suite.md with the seed spread and the worst task per goal.",
)
@click.option(
    "--large",
    is_flag=True,
    help="With --suite dev: the large tier too (the scale task at 50,000 and 100,000 cells, the "
    "real count-data tasks grown to ~50,000 cells); run it for every change of discovery or "
    "training length.",
)
@click.option(
    "--scaling/--no-scaling",
    default=None,
    help="Also measure time and memory vs cells (default: with --suite builtin).",
)
@click.option(
    "--scaling-sizes",
    default="2000,10000,100000",
    show_default=True,
    help="Cells for the scaling runs (in memory; ORCA with defaults and CellTypist).",
)
@click.option(
    "--scaling-disk-sizes",
    default="",
    help="Cells for scaling runs read from disk (ORCA alone; e.g. 1000000). The simulated file "
    "is written once to the data cache and kept.",
)
@click.option(
    "--scaling-only",
    is_flag=True,
    help="Run the scaling section alone (no tasks, no baselines); writes scaling.md, .csv, .png.",
)
@click.option(
    "--scaling-library-size",
    default="150",
    show_default=True,
    help="Counts per simulated cell in the scaling runs, comma-separated for several: 150 gives "
    "the sparsity of real data after gene selection (about 6% non-zeros), 3000 a dense matrix "
    "(43%); e.g. 150,3000 runs every size at both.",
)
@click.option(
    "--quick",
    is_flag=True,
    help="CI mode: pbmc68k_reduced protocol, one seed, three methods, tiny scaling.",
)
@click.option(
    "--only",
    multiple=True,
    help="Run only the task of this name, or the tasks whose name contains this text (repeatable).",
)
@click.option(
    "--set",
    "set_pairs",
    multiple=True,
    metavar="KEY=VALUE",
    help="With --method ORCA alone: an OrcaConfig or DiscoveryConfig option, or a setting of "
    "orca_sc.benchmark.Ablation (the paper's ablations, a discovery rule's constant), for every "
    "run (repeatable, e.g. --set novelty_folds=0, --set margin=zero); the runs then carry the suite's full figures "
    "for `orca-sc compare`.",
)
@click.option(
    "--task-seed",
    type=int,
    default=None,
    help="With --method ORCA alone: draw every task's split with this seed and vary only the "
    "model's seed (the same data, another seed).",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Share the runs among this many worker processes (each task and seed in one), each at "
    "torch's thread count divided by the jobs (at least 1); the figures are those of one "
    "process at that thread count (e.g. OMP_NUM_THREADS=1 ... --jobs 2 on 2 cores). The "
    "scaling section runs in the main process, alone.",
)
@_add(_output_opts)
@click.pass_context
def benchmark(ctx, outdir, data_dir, tasks, h5ad, labels_key, batch_key, reference_batches,
              seen_fraction, labeled_fraction, seen_classes, novel_classes, methods, seeds, ablation_seeds, suite,
              large, scaling, scaling_sizes, scaling_disk_sizes, scaling_only, scaling_library_size, quick,
              only, set_pairs, task_seed, jobs, overwrite, quiet):  # fmt: skip
    """Compare ORCA, its ablations and baselines on open-world tasks; write a report.

    Built-in tasks: the paper's protocol on scanpy's pbmc68k_reduced, plus the shared real
    datasets found in --data-dir (Tabula Muris kidney -> marrow, pancreas mouse 1 -> mouse 2,
    PBMC Drop-seq -> inDrops, and the protocol on MCA bladder and worm neurons). --suite dev
    adds these tasks the other way round and a simulator sweep (see suite.md). With --h5ad,
    one task from your own data: the protocol split, or a cross-batch split with --batch-key and
    --reference-batches. Writes OUTDIR/report.md, runs.csv, summary.csv, bars.png and, with
    scaling, scaling.csv and scaling.png.

    \b
    Examples:
      orca-sc benchmark --quick
      orca-sc benchmark --data-dir ../shared/data --outdir bench
      orca-sc benchmark --h5ad atlas.h5ad --labels-key cell_type --batch-key tissue \\
          --reference-batches Kidney --seeds 0,1
    """
    from . import benchmark as B

    with errors(ctx), cli_logging(quiet):
        seed_list = _csv_list(seeds, int)
        if not seed_list:
            raise CliError("--seeds must list at least one seed, e.g. --seeds 0,1,2.")
        out = _benchmark_outdir(outdir, overwrite, "scaling.md" if scaling_only else "report.md")
        if data_dir is not None and not Path(data_dir).is_dir():
            raise CliError(f"--data-dir {data_dir!r} is not a directory.")
        default_methods = B.SUITE_METHODS if suite == "dev" else B.DEFAULT_METHODS
        method_list = list(methods) or (B.QUICK_METHODS if quick else default_methods)
        if scaling is None:
            scaling = suite == "builtin"
        unknown = sorted(set(method_list) - set(B.METHODS))
        if unknown:
            raise CliError(f"unknown --method {unknown}; available: {', '.join(B.METHODS)}.")
        sizes = _csv_list(scaling_sizes, int)
        disk_sizes = _csv_list(scaling_disk_sizes, int)
        libraries = _csv_list(scaling_library_size, float)
        if not libraries or not all(math.isfinite(v) and v > 0 for v in libraries):
            raise CliError(
                f"--scaling-library-size {scaling_library_size!r}: give positive counts per "
                "cell, comma-separated (e.g. 150,3000)."
            )
        if quick:
            seed_list = seed_list[:1]
            sizes, disk_sizes = [500, 1000], []
        if scaling_only:
            if not (sizes or disk_sizes):
                raise CliError("--scaling-only needs --scaling-sizes or --scaling-disk-sizes.")
            sc = B.run_scaling(
                sizes, n_genes=500 if quick else 2000, progress=not quiet,
                library_size=libraries, disk_sizes=disk_sizes,
            )  # fmt: skip
            paths = _write_benchmark(None, out, False, scaling=sc)
            click.echo((out / "scaling.md").read_text())
            click.echo(f"Wrote {out}/: " + ", ".join(sorted(p.name for p in paths.values())))
            return
        if h5ad is not None:
            split = {"batch_key": batch_key, "reference_batches": reference_batches,
                     "novel_classes": novel_classes, "seen_fraction": seen_fraction,
                     "labeled_fraction": labeled_fraction, "seen_classes": seen_classes}  # fmt: skip
            specs = [_h5ad_task(h5ad, labels_key, split)]
        else:
            if large and suite != "dev":
                raise CliError(
                    "--large adds the development suite's large tier: use it with --suite dev."
                )
            specs = _builtin_specs(suite, data_dir, quick, tasks, large)
        if only:
            specs = B.select_tasks(specs, only)
            if not specs:
                raise CliError(f"no task name is or contains any of --only {list(only)}.")
        orca_alone = method_list == ["ORCA"] and (
            suite == "dev" or set_pairs or task_seed is not None
        )
        if (set_pairs or task_seed is not None) and method_list != ["ORCA"]:
            raise CliError("--set and --task-seed apply to ORCA alone: add --method ORCA.")
        if orca_alone:
            overrides = _overrides(set_pairs)
            runs = B.run_orca_suite(
                specs, seed_list, overrides, task_seed=task_seed, progress=not quiet, jobs=jobs
            )
            result = B.BenchmarkResult(runs, B.summarize_runs(runs))
            result.settings = {"version": orca_sc_version(), "seeds": seed_list,
                               "torch_threads": _run_threads(runs),
                               "jobs": jobs, "overrides": overrides,
                               "task_seed": task_seed}  # fmt: skip
        else:
            abl_list = _csv_list(ablation_seeds, int) or seed_list
            result = B.run_benchmark(
                specs, method_list, seed_list, ablation_seeds=abl_list, progress=not quiet,
                jobs=jobs,
            )  # fmt: skip
        if scaling and (sizes or disk_sizes):
            result.scaling = B.run_scaling(
                sizes, n_genes=500 if quick else 2000, progress=not quiet,
                library_size=libraries, disk_sizes=disk_sizes,
            )  # fmt: skip
        paths = _write_benchmark(result, out, suite == "dev")

    click.echo((out / ("suite.md" if suite == "dev" else "report.md")).read_text())
    click.echo(f"Wrote {out}/: " + ", ".join(sorted(p.name for p in paths.values())))


def _overrides(pairs: tuple[str, ...]) -> dict:
    """``--set`` pairs as configuration options, checked before any run."""
    from . import benchmark as B
    from ._ablation import split_options
    from ._config import resolve_config

    try:
        overrides = B.config_overrides(pairs)
        options, _ = split_options(overrides)  # the method's settings: an Ablation, checked
        resolve_config(None, "--set", **options)
    except (TypeError, ValueError) as e:
        raise CliError(f"--set: {e}") from None
    return overrides


def orca_sc_version() -> str:
    from . import __version__

    return __version__


def _run_threads(runs) -> int | None:
    """The torch threads the suite's runs had (one count; ``None`` for no runs)."""
    if "torch_threads" not in getattr(runs, "columns", ()) or runs.empty:
        return None
    return int(runs["torch_threads"].max())


@main.command()
@click.argument("before", type=click.Path(dir_okay=False))
@click.argument("after", type=click.Path(dir_okay=False))
@click.option("--out", default=None, help="Also write the tables to this Markdown file.")
@click.option(
    "--before-prefix",
    default="",
    help="Read the before run's figures from the columns of this prefix (per_cell_: a run with "
    "majority_vote=True keeps the unvoted labels there).",
)
@click.option("--after-prefix", default="", help="As --before-prefix, for the after run.")
@click.option(
    "--check",
    is_flag=True,
    help="Exit with status 1 when a task fails the drops check (a change meant to move no label).",
)
@click.pass_context
def compare(ctx, before, after, out, before_prefix, after_prefix, check):
    """Before/after tables of two development-suite runs (their runs.csv).

    Per task the four figures with their seed spread (novel->novel, known->novel, all-class
    accuracy, novel clusters found against the true number), how many tasks meet each goal,
    the drops check, and the training steps of the after run.

    \b
    Example:
      orca-sc benchmark --suite dev --method ORCA --outdir before
      orca-sc benchmark --suite dev --method ORCA --set novelty_folds=0 --outdir after
      orca-sc compare before/runs.csv after/runs.csv --out compare.md
    """
    import pandas as pd

    from . import benchmark as B

    with errors(ctx):
        runs = []
        for name, path, prefix in (
            ("BEFORE", before, before_prefix),
            ("AFTER", after, after_prefix),
        ):
            try:
                df = pd.read_csv(path)
            except (OSError, ValueError) as e:
                reason = " ".join(str(e).split())
                raise CliError(f"{name} {path!r} cannot be read as a CSV file: {reason}") from None
            missing = sorted({"task", "seed", *B.compare_columns()} - set(df.columns))
            if missing:
                raise CliError(
                    f"{name} {path!r} is not a suite's runs.csv: it lacks the columns {missing}."
                )
            runs.append(B.orca_runs(df, prefix))
        result = B.compare_runs(*runs)
        if result.n_tasks == 0:
            raise CliError("BEFORE and AFTER have no task in common.")
        if out is not None:
            Path(out).write_text(result.markdown)
    click.echo(result.markdown)
    if check and result.failing:
        ctx.exit(1)


def _benchmark_outdir(outdir: str, overwrite: bool, report: str = "report.md") -> Path:
    """The report folder, checked before any work (``report``: the file a run writes)."""
    out = Path(outdir)
    if out.exists() and not out.is_dir():
        raise CliError(f"--outdir {outdir!r} exists and is not a directory.")
    if out.is_dir() and (out / report).exists() and not overwrite:
        raise CliError(
            f"{outdir!r} already holds a report; pass --overwrite or choose another --outdir."
        )
    parent = out.resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise CliError(f"Cannot write into {str(parent)!r}; choose another --outdir.")
    return out


def _h5ad_task(h5ad: str, labels_key: str | None, split: dict):
    """The one task of ``--h5ad``: a cross-batch split with ``--batch-key``, else the protocol;
    the split is validated now (seed 0). The task builds from the file's path (read once per
    process), so that worker processes of ``--jobs`` can build it too.
    """
    from . import benchmark as B

    if labels_key is None:
        raise CliError("--h5ad needs --labels-key naming the cell-type column.")
    adata = _benchmark_h5ad(h5ad)
    name = Path(h5ad).stem
    if split["batch_key"] is not None:
        refs = _csv_list(split["reference_batches"])
        if not refs:
            raise CliError(
                "--batch-key needs --reference-batches, e.g. --reference-batches Kidney."
            )
        kw = {"novel_classes": _csv_list(split["novel_classes"]) or ()}
        B.batch_split(adata, labels_key, split["batch_key"], refs)  # validate now
        kw |= {"name": f"{name}_cross_batch"}
        make = functools.partial(
            _h5ad_split, h5ad, "batch", (labels_key, split["batch_key"], refs), kw
        )
        return B.TaskSpec(f"{name}_cross_batch", "cross-batch", make, h5ad)
    kw = dict(seen_fraction=split["seen_fraction"], labeled_fraction=split["labeled_fraction"],
              seen_classes=_csv_list(split["seen_classes"]))  # fmt: skip
    B.protocol_split(adata, labels_key, **kw)  # validate now
    kw |= {"name": f"{name}_protocol"}
    make = functools.partial(_h5ad_split, h5ad, "protocol", (labels_key,), kw)
    return B.TaskSpec(f"{name}_protocol", "protocol", make, h5ad)


def _benchmark_h5ad(h5ad: str):
    """The ``--h5ad`` file, read once per process (again where the file changed)."""
    st = os.stat(h5ad) if os.path.exists(h5ad) else None
    return _read_benchmark_h5ad(h5ad, st and (st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=1)
def _read_benchmark_h5ad(h5ad: str, stamp):
    return read_h5ad(h5ad, "Benchmark")


def _h5ad_split(h5ad: str, kind: str, args: tuple, kw: dict, seed: int):
    """The ``--h5ad`` task at ``seed``: :func:`~orca_sc.benchmark.batch_split` (``kind="batch"``)
    or :func:`~orca_sc.benchmark.protocol_split` of the file.
    """
    from . import benchmark as B

    split = B.batch_split if kind == "batch" else B.protocol_split
    return split(_benchmark_h5ad(h5ad), *args, seed=seed, **kw)


def _builtin_specs(
    suite: str, data_dir: str | None, quick: bool, tasks: tuple[str, ...], large: bool = False
):
    """The built-in tasks (or the development suite, with its large tier where ``large``),
    those named by ``--task`` only.
    """
    from . import benchmark as B

    if suite == "dev":
        specs = B.dev_suite(data_dir, large=not quick, scale=large)
    else:
        specs = B.builtin_tasks(None if quick else data_dir)
    if quick:
        keep = ("pbmc68k_protocol", "sim_query150", "sim_speed_1k_1k")
        specs = [s for s in specs if s.name in keep]
    if tasks:
        missing = sorted(set(tasks) - {s.name for s in specs})
        if missing:
            avail = ", ".join(s.name for s in specs)
            raise CliError(
                f"unknown --task {missing}; available here: {avail} (more with --data-dir)."
            )
        specs = [s for s in specs if s.name in tasks]
    return specs


def _write_benchmark(result, out: Path, dev: bool, scaling=None) -> dict:
    """The report files, written into a temporary folder beside ``out`` and moved in
    (``result`` ``None`` and a ``scaling`` table: the scaling section alone).
    """
    import shutil
    import tempfile

    from . import benchmark as B

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.resolve().parent))
    try:
        paths = B.write_report(result, tmp) if result is not None else B.write_scaling(scaling, tmp)
        if dev:
            paths["suite"] = tmp / "suite.md"
            paths["suite"].write_text(B.suite_markdown(result.runs, result.settings))
        out.mkdir(exist_ok=True)
        for p in paths.values():
            os.replace(p, out / p.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths


main.add_command(vision)

if __name__ == "__main__":  # pragma: no cover
    main()
