"""The development suite (``orca-sc benchmark --suite dev``): every change of a default of the
method is run on all of it, before and after.

* every shared real task, in both directions where the data has two batches;
* the paper's protocol on every single-batch set (seeds draw the split);
* a simulator sweep with known truth, one factor at a time around a base setting: query size
  (150 -> 50,000 cells, down to ~10 cells per type), labelled fraction (5% -> 90% in the
  protocol, 100% in a reference), number of novel types (0 -> 20), batch strength,
  imbalance and novel subtypes nested in seen types; plus a 1,000-cell reference + 1,000-cell
  query of 5,000 genes whose wall time is the small-data speed figure.

Beside the paper's metrics the suite reports the share of novel-type cells called novel, the
share of known-type cells called novel, and the number of novel clusters found (and, for ORCA,
estimated) against the truth: Hungarian novel accuracy alone scores a novel type absorbed whole by
a known one as correct. Each figure comes with its standard deviation over seeds (``±``), and
the report names the worst task on each goal (:data:`GOALS`). The hard corners built from the
real data (:mod:`orca_sc.benchmark._hard`): novel types beside a close known sibling, 5 to 25
labelled cells per type, queries of at most 15 cells per type, queries without novel types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd

from ._splits import Task, batch_split, grow_task, protocol_split
from ._tasks import TaskSpec, builtin_tasks, reversed_tasks


@dataclass(frozen=True)
class SimSetting:
    """One point of the simulator sweep (:func:`orca_sc.datasets.simulate` counts).

    ``design="cross-batch"``: a reference batch holding the seen types only (about ``n_ref``
    cells, all labelled) and a query batch of ``n_query`` cells of all types.
    ``design="protocol"``: one batch of ``n_ref + n_query`` cells; ``labelled_fraction`` of each
    seen type's cells labelled, every other cell the query (the paper's protocol).
    The ``n_novel`` novel types are drawn at random among the ``n_seen + n_novel`` types (whose
    sizes fall geometrically, largest ``imbalance`` times the smallest); ``n_nested`` of them
    are subtypes of a seen type drawn at random (its whole profile plus a program of their own:
    a novel type a seen head can absorb). ``type_batch_strength``: a batch effect that differs by
    type (the shift severity); ``condition_types``: that many seen types, drawn at random, carry
    in the query a gene program of ``condition_genes`` genes (default ``markers_per_type``) the
    reference lacks (as after a stimulation);
    ``n_queries``: the query is that many batches of ``n_query`` cells each, annotated together
    as several queries (``task.info['query_key']``).
    """

    name: str
    design: str = "cross-batch"
    n_ref: int = 2000
    n_query: int = 2000
    n_seen: int = 8
    n_novel: int = 4
    labelled_fraction: float = 0.5
    batch_strength: float = 0.3
    imbalance: float = 5.0
    n_genes: int = 1000
    n_nested: int = 0
    library_size: float = 3000.0
    type_batch_strength: float = 0.0
    condition_types: int = 0
    condition_genes: int | None = None
    n_queries: int = 1

    def describe(self) -> str:
        base = SimSetting("base")
        diff = [
            f"{k}={getattr(self, k)}"
            for k in self.__dataclass_fields__
            if k != "name" and getattr(self, k) != getattr(base, k)
        ]
        return "simulated, " + (", ".join(diff) if diff else "base setting")


def make_sim_task(setting: SimSetting, seed: int) -> Task:
    """The task of ``setting`` at ``seed`` (the seed draws the data, the novel types and the
    split).
    """
    from ..datasets import simulate

    s = setting
    n_types = s.n_seen + s.n_novel
    rng = np.random.default_rng(10_000 + seed)
    types = [f"type_{t}" for t in range(n_types)]
    novel = sorted(rng.choice(types, s.n_novel, replace=False).tolist()) if s.n_novel else []
    seen = [t for t in types if t not in novel]
    code = {t: i for i, t in enumerate(types)}
    subtype_of = {code[t]: code[rng.choice(seen)] for t in novel[: s.n_nested]}
    w = s.imbalance ** (-np.arange(n_types) / max(n_types - 1, 1))
    seen_share = w[[t not in novel for t in types]].sum() / w.sum()
    name = f"sim_{s.name}"
    if s.design == "protocol":
        a = simulate(
            s.n_ref + s.n_query, s.n_genes, n_types, imbalance=s.imbalance,
            subtype_of=subtype_of, library_size=s.library_size, seed=seed,
        )  # fmt: skip
        return protocol_split(
            a, "cell_type", seen_classes=seen, labeled_fraction=s.labelled_fraction, seed=seed,
            name=name,
        )  # fmt: skip
    n_ref_batch = int(round(s.n_ref / seen_share))
    responding = sorted(rng.choice([code[t] for t in seen], s.condition_types, replace=False))
    a = simulate(
        n_ref_batch + s.n_query * s.n_queries,
        s.n_genes,
        n_types,
        n_batches=1 + s.n_queries,
        batch_strength=s.batch_strength,
        imbalance=s.imbalance,
        batch_weights=[n_ref_batch] + [s.n_query] * s.n_queries,
        subtype_of=subtype_of,
        library_size=s.library_size,
        type_batch_strength=s.type_batch_strength,
        condition={b: responding for b in range(1, 1 + s.n_queries)} if responding else None,
        condition_genes=s.condition_genes,
        seed=seed,
    )
    task = batch_split(
        a, "cell_type", "batch", ["batch_0"], novel_classes=novel, seed=seed, name=name
    )
    if s.n_queries > 1:
        task.info["query_key"] = "batch"
    return task


def sim_settings(large: bool = True) -> list[SimSetting]:
    """The sweep: the base setting and one factor changed at a time."""
    b = SimSetting("base")
    out = [
        b,
        replace(b, name="query150", n_query=150),
        replace(b, name="query500", n_query=500),
        replace(b, name="query10k", n_query=10_000),
        replace(b, name="ref200_query150", n_ref=200, n_query=150),
        replace(b, name="ref200", n_ref=200),
        replace(b, name="novel0", n_novel=0),
        replace(b, name="novel1", n_novel=1),
        replace(b, name="novel10", n_novel=10),
        replace(b, name="novel20", n_seen=10, n_novel=20),
        replace(b, name="batch0", batch_strength=0.0),
        replace(b, name="batch0.6", batch_strength=0.6),
        replace(b, name="imbalance1", imbalance=1.0),
        replace(b, name="imbalance30", imbalance=30.0),
        replace(b, name="protocol_lab0.05", design="protocol", labelled_fraction=0.05),
        replace(b, name="protocol_lab0.2", design="protocol", labelled_fraction=0.2),
        replace(b, name="protocol_lab0.5", design="protocol", labelled_fraction=0.5),
        replace(b, name="protocol_lab0.9", design="protocol", labelled_fraction=0.9),
        replace(b, name="nested2", n_nested=2),
        replace(b, name="protocol_nested2", design="protocol", n_nested=2),
        replace(b, name="speed_1k_1k", n_ref=1000, n_query=1000, n_genes=5000),
        # a condition shift: three seen types respond in the query to a program the reference
        # lacks, with and without hidden types
        replace(b, name="condition3", condition_types=3),
        replace(b, name="condition3_novel0", condition_types=3, n_novel=0),
        replace(b, name="condition3_g200", condition_types=3, condition_genes=200),
        replace(b, name="condition3_g200_novel0", condition_types=3, condition_genes=200,
                n_novel=0),
        # the shift severity: a batch effect that differs by type, swept
        replace(b, name="typeshift0.2", type_batch_strength=0.2),
        replace(b, name="typeshift0.4", type_batch_strength=0.4),
        replace(b, name="typeshift0.8", type_batch_strength=0.8),
        # several queries sharing their known types and one novel type, annotated together:
        # 60 cells per type (two known, one novel) up to thousands of cells per query; and one
        # such 180-cell query alone
        replace(b, name="queries1_q180", n_seen=2, n_novel=1, n_ref=500, n_query=180,
                imbalance=1.0),
        replace(b, name="queries2_q180", n_seen=2, n_novel=1, n_ref=500, n_query=180,
                imbalance=1.0, n_queries=2),
        replace(b, name="queries3_q180", n_seen=2, n_novel=1, n_ref=500, n_query=180,
                imbalance=1.0, n_queries=3),
        replace(b, name="queries2_q2000", n_novel=1, n_queries=2),
        replace(b, name="queries3_q1000", n_novel=1, n_query=1000, n_queries=3),
    ]  # fmt: skip
    if large:
        out.append(replace(b, name="query50k", n_query=50_000))
    return out


#: library sizes of the scale task: ~13% and ~47% non-zeros over 2,000 genes (droplet-like and
#: plate-like depth)
SCALE_DEPTHS = {"sparse": 300.0, "dense": 3000.0}
#: the scale task's sizes (cells in reference + query) ...
SCALE_SIZES = (5_000, 20_000, 50_000, 100_000)
#: ... from this size on in the large tier only
SCALE_LARGE_FROM = 50_000
#: real count-data tasks grown to about this many cells in the large tier (:func:`grow_task`)
GROWN_CELLS = 50_000


def scale_settings(large: bool = False) -> list[SimSetting]:
    """One simulated setting at every size of :data:`SCALE_SIZES` (below
    :data:`SCALE_LARGE_FROM` cells unless ``large``) and both depths of :data:`SCALE_DEPTHS`: 20 types, 10 of them novel, a quarter of
    the cells in a reference of the seen types, 2,000 genes, no batch effect. Only the number of
    cells changes between sizes, so a rule whose decision moves with it shows here.
    """
    return [
        SimSetting(
            f"scale{n // 1000}k_{depth}",
            n_ref=n // 4,
            n_query=n - n // 4,
            n_seen=10,
            n_novel=10,
            batch_strength=0.0,
            n_genes=2000,
            library_size=lib,
        )
        for depth, lib in SCALE_DEPTHS.items()
        for n in SCALE_SIZES
        if large or n < SCALE_LARGE_FROM
    ]


def grown_tasks(data_dir: str | Path | None, n_cells: int = GROWN_CELLS) -> list[TaskSpec]:
    """The real count-data tasks (Baron both ways, Tabula Muris both ways, the MCA and worm
    protocols) grown to about ``n_cells`` cells in all, named ``grown_<task>``: new cells of
    each type, each pooling two cells of the type and batch thinned to the same depth
    (:func:`orca_sc.benchmark._splits.grow_task`, ``mode="mix"``). Copies of a cell with fresh
    sampling noise (``mode="redraw"``) would be each other's nearest neighbours, so that any
    graph clustering counts cells, not types.
    """
    counts = ("baron_", "tm_", "mca_", "worm_")
    specs = [s for s in builtin_tasks(data_dir) + reversed_tasks(data_dir)
             if s.name.startswith(counts)]  # fmt: skip
    return [
        TaskSpec(
            f"grown_{s.name}",
            s.kind,
            partial(_grown, s.make, n_cells),
            f"{s.description}; grown to ~{n_cells:,} cells of pooled pairs",
        )
        for s in specs
    ]


def _grown(make, n_cells: int, seed: int) -> Task:
    return grow_task(make(seed), n_cells, seed=seed, mode="mix")


def dev_suite(
    data_dir: str | Path | None,
    *,
    large: bool = True,
    only: Sequence[str] | None = None,
    scale: bool = False,
) -> list[TaskSpec]:
    """Every task of the development suite whose data is here (the simulations always are):
    the real tasks both ways, their hard corners (:func:`orca_sc.benchmark._hard.hard_tasks`),
    the simulator sweep and the scale task below 50,000 cells; ``large=False`` leaves out the
    50,000-cell query of the sweep. ``scale``: the large tier, run for every change of
    discovery or of training length: the scale task at 50,000 and 100,000 cells and the real
    tasks grown to ~50,000 cells (:func:`grown_tasks`). With ``only``, the tasks it names
    (:func:`select_tasks`).
    """
    from ._hard import hard_tasks

    specs = builtin_tasks(data_dir) + reversed_tasks(data_dir) + hard_tasks(data_dir)
    specs += [
        TaskSpec(f"sim_{s.name}", "simulated", partial(make_sim_task, s), s.describe())
        for s in sim_settings(large) + scale_settings(scale)
    ]
    if scale:
        specs += grown_tasks(data_dir)
    return select_tasks(specs, only) if only else specs


def select_tasks(specs: Sequence[TaskSpec], only: Sequence[str]) -> list[TaskSpec]:
    """The tasks of ``specs`` named by ``only``: for each string, the task of exactly that
    name where there is one (``sim_novel1`` is not also ``sim_novel10``), else every task
    whose name contains it (``scale50k``, ``grown``).
    """
    names = {s.name for s in specs}
    exact = {o for o in only if o in names}
    parts = [o for o in only if o not in exact]
    return [s for s in specs if s.name in exact or any(o in s.name for o in parts)]


#: the suite's goals per task (share of novel-type cells called novel, of known-type cells
#: called novel, of runs whose number of novel clusters is right)
GOALS = {"novel_called": 0.9, "known_called_novel": 0.05, "found_exact": 0.7}
#: the goals met from below (a share at most the goal); the others from above
_GOAL_AT_MOST = ("known_called_novel",)


def meets_goal(col: str, value):
    """Whether ``value`` (a number or a Series) meets the goal of :data:`GOALS` ``[col]``."""
    return value <= GOALS[col] if col in _GOAL_AT_MOST else value >= GOALS[col]


_SD = ("seen_acc", "novel_acc", "all_acc", "novel_called", "known_called_novel",
       "known_p_below_alpha")  # fmt: skip


def suite_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean over seeds per (task, method) of the suite's columns, the seed standard deviation
    (``*_sd``) of the accuracies and shares, and ``found_exact``: the share of runs whose number
    of novel clusters is the true one.
    """
    cols = [
        "seen_acc",
        "novel_acc",
        "all_acc",
        "novel_called",
        "known_called_novel",
        "novel_found",
        "novel_est",
        "novel_true",
        "known_p_below_alpha",
        "novel_p_below_alpha",
        "seconds",
    ]
    cols = [c for c in cols if c in runs.columns]
    runs = runs.assign(found_exact=(runs["novel_found"] == runs["novel_true"]).astype(float))
    g = runs.groupby(["task", "method"], sort=False)
    out = g[cols + ["found_exact"]].mean()
    for c in _SD:
        if c in runs.columns:
            out[f"{c}_sd"] = g[c].std(ddof=0)
    out["n_query"] = g["n_query"].first()
    out["n_seeds"] = g["seed"].nunique()
    out["errors"] = g["error"].apply(lambda e: int((e.fillna("") != "").sum()))
    if "kind" in runs.columns:
        out["kind"] = g["kind"].first()
    return out.reset_index()


def worst_tasks(table: pd.DataFrame, method: str = "ORCA") -> list[str]:
    """For ``method``: the worst task on each goal and how many tasks meet it."""
    t = table[table["method"] == method]
    lines = []
    for col, goal, worst_is_low in (
        ("novel_called", GOALS["novel_called"], True),
        ("known_called_novel", GOALS["known_called_novel"], False),
        ("found_exact", GOALS["found_exact"], True),
        ("seen_acc", None, True),
        ("all_acc", None, True),
    ):
        v = t[["task", col]].dropna()
        if v.empty:
            continue
        row = v.loc[v[col].idxmin() if worst_is_low else v[col].idxmax()]
        line = f"- {col}: worst {row['task']} {row[col]:.3f}"
        if goal is not None:
            ok = meets_goal(col, v[col])
            sign = ">=" if worst_is_low else "<="
            line += f"; {int(ok.sum())} of {len(v)} tasks meet {sign} {goal:g}"
        lines.append(line)
    return lines


#: the method that says what the expression supports (:func:`~._methods.supervised_reference`)
REFERENCE = "Supervised reference (query labels, CV)"


def shortfalls(table: pd.DataFrame, method: str = "ORCA", reference: str = REFERENCE) -> list[str]:
    """Each task where ``method`` falls short of a goal on the share of novel-type cells called
    novel or of known-type cells called novel, with the reason the table can give: whether the
    supervised reference (a classifier trained on the query's own true labels, novel types
    included) meets that goal on the task. Where it misses it too, the query's expression
    separates those cells weakly; where it meets it, the query's expression tells them apart
    and ``method`` is short of that (the reference is blind to a shift between reference and
    query, which ``method`` must cross). Without the reference's runs, no reason is given.
    """
    t = table.set_index(["task", "method"])
    out = []
    for task in table.loc[table["method"] == method, "task"]:
        r = t.loc[(task, method)]
        ref = t.loc[(task, reference)] if (task, reference) in t.index else None
        for col, what in (("novel_called", "novel->novel"), ("known_called_novel", "known->novel")):
            v = r[col]
            if pd.isna(v) or meets_goal(col, v):
                continue
            line = f"- {task}: {what} {v:.3f}"
            if ref is not None and pd.notna(ref[col]):
                w = ref[col]
                line += (f"; the supervised reference {w:.3f} "
                         + ("meets the goal" if meets_goal(col, w) else "misses it too"))  # fmt: skip
            out.append(line)
    return out


#: the peers whose calls use no truth (the LR baseline is given the true novel fraction)
PEERS = ("kNN transfer (ingest-like) + Leiden", "CellTypist + Leiden")


def below_peers(table: pd.DataFrame, method: str = "ORCA", margin: float = 0.02) -> list[str]:
    """Each task where ``method``'s all-class accuracy is more than ``margin`` below the best of
    :data:`PEERS` that ran on it, with that peer and its figure.
    """
    t = table[table["method"].isin(PEERS)].dropna(subset=["all_acc"])
    if t.empty:
        return []
    best = t.loc[t.groupby("task")["all_acc"].idxmax()].set_index("task")
    out = []
    for _, r in table[table["method"] == method].iterrows():
        if r["task"] in best.index and pd.notna(r["all_acc"]):
            b = best.loc[r["task"]]
            if r["all_acc"] < b["all_acc"] - margin:
                out.append(f"- {r['task']}: all-class {r['all_acc']:.3f}, {b['method']} "
                           f"{b['all_acc']:.3f}")  # fmt: skip
    return out


def estimate_accuracy(runs: pd.DataFrame, method: str = "ORCA") -> dict:
    """How well the number of novel types is found, over every run of ``method``: exact share,
    mean absolute error and mean signed error of the clusters found (and of the estimate)
    against the truth.
    """
    r = runs[(runs["method"] == method) & runs["novel_found"].notna()]
    out = {"runs": len(r)}
    for col in ("novel_found", "novel_est"):
        if col in r and r[col].notna().any():
            d = r[col] - r["novel_true"]
            out[col] = {
                "exact": float((d == 0).mean()),
                "mae": float(d.abs().mean()),
                "bias": float(d.mean()),
            }
    return out


def mean_sd(mean: float | None, sd: float | None = None) -> str:
    """``mean ± sd`` to three decimals (the sd only when positive), or a dash for no value."""
    if mean is None or pd.isna(mean):
        return "–"
    return f"{mean:.3f}" + (f" ± {sd:.3f}" if sd is not None and pd.notna(sd) and sd > 0 else "")


def _shares(r: pd.Series) -> str:
    """The novelty test's shares of a table row, ``known (± sd) / novel``, or a dash."""
    known = r.get("known_p_below_alpha")
    if known is None or pd.isna(known):
        return "–"
    return f"{mean_sd(known, r.get('known_p_below_alpha_sd'))} / {mean_sd(r.get('novel_p_below_alpha'))}"


def suite_markdown(runs: pd.DataFrame, settings: dict | None = None) -> str:
    """The suite's report: one row per task and method, then the n_novel estimate's accuracy and
    the small-data wall time next to CellTypist's.
    """
    t = suite_table(runs)
    st = settings or {}
    lines = [
        "# orca_sc development suite",
        "",
        f"orca_sc {st.get('version', '')}; seeds {st.get('seeds', '')}; torch threads "
        f"{st.get('torch_threads', '')}. Means ± sd over seeds. seen / novel / all: the paper's "
        "metrics; novel->novel: share of novel-type cells called novel; known->novel: share of "
        "known-type cells called novel; found (est) / true: novel clusters found (ORCA's "
        "estimate) against the true number of novel types; found = true: share of runs with the "
        "true number. p <= a known / novel: shares of known-type (the novelty test's level, "
        "goal <= alpha where reference and query are alike) and novel-type query cells (its "
        "power) with a novelty p-value at most alpha.",
        "",
        "| task | method | cells | seen | novel | all | novel->novel | known->novel "
        "| found (est) / true | found = true | p <= a known / novel | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(r, c):
        return mean_sd(r[c], r.get(f"{c}_sd"))

    for _, r in t.iterrows():
        est = f" ({r['novel_est']:.1f})" if "novel_est" in r and pd.notna(r["novel_est"]) else ""
        err = f" ({int(r['errors'])} failed)" if r["errors"] else ""
        lines.append(
            f"| {r['task']} | {r['method']}{err} | {int(r['n_query'])} | {f(r, 'seen_acc')} "
            f"| {f(r, 'novel_acc')} | {f(r, 'all_acc')} | {f(r, 'novel_called')} "
            f"| {f(r, 'known_called_novel')} | {r['novel_found']:.1f}{est} / "
            f"{r['novel_true']:.0f} | {r['found_exact']:.0%} | {_shares(r)} "
            f"| {r['seconds']:.1f} |"
        )
    worst = worst_tasks(t)
    if worst:
        lines += ["", "## Worst task per goal (ORCA)", "", *worst]
    short = shortfalls(t)
    if short:
        lines += ["", "## Tasks short of a goal (ORCA), with the supervised reference", "", *short]
    below = below_peers(t)
    if below:
        lines += ["", "## All-class accuracy more than 2 points below the best peer (ORCA)", "",
                  *below]  # fmt: skip
    acc = estimate_accuracy(runs)
    lines += ["", "## Number of novel types (ORCA, every run)", ""]
    for col, what in (("novel_found", "clusters found"), ("novel_est", "estimate")):
        if col in acc:
            a = acc[col]
            lines.append(
                f"- {what}: exact in {a['exact']:.0%} of {acc['runs']} runs, mean absolute "
                f"error {a['mae']:.2f}, mean signed error {a['bias']:+.2f}"
            )
    speed = t[t["task"] == "sim_speed_1k_1k"]
    if not speed.empty:
        lines += ["", "## Small data (1,000-cell reference + 1,000-cell query, 5,000 genes)", ""]
        lines += [f"- {r['method']}: {r['seconds']:.1f} s" for _, r in speed.iterrows()]
    return "\n".join(lines) + "\n"
