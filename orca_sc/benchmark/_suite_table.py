"""The development suite's table: per task the mean and spread of every figure over seeds, the
goals each method meets, the tasks short of a goal beside the supervised reference, the peers
ORCA trails, and the Markdown report.
"""

from __future__ import annotations

import pandas as pd

from ._tasks import dataset_family

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
    out = out.reset_index()
    out["dataset"] = [dataset_family(t) for t in out["task"]]
    return out


def family_goals(table: pd.DataFrame, method: str = "ORCA") -> pd.DataFrame:
    """Per dataset family (:func:`orca_sc.benchmark._tasks.dataset_family`), ``method``'s tasks
    and how many meet each goal of :data:`GOALS` (``novel_called`` over the tasks with a novel
    type), with the mean all-class accuracy: a default must pay on every family.
    """
    t = table[table["method"] == method]
    rows = []
    for family, f in t.groupby("dataset", sort=True):
        novel = f[f["novel_true"] > 0]
        rows.append({
            "dataset": family,
            "tasks": len(f),
            "novel_called": f"{int(meets_goal('novel_called', novel['novel_called']).sum())}"
                            f"/{len(novel)}",
            "known_called_novel": f"{int(meets_goal('known_called_novel', f['known_called_novel']).sum())}/{len(f)}",
            "found_exact": f"{int(meets_goal('found_exact', f['found_exact']).sum())}/{len(f)}",
            "all_acc": float(f["all_acc"].mean()),
        })  # fmt: skip
    return pd.DataFrame(rows)


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
    fam = family_goals(t)
    if not fam.empty:
        lines += ["", "## Per dataset family (ORCA): tasks meeting each goal", "",
                  "| dataset | tasks | novel->novel >= 0.9 | known->novel <= 0.05 "
                  "| clusters right in >= 70% | mean all-class |", "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [
            f"| {r['dataset']} | {r['tasks']} | {r['novel_called']} | {r['known_called_novel']} "
            f"| {r['found_exact']} | {r['all_acc']:.3f} |"
            for _, r in fam.iterrows()
        ]
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
