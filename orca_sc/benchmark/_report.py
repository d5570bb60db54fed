"""Benchmark output: CSV files, a Markdown report and plots in one directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ._methods import METHODS
from ._run import METRICS, BenchmarkResult

_LABELS = {"seen_acc": "seen", "novel_acc": "novel", "novel_nmi": "novel NMI", "all_acc": "all"}


def _fmt(mean: float, sd: float, n: int) -> str:
    if mean != mean:  # NaN
        return "–"
    return f"{mean:.3f} ± {sd:.3f}" if n > 1 else f"{mean:.3f}"


def markdown(result: BenchmarkResult) -> str:
    s = result.summary
    st = result.settings
    lines = [
        "# orca_sc open-world benchmark",
        "",
        f"orca_sc {st.get('version')}; seeds {st.get('seeds')} (ablations and heads: "
        f"{st.get('ablation_seeds', st.get('seeds'))}); torch threads "
        f"{st.get('torch_threads')} on {st.get('n_cpus')} CPUs. Mean ± sd over seeds. Metrics "
        "(Cao et al. 2022): seen = accuracy on cells of reference types; novel = accuracy on "
        "cells of novel types after Hungarian matching; all = Hungarian accuracy over all "
        "classes; clusters = novel labels produced (true number in brackets); time = wall "
        "seconds; memory = peak resident memory above the level before the method (MB; memory "
        "the process already holds from earlier methods is reused and not counted).",
        "",
        "Baselines are stand-ins built on scikit-learn/scanpy and named for what they are: "
        "*LR + oracle reject + KMeans* is given the true novel fraction (rejection threshold) and "
        "the true number of novel types; *KMeans/Leiden on query* cannot name types, so their "
        "clusters are named by the Hungarian matching against the truth (an oracle); *kNN "
        "transfer (ingest-like)* reimplements `sc.tl.ingest`'s PCA projection + neighbour vote "
        "because `sc.tl.ingest` crashes with pynndescent 0.7.0. *Supervised reference* is no "
        "peer: logistic regression trained on the query's own true labels (novel types "
        "included, 5-fold cross-validation), what the expression supports at best.",
        "",
    ]
    if result.unavailable:
        lines.append("Methods that could not run here:")
        lines += [f"- **{k}**: {v}" for k, v in result.unavailable.items()]
        lines.append("")
    for task, g in s.groupby("task", sort=False):
        true_k = int(g["novel_true"].iloc[0])
        lines += [
            f"## {task}",
            "",
            "| method | seen | novel | novel NMI | all | clusters | time (s) | memory (MB) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for _, r in g.iterrows():
            n = int(r["n_seeds"])
            cells = [_fmt(r[f"{m}_mean"], r[f"{m}_sd"], n) for m in METRICS]
            err = f" ({int(r['errors'])} failed)" if r.get("errors", 0) else ""
            lines.append(
                f"| {r['method']}{err} | "
                + " | ".join(cells)
                + f" | {r['novel_found_mean']:.1f} ({true_k}) | {r['seconds_mean']:.1f} | "
                f"{r['peak_mb_mean']:.0f} |"
            )
        lines.append("")
    lines += _findings(s, result.runs)
    if result.scaling is not None and not result.scaling.empty:
        lines += [SCALING_HEADING, "", _scaling_table(result.scaling)]
    lines += ["", "## Methods", ""]
    lines += [
        f"- **{name}** ({METHODS[name].family}): {METHODS[name].description}"
        for name in st.get("methods", [])
    ]
    return "\n".join(lines) + "\n"


def _findings(s: pd.DataFrame, runs: pd.DataFrame | None = None) -> list[str]:
    """Where ORCA does not beat its margin ablations on novel accuracy, or a baseline beats it.

    Ablations are compared with ORCA on the seeds the ablation ran (from ``runs``), baselines
    with ORCA's mean over all seeds.
    """
    out = ["## Where ORCA does not come first", ""]
    for task, g in s.groupby("task", sort=False):
        by = g.set_index("method")
        if "ORCA" not in by.index:
            continue
        orca = by.loc["ORCA"]
        for other in ("ORCA-ZM", "ORCA-FNM"):
            if other not in by.index:
                continue
            ref, seeds = orca["novel_acc_mean"], "all seeds"
            if runs is not None and not runs.empty:
                r = runs[runs["task"] == task]
                other_seeds = sorted(int(x) for x in r.loc[r["method"] == other, "seed"].unique())
                ref = r[(r["method"] == "ORCA") & r["seed"].isin(other_seeds)]["novel_acc"].mean()
                seeds = f"seeds {other_seeds}"
            if by.loc[other, "novel_acc_mean"] >= ref:
                out.append(
                    f"- {task}: {other} novel accuracy {by.loc[other, 'novel_acc_mean']:.3f} ≥ "
                    f"ORCA {ref:.3f} ({seeds})"
                )
        base = by[by["family"] == "baseline"]
        for m in METRICS:
            if base.empty or base[f"{m}_mean"].isna().all():
                continue
            best = base[f"{m}_mean"].idxmax()
            if base.loc[best, f"{m}_mean"] > orca[f"{m}_mean"]:
                out.append(
                    f"- {task}: {best} beats ORCA on {_LABELS[m]} "
                    f"({base.loc[best, f'{m}_mean']:.3f} vs {orca[f'{m}_mean']:.3f})"
                )
    if len(out) == 2:
        out.append("- nowhere in this run")
    return [*out, ""]


SCALING_HEADING = "## Scaling (simulated counts, 2,000 genes)"


def _scaling_table(sc: pd.DataFrame) -> str:
    """One row per method, size and density: wall time, ORCA's time over CellTypist's on the
    same data, ORCA's training steps per phase (of the schedule's, and why the phase stopped),
    memory; then ORCA's seconds per stage (:func:`_stage_table`).
    """
    lines = [
        "| method | cells | non-zeros | data | time (s) | × CellTypist | steps: warm-up / "
        "open-world (of the schedule's) | s/epoch | FLOP floor s/epoch | all-class acc. | "
        "memory (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    sc = sc.copy()
    if "library_size" not in sc:  # a table written before densities were swept
        sc["library_size"] = np.nan
    key = sc["library_size"].fillna(-1.0)
    peers = sc[sc["method"] != "ORCA"]
    pairs = zip(peers["n_cells"], key[peers.index], strict=True)
    other = dict(zip(pairs, peers["seconds"], strict=True))
    for i, r in sc.iterrows():

        def g(k, fmt, r=r):
            v = r.get(k, np.nan)
            return format(v, fmt) if isinstance(v, (int, float)) and v == v else "–"

        n = int(r["n_cells"])
        ratio = "–"
        peer = other.get((r["n_cells"], key[i]))
        if r["method"] == "ORCA" and peer is not None and r.get("storage", "memory") == "memory":
            ratio = f"{r['seconds'] / peer:.2f}"
        steps = "–"
        if r["method"] == "ORCA" and "warmup_steps" in r and r["warmup_steps"] == r["warmup_steps"]:
            steps = " / ".join(
                f"{int(r[f'{c}_steps'])} ({int(r[f'{c}_max_steps'])}, {r[f'{c}_stopped']})"
                for c in ("warmup", "open_world")
            )
        lines.append(
            f"| {r['method']} | {n:,} | {g('non_zeros', '.0%')} | {r.get('storage', 'memory')} | "
            f"{g('seconds', '.1f')} | {ratio} | {steps} | {g('seconds_per_epoch', '.2f')} | "
            f"{g('flop_floor_seconds_per_epoch', '.2f')} | {g('all_accuracy', '.3f')} | "
            f"{g('peak_mb', '.0f')} |"
        )
    return "\n".join(lines) + "\n" + _stage_table(sc)


def _stage_table(sc: pd.DataFrame) -> str:
    """ORCA's seconds per stage of the pipeline, one column per run of the scaling table
    (stages that run inside another are indented and not part of the sum again); empty where
    the runs carry no stage columns.
    """
    from ._hooks import StageTimer
    from ._scaling import STAGE_ORDER, STAGE_PREFIX

    runs = sc[sc["method"] == "ORCA"]
    rank = {name: i for i, name in enumerate(STAGE_ORDER)}
    cols = sorted(
        (c for c in sc.columns if str(c).startswith(STAGE_PREFIX)),
        key=lambda c: rank.get(c[len(STAGE_PREFIX) :], len(rank)),
    )
    if runs.empty or not cols:
        return ""
    heads = [
        f"{int(r['n_cells']):,} {r.get('storage', 'memory')}"
        + (f", {r['non_zeros']:.0%}" if r.get("non_zeros") == r.get("non_zeros") else "")
        for _, r in runs.iterrows()
    ]
    lines = ["", "ORCA's seconds per stage (indented: inside the stage above it, not added again; "
             "the margin's refresh runs in every phase):", "",
             "| stage | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]  # fmt: skip
    for c in cols:
        name = c[len(STAGE_PREFIX) :]
        label = f"&nbsp;&nbsp;{name}" if name in StageTimer.NESTED else name
        vals = [f"{v:.2f}" if v == v else "–" for v in runs[c]]
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    lines.append("| total | " + " | ".join(f"{v:.2f}" for v in runs["seconds"]) + " |")
    return "\n".join(lines) + "\n"


def write_scaling(sc: pd.DataFrame, outdir: str | Path) -> dict[str, Path]:
    """The scaling section alone: ``scaling.md`` (its table), ``scaling.csv``, ``scaling.png``."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"scaling_md": out / "scaling.md", "scaling": out / "scaling.csv",
             "scaling_plot": out / "scaling.png"}  # fmt: skip
    paths["scaling_md"].write_text(f"{SCALING_HEADING}\n\n{_scaling_table(sc)}")
    sc.to_csv(paths["scaling"], index=False)
    plot_scaling(sc, paths["scaling_plot"])
    return paths


def plot_bars(summary: pd.DataFrame, path: Path) -> None:
    """Grouped bars: one panel per task, metrics grouped, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(summary["task"]))
    methods = list(dict.fromkeys(summary["method"]))
    fig, axes = plt.subplots(len(tasks), 1, figsize=(11, 2.6 * len(tasks)), squeeze=False)
    width = 0.8 / max(len(methods), 1)
    cmap = plt.get_cmap("tab20")
    for ax, task in zip(axes[:, 0], tasks, strict=True):
        g = summary[summary["task"] == task].set_index("method")
        for j, m in enumerate(methods):
            if m not in g.index:
                continue
            x = np.arange(len(METRICS)) + (j - len(methods) / 2 + 0.5) * width
            ax.bar(
                x,
                [g.loc[m, f"{k}_mean"] for k in METRICS],
                width,
                yerr=[g.loc[m, f"{k}_sd"] for k in METRICS],
                label=m,
                color=cmap(j % 20),
            )
        ax.set_xticks(np.arange(len(METRICS)), [_LABELS[k] for k in METRICS])
        ax.set_ylim(0, 1.05)
        ax.set_title(task, fontsize=10)
    axes[0, 0].legend(fontsize=7, ncol=3, loc="lower left", bbox_to_anchor=(0, 1.15))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scaling(sc: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, g in sc.groupby("method", sort=False):
        a1.plot(g["n_cells"], g["seconds"], "o-", label=name)
        a2.plot(g["n_cells"], g["peak_mb"], "o-", label=name)
    for ax, ylab in ((a1, "wall time (s)"), (a2, "peak memory (MB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("cells")
        ax.set_ylabel(ylab)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(result: BenchmarkResult, outdir: str | Path) -> dict[str, Path]:
    """Write ``runs.csv``, ``summary.csv``, ``report.md``, ``bars.png`` (and scaling files)."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "runs": out / "runs.csv",
        "summary": out / "summary.csv",
        "report": out / "report.md",
        "bars": out / "bars.png",
        "settings": out / "settings.json",
    }
    result.runs.to_csv(paths["runs"], index=False)
    result.summary.to_csv(paths["summary"], index=False)
    if not result.summary.empty:
        plot_bars(result.summary, paths["bars"])
    else:
        paths.pop("bars")
    if result.scaling is not None and not result.scaling.empty:
        paths["scaling"] = out / "scaling.csv"
        paths["scaling_plot"] = out / "scaling.png"
        result.scaling.to_csv(paths["scaling"], index=False)
        plot_scaling(result.scaling, paths["scaling_plot"])
    settings = {**result.settings, "unavailable": result.unavailable}
    paths["settings"].write_text(json.dumps(settings, indent=2, default=str) + "\n")
    paths["report"].write_text(markdown(result))
    return paths
