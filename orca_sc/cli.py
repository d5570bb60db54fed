"""The ``orca-sc`` command line: a thin shell over the Python API.

Results go to stdout, progress and logs to stderr. Bad input ends with one ``Error: ...`` line on
stderr and exit code 2 (no traceback unless ``orca-sc --debug``), before anything is written.
Outputs are written to temporary files in the target directory and renamed only when all of them
are complete, so an error or Ctrl-C leaves no partial output; input files are only read.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from . import __version__
from ._card import command_line
from ._cli_benchmark import (
    benchmark,
    compare,
)
from ._cli_common import (
    CliError,
    Group,
    Outputs,
    cli_logging,
    errors,
    held_notes,
    rank,
    read_h5ad,
    reported_by_rank0,
)
from ._cli_output import (
    _add,
    _check_obs_key,
    _default_output,
    _echo_summary,
    _output_opts,
    _result_opts,
    _stage_results,
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
    from ._cells import resolve_device
    from ._config import OrcaConfig

    resolve_device(OrcaConfig(device=device).device)  # ConfigError: reported as --device


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
        with held_notes():  # the demo leads with what it found; the notes come below it
            res = run_demo(seed=seed, progress=not quiet)
        adata, metrics = res["adata"], res["report"]
        summary = summarize(adata)
        fig = umap_figure(adata)
        outputs.add(h5, lambda p: adata.write_h5ad(p))
        outputs.add(png, lambda p: fig.savefig(p, dpi=120, bbox_inches="tight"))
        outputs.commit()

    click.echo(f"pbmc68k_reduced: {adata.n_obs} cells; hidden types: {', '.join(DEMO_NOVEL)}")
    _echo_summary(summary, metrics, notes=True)
    click.echo(f"Wrote {h5} and {png}")


main.add_command(benchmark)
main.add_command(compare)
main.add_command(vision)

if __name__ == "__main__":  # pragma: no cover
    main()
