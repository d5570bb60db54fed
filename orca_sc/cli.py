"""The ``orca-sc`` command line: a thin shell over the Python API.

Results go to stdout, progress and logs to stderr. Bad input ends with one ``Error: ...`` line on
stderr and exit code 2 (no traceback unless ``orca-sc --debug``), before anything is written.
Outputs are written to temporary files in the target directory and renamed only when all of them
are complete, so an error or Ctrl-C leaves no partial output; input files are only read.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from . import __version__

logger = logging.getLogger("orca_sc")

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class CliError(click.ClickException):
    """A user error: printed as one ``Error: ...`` line on stderr, exit code 2."""

    exit_code = EXIT_BAD_INPUT


class _Command(click.Command):
    """Usage errors (missing argument, bad option value) on one line, like every other error."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            if ctx.resilient_parsing:
                raise
            msg = f"{e.format_message()} See 'orca-sc {ctx.info_name} --help'."
            raise CliError(msg) from None


class _Group(click.Group):
    command_class = _Command

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            if ctx.resilient_parsing:
                raise
            raise CliError(f"{e.format_message()} See 'orca-sc --help'.") from None

    def resolve_command(self, ctx: click.Context, args: list[str]):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as e:
            raise CliError(f"{e.format_message()} See 'orca-sc --help'.") from None


# ------------------------------------------------------------------------------------ helpers
@contextmanager
def _errors(ctx: click.Context):
    """Turn the package's input errors into one-line CLI errors (full traceback with --debug)."""
    from ._errors import ConfigError, OrcaInputError, TrainingDivergedError

    debug = ctx.find_root().params.get("debug", False)
    try:
        yield
    except click.ClickException:
        raise
    except KeyboardInterrupt:
        click.echo("Interrupted; no output was written.", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except ConfigError as e:
        if debug:
            raise
        raise CliError(_option_message(ctx, e)) from None
    except (OrcaInputError, ValueError, KeyError) as e:
        if debug:
            raise
        raise CliError(_message(e)) from None
    except TrainingDivergedError as e:
        if debug:
            raise
        err = click.ClickException(_message(e))
        raise err from None
    except Exception as e:
        if debug:
            raise
        msg = f"unexpected {type(e).__name__}: {_message(e)} (run 'orca-sc --debug ...' for the traceback)"
        raise click.ClickException(msg) from None


def _rank() -> int:
    """The rank of this process under ``torchrun`` (0 otherwise)."""
    return int(os.environ.get("RANK", "0"))


@contextmanager
def _reported_by_rank0():
    """Under ``torchrun`` only rank 0 reports an error (the others exit with the same status,
    silently): every rank meets the same error.
    """
    try:
        yield
    except click.ClickException as e:
        if _rank() != 0:
            sys.exit(e.exit_code)
        raise


def _option_message(ctx: click.Context, e: Any) -> str:
    """A :class:`~orca_sc._errors.ConfigError` in the command's own terms: the field and any
    other field it names become the command-line options (``warmup_epochs=5`` -> ``--warmup-epochs
    5``).
    """
    flags = {
        p.name: p.opts[-1] for p in ctx.command.params if isinstance(p, click.Option) and p.name
    }

    def cli(text: str) -> str:
        for name, flag in flags.items():
            text = re.sub(rf"\b{name}=(\S+?)\b", rf"{flag} \1", text)
        return text

    value = e.value if isinstance(e.value, (int, float, str)) else repr(e.value)
    name = flags.get(e.option)
    if name is None:
        return _message(e)
    return " ".join(f"Invalid {name} {value}: expected {cli(e.expected)}.".split())


def _message(e: BaseException) -> str:
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(str(msg).split())  # always one line


@contextmanager
def _cli_logging(quiet: bool, silent: bool = False):
    """Log and warn on stderr as single lines; ``quiet`` keeps only warnings and errors,
    ``silent`` (the ranks other than 0 under torchrun) only errors.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.ERROR if silent else logging.WARNING if quiet else logging.INFO)

    def show(message, category, filename, lineno, file=None, line=None):
        click.echo(f"Warning: {' '.join(str(message).split())}", err=True)

    try:
        with warnings.catch_warnings():  # restores the filters and showwarning on exit
            # orca_sc's own warnings are for the user; third-party notices are noise here
            warnings.simplefilter("ignore")
            if not silent:
                warnings.filterwarnings("default", category=UserWarning, module=r"orca_sc(\.|$)")
            warnings.showwarning = show
            yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def _read_h5ad(path: str, what: str, on_disk: bool = False):
    import anndata as ad

    from ._errors import check_input_file

    if on_disk:
        from ._io import read_lazy

        return read_lazy(path, what)  # its OrcaInputError is reported like any other

    p = check_input_file(path, what, "an .h5ad file")
    try:
        adata = ad.read_h5ad(p)
    except Exception as e:  # noqa: BLE001 - any failure to parse means an unusable file
        msg = (
            f"Cannot read {what} file {path!r} as h5ad ({type(e).__name__}); it is not an AnnData "
            ".h5ad file or it is truncated/corrupt. Re-export it with adata.write_h5ad()."
        )
        raise CliError(msg) from None
    return adata


class _Outputs:
    """Output files, checked before any work and committed together (temp file + rename)."""

    def __init__(self, overwrite: bool, inputs: list[str]) -> None:
        self.overwrite = overwrite
        self.inputs = {Path(p).resolve() for p in inputs}
        self.pending: list[tuple[Path, Callable[[Path], None]]] = []
        self.claimed: dict[Path, str] = {}

    def claim(self, path: str | Path, what: str) -> Path:
        if not str(path).strip():
            raise CliError(f"{what} path is empty; give a file name or leave the option out.")
        p = Path(path)
        full = p.resolve()
        if full in self.claimed:
            other = self.claimed[full]
            raise CliError(
                f"{what} and {other.lower()} are the same file {str(p)!r}; give each its own path."
            )
        if full in self.inputs:
            raise CliError(
                f"{what} {str(p)!r} is one of the input files; inputs are never modified. Choose another path."
            )
        if p.is_dir():
            raise CliError(f"{what} {str(p)!r} is a directory; give a file name.")
        if p.exists() and not self.overwrite:
            raise CliError(
                f"{what} {str(p)!r} already exists; pass --overwrite to replace it or choose another path."
            )
        parent = p.parent  # Path("x.h5ad").parent is Path(".")
        if not parent.is_dir():
            raise CliError(
                f"Directory {str(parent)!r} for the {what.lower()} does not exist; create it first."
            )
        if not os.access(parent, os.W_OK | os.X_OK):
            raise CliError(
                f"Directory {str(parent)!r} is not writable; choose another location for the {what.lower()}."
            )
        self.claimed[full] = what
        return p

    def add(self, path: Path, write: Callable[[Path], None]) -> None:
        self.pending.append((path, write))

    def commit(self) -> None:
        temps: list[tuple[Path, Path]] = []
        try:
            for path, write in self.pending:
                tmp = path.with_name(f".{path.stem}.orca-tmp-{os.getpid()}{path.suffix}")
                temps.append((tmp, path))
                write(tmp)
            for tmp, path in temps:
                os.replace(tmp, path)
        finally:
            for tmp, _ in temps:
                if tmp.exists():
                    tmp.unlink()


def _write_json(obj: Any) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")

    return write


def _json_default(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


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
            click.echo(f"  {rec['name']} ({rec['size']} cells) — closest: {close}")
            if rec["markers"]:
                click.echo(f"      top markers: {', '.join(rec['markers'])}")
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


def _save_results(adata, outputs, out_path, report_path, report: dict, layer, truth_key):
    """Summary (+ metrics with a truth column), then the annotated file and the JSON report,
    committed together. Returns ``(summary, metrics)``.
    """
    from .tl import summarize

    summary = summarize(adata, layer=layer)
    metrics = _truth_metrics(adata, truth_key)
    outputs.add(out_path, lambda p: adata.write_h5ad(p))
    if report_path is not None:
        rep = {**report, "output": str(out_path), "summary": summary, "metrics": metrics,
               "version": __version__}  # fmt: skip
        outputs.add(report_path, _write_json(rep))
    outputs.commit()
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
@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
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
    click.option("--report", default=None, help="Write the summary (and metrics) as JSON here."),
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
@click.argument("query", metavar="QUERY.h5ad")
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
    "--min-steps",
    default=300,
    show_default=True,
    type=int,
    help="Minimum optimiser steps (small data trains for more epochs).",
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
@_add(_result_opts)
@_add(_output_opts)
@click.pass_context
def annotate(ctx, reference, query, labels_key, output, n_novel, n_genes, layer, batch_key,
             unlabeled_category, epochs, warmup_epochs, min_steps, batch_size, lr, device, seed, save_model, self_check,
             truth_key, report, on_disk, overwrite, quiet):  # fmt: skip
    """Annotate QUERY.h5ad with the cell types of REF.h5ad, discovering novel types.

    Both files may hold raw counts or log-normalised values; genes are matched by name. The query
    is written with obs 'orca_label' (known type or novel_1, novel_2, ...), 'orca_novel',
    'orca_confidence', obsm 'X_orca' and uns 'orca'. A summary (cells per label, novel
    clusters with their top markers and closest known types) is printed on stdout.

    \b
    Examples:
      orca-sc annotate kidney.h5ad marrow.h5ad --labels-key cell_type
      orca-sc annotate ref.h5ad query.h5ad --labels-key cell_type -o out.h5ad \\
          --n-novel 3 --save-model model.pt --truth-key true_type --report report.json
    """
    from ._pipeline import DEFAULT, fit, resolve_config
    from .tl._annotate import write_annotation

    rank0 = _rank() == 0  # under torchrun, rank 0 logs and writes
    quiet = quiet or not rank0
    with _reported_by_rank0(), _errors(ctx), _cli_logging(quiet, silent=not rank0):
        n_novel_v = _parse_n_novel(n_novel)
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
            min_steps=min_steps,
            batch_size=batch_size,
            lr=lr,
            device=device,
            seed=seed,
            progress=not quiet,
            self_check=self_check,
        )
        _check_device(device)
        outputs = _Outputs(overwrite, [reference, query])
        out_path = outputs.claim(
            output if output is not None else _default_output(query), "Output file"
        )
        model_path = outputs.claim(save_model, "Model file") if save_model is not None else None
        report_path = outputs.claim(report, "Report file") if report is not None else None

        ref = _read_h5ad(reference, "Reference", on_disk)
        adata = _read_h5ad(query, "Query", on_disk)
        _check_obs_key(adata, truth_key, "query", "--truth-key")
        model, result = fit(adata, ref, labels_key, cfg)
        if not rank0:
            return
        write_annotation(adata, "orca", model, result)
        if model_path is not None:
            outputs.add(model_path, model.save)
        summary, metrics = _save_results(
            adata, outputs, out_path, report_path,
            {"command": "annotate", "reference": reference, "query": query,
             "n_novel": dict(adata.uns["orca"]["n_novel"])},
            layer, truth_key,
        )  # fmt: skip

    _echo_summary(summary, metrics)
    click.echo(
        f"Wrote {out_path}"
        + (f", {model_path}" if model_path else "")
        + (f", {report_path}" if report_path else "")
    )


@main.command()
@click.argument("model", metavar="MODEL")
@click.argument("query", metavar="QUERY.h5ad")
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
    """
    from ._model import OrcaModel
    from .tl import predict as tl_predict

    with _errors(ctx), _cli_logging(quiet):
        from ._dist import launched

        if launched():
            raise CliError(
                "predict runs in one process; run 'orca-sc predict' without torchrun "
                "(torchrun is for training: 'torchrun ... -m orca_sc annotate')."
            )
        _check_device(device)
        outputs = _Outputs(overwrite, [model, query])
        out_path = outputs.claim(
            output if output is not None else _default_output(query), "Output file"
        )
        report_path = outputs.claim(report, "Report file") if report is not None else None
        m = OrcaModel.load(model)
        adata = _read_h5ad(query, "Query", on_disk)
        _check_obs_key(adata, truth_key, "query", "--truth-key")
        tl_predict(adata, m, layer=layer, batch_key=batch_key, device=device)
        n_missing = adata.uns["orca"]["n_genes_missing"]
        logger.info(
            "%d of the model's %d genes found in the query.", len(m.genes) - n_missing, len(m.genes)
        )
        summary, metrics = _save_results(
            adata, outputs, out_path, report_path,
            {"command": "predict", "model": model, "query": query, "n_genes_missing": n_missing},
            layer, truth_key,
        )  # fmt: skip

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

    with _errors(ctx), _cli_logging(quiet):
        d = Path(outdir)
        if d.exists() and not d.is_dir():
            raise CliError(f"--outdir {outdir!r} exists and is not a directory.")
        d.mkdir(parents=True, exist_ok=True)
        outputs = _Outputs(True, [])
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
    "the protocol, and a simulator sweep over query size, labels, novel types, batch strength "
    "and imbalance), reported in suite.md.",
)
@click.option(
    "--scaling/--no-scaling",
    default=None,
    help="Also measure time and memory vs cells (default: with --suite builtin).",
)
@click.option(
    "--scaling-sizes",
    default="10000,30000,100000,300000",
    show_default=True,
    help="Cells for the scaling runs.",
)
@click.option(
    "--scaling-library-size",
    default=150.0,
    show_default=True,
    type=float,
    help="Counts per simulated cell in the scaling runs: 150 gives the sparsity of real data "
    "after gene selection (about 6% non-zeros), 3000 a dense matrix (43%).",
)
@click.option(
    "--quick",
    is_flag=True,
    help="CI mode: pbmc68k_reduced protocol, one seed, three methods, tiny scaling.",
)
@_add(_output_opts)
@click.pass_context
def benchmark(ctx, outdir, data_dir, tasks, h5ad, labels_key, batch_key, reference_batches,
              seen_fraction, labeled_fraction, seen_classes, novel_classes, methods, seeds, ablation_seeds, suite,
              scaling, scaling_sizes, scaling_library_size, quick, overwrite, quiet):  # fmt: skip
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
    import shutil
    import tempfile

    from . import benchmark as B

    with _errors(ctx), _cli_logging(quiet):
        seed_list = _csv_list(seeds, int)
        if not seed_list:
            raise CliError("--seeds must list at least one seed, e.g. --seeds 0,1,2.")
        out = Path(outdir)
        if out.exists() and not out.is_dir():
            raise CliError(f"--outdir {outdir!r} exists and is not a directory.")
        if out.is_dir() and (out / "report.md").exists() and not overwrite:
            raise CliError(
                f"{outdir!r} already holds a report; pass --overwrite or choose another --outdir."
            )
        parent = out.resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise CliError(f"Cannot write into {str(parent)!r}; choose another --outdir.")
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
        if quick:
            seed_list = seed_list[:1]
            sizes = [1000, 2000]
        if h5ad is not None:
            if labels_key is None:
                raise CliError("--h5ad needs --labels-key naming the cell-type column.")
            adata = _read_h5ad(h5ad, "Benchmark")
            name = Path(h5ad).stem
            if batch_key is not None:
                refs = _csv_list(reference_batches)
                if not refs:
                    raise CliError(
                        "--batch-key needs --reference-batches, e.g. --reference-batches Kidney."
                    )
                B.batch_split(adata, labels_key, batch_key, refs)  # validate now
                hidden = _csv_list(novel_classes) or ()

                def make(s):
                    return B.batch_split(
                        adata, labels_key, batch_key, refs, novel_classes=hidden, seed=s,
                        name=f"{name}_cross_batch",
                    )  # fmt: skip

                specs = [B.TaskSpec(f"{name}_cross_batch", "cross-batch", make, h5ad)]
            else:
                kw = dict(seen_fraction=seen_fraction, labeled_fraction=labeled_fraction,
                          seen_classes=_csv_list(seen_classes))  # fmt: skip
                B.protocol_split(adata, labels_key, **kw)  # validate now

                def make(s):
                    return B.protocol_split(
                        adata, labels_key, seed=s, name=f"{name}_protocol", **kw
                    )

                specs = [B.TaskSpec(f"{name}_protocol", "protocol", make, h5ad)]
        else:
            if suite == "dev":
                specs = B.dev_suite(data_dir, large=not quick)
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
        abl_list = _csv_list(ablation_seeds, int) or seed_list
        result = B.run_benchmark(
            specs, method_list, seed_list, ablation_seeds=abl_list, progress=not quiet
        )
        if scaling and sizes:
            result.scaling = B.run_scaling(
                sizes, n_genes=500 if quick else 2000, progress=not quiet,
                library_size=scaling_library_size,
            )  # fmt: skip
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
        try:
            paths = B.write_report(result, tmp)
            if suite == "dev":
                paths["suite"] = tmp / "suite.md"
                paths["suite"].write_text(B.suite_markdown(result.runs, result.settings))
            out.mkdir(exist_ok=True)
            for p in paths.values():
                os.replace(p, out / p.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    click.echo((out / ("suite.md" if suite == "dev" else "report.md")).read_text())
    click.echo(f"Wrote {out}/: " + ", ".join(sorted(p.name for p in paths.values())))


def _register_vision() -> None:
    from ._cli_vision import vision

    main.add_command(vision)


_register_vision()

if __name__ == "__main__":  # pragma: no cover
    main()
