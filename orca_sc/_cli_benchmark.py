"""The benchmark and compare commands of orca-sc: the open-world benchmark (the paper's protocol,
cross-batch splits, a user's own h5ad, the development suite) and the comparison of two sets of
runs.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import click

from ._cli_common import (
    CliError,
    Command,
    cli_logging,
    errors,
    read_h5ad,
)
from ._cli_output import _add, _output_opts


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


@click.command(cls=Command)
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
    help="Run only the task of this name, or the tasks whose name contains this text; "
    "family:real every task of a real dataset family, family:TEXT those of the families whose "
    "name contains TEXT (repeatable).",
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


@click.command(cls=Command)
@click.argument("before", type=click.Path(dir_okay=False))
@click.argument("after", type=click.Path(dir_okay=False))
@click.option("--out", default=None, help="Also write the tables to this Markdown file.")
@click.option(
    "--before-prefix",
    default="",
    help="Read the before run's figures from the columns of this prefix (e.g. per_cell: a run "
    "with majority_vote=True keeps the unvoted labels' figures in the columns "
    "per_cell_novel_called, per_cell_all_acc and so on).",
)
@click.option("--after-prefix", default="", help="As --before-prefix, for the after run.")
@click.option(
    "--ceiling",
    default=None,
    type=click.Path(dir_okay=False),
    help="The runs.csv of the supervised reference on the same tasks and seeds (--method "
    "'Supervised reference (query labels, CV)'): adds the goals per dataset family on the tasks "
    "where it meets them, and the leave-one-family-out verdict.",
)
@click.option(
    "--check",
    is_flag=True,
    help="Exit with status 1 when a task fails the drops check (a change meant to move no label).",
)
@click.pass_context
def compare(ctx, before, after, out, before_prefix, after_prefix, ceiling, check):
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
    from . import benchmark as B

    with errors(ctx):
        runs = []
        for name, path, prefix in (
            ("BEFORE", before, before_prefix),
            ("AFTER", after, after_prefix),
        ):
            runs.append(B.orca_runs(_runs_csv(name, path), prefix))
        ref = None
        if ceiling is not None:
            from .benchmark._suite_table import REFERENCE

            df = _runs_csv("--ceiling", ceiling)
            ref = B.orca_runs(df, method=REFERENCE) if "method" in df else df.iloc[:0]
            if ref.empty:
                raise CliError(f"--ceiling {ceiling!r} holds no rows of method {REFERENCE!r}.")
        result = B.compare_runs(*runs, ceiling=ref)
        if result.n_tasks == 0:
            raise CliError("BEFORE and AFTER have no task in common.")
        if out is not None:
            Path(out).write_text(result.markdown)
    click.echo(result.markdown)
    if check and result.failing:
        ctx.exit(1)


def _runs_csv(name: str, path: str):
    """A suite's runs.csv, checked for the columns the comparison reads."""
    import pandas as pd

    from . import benchmark as B

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
    return df


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
