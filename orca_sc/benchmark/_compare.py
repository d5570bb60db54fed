"""Before/after tables of two development-suite runs (``orca-sc compare BEFORE.csv AFTER.csv``).

From the ``runs.csv`` of two runs with the same seeds (ORCA's rows):

1. **Per task**, the mean over seeds (± its seed sd) before → after of seen / novel / all-class
   accuracy, novel→novel (share of novel-type cells called novel), known→novel (share of
   known-type cells called novel), novel clusters found against the true number (with the share
   of runs where it is right) and seconds.
2. **Goals**, how many tasks meet each, before and after: novel→novel ≥ 0.9, known→novel
   ≤ 0.05, clusters right in ≥ 70% of runs, seed sd of both ≤ 0.05, all-class accuracy no more
   than 2 points below before.
3. **The drops check** of a change that should not move accuracy: per task, the change of the
   mean of seen / novel / all-class accuracy (a drop of more than 1 point fails), of
   novel→novel (a drop of more than 2 points fails) and of known→novel (a rise of more than 2
   points fails), with its paired standard error over the seeds (the runs share seeds, so the
   splits are the same); a failing change is marked "beyond noise" above two of them.
4. Where the after run has them, the training steps each phase ran against its schedule.
5. With the ceiling's runs (``--ceiling``: the supervised reference's rows), **per dataset
   family, on feasible tasks**: the goals met before and after on the tasks where the ceiling
   meets them, and the leave-one-family-out verdict (:func:`family_verdict`): a change that
   decides a label is adopted only where it pays on each real family held out in turn.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ._suite_table import meets_goal

METRICS = ["seen_acc", "novel_acc", "all_acc", "novel_called", "known_called_novel", "novel_found"]

#: metric, worse direction (-1: a drop is worse, +1: a rise is worse), allowed change
DROPS = [
    ("seen_acc", -1, 0.01),
    ("novel_acc", -1, 0.01),
    ("all_acc", -1, 0.01),
    ("novel_called", -1, 0.02),
    ("known_called_novel", +1, 0.02),
]


@dataclass(frozen=True)
class Comparison:
    """The report (Markdown) and the tasks failing the drops check (and those beyond noise)."""

    markdown: str
    n_tasks: int
    failing: tuple[str, ...]
    beyond_noise: tuple[str, ...]


def compare_columns() -> list[str]:
    """The columns :func:`compare_runs` reads from a suite's runs."""
    return [*METRICS, "novel_true", "seconds"]


def orca_runs(runs: pd.DataFrame, prefix: str = "", method: str = "ORCA") -> pd.DataFrame:
    """ORCA's rows of a suite's runs (or ``method``'s); ``prefix``: read the figures from the
    columns of that prefix (``"per_cell"``: a run with ``majority_vote=True`` keeps the unvoted
    labels' figures in ``per_cell_novel_called`` and so on; the underscore is added where it is
    left off).
    """
    if prefix and not prefix.endswith("_"):
        prefix += "_"
    df = runs[runs["method"] == method].copy() if "method" in runs else runs.copy()
    for m in METRICS:
        if prefix and f"{prefix}{m}" in df:
            df[m] = df[f"{prefix}{m}"]
    df["exact"] = (df["novel_found"] == df["novel_true"]).astype(float)
    return df


def compare_runs(
    before: pd.DataFrame, after: pd.DataFrame, ceiling: pd.DataFrame | None = None
) -> Comparison:
    """The sections of the module's report for two runs' ORCA rows (:func:`orca_runs`), and
    with ``ceiling`` (the supervised reference's rows of a run with the same seeds) the
    families' section.
    """
    b, a = _per_task(before), _per_task(after)
    common = [t for t in a.index if t in b.index]
    b, a = b.loc[common], a.loc[common]
    lines = [
        "## Per task (mean ± seed sd, before → after)",
        "",
        "| task | seen | novel | all | novel→novel | known→novel | found / true (runs right) "
        "| seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in common:
        x, y = b.loc[t], a.loc[t]
        found = (
            f"{x.novel_found:.1f} ({x.exact:.0%}) → {y.novel_found:.1f} ({y.exact:.0%}) "
            f"/ {y.novel_true:.0f}"
        )
        lines.append(
            f"| {t} | {_cell(x.seen_acc, y.seen_acc)} | {_cell(x.novel_acc, y.novel_acc)} "
            f"| {_cell(x.all_acc, y.all_acc, x.all_acc_sd, y.all_acc_sd)} "
            f"| {_cell(x.novel_called, y.novel_called, x.novel_called_sd, y.novel_called_sd)} "
            f"| {_cell(x.known_called_novel, y.known_called_novel, x.known_called_novel_sd, y.known_called_novel_sd)} "
            f"| {found} | {x.seconds:.1f} → {y.seconds:.1f} |"
        )
    gb, ga = _goals(b, b), _goals(a, b)
    lines += ["", "## Goals", "", "| goal | before | after |", "|---|---|---|"]
    lines += [f"| {k} | {gb[k]} | {ga[k]} |" for k in gb]
    drops, failing, beyond = _drops(before, after)
    lines += ["", "## Drops check", "", *drops]
    lines += _steps(after)
    if ceiling is not None:
        lines += ["", *family_verdict(b, a, _per_task(ceiling)).markdown]
    return Comparison("\n".join(lines) + "\n", len(common), failing, beyond)


#: a task whose all-class accuracy falls more than this is a family's loss
ACC_DROP = 0.02


@dataclass(frozen=True)
class FamilyVerdict:
    """Per real dataset family, the goals met on feasible tasks before and after
    (``table``), whether the after run is chosen with each family held out and holds on it,
    and the verdict: ``adopt`` only when it is chosen on every split and no family loses.
    """

    table: pd.DataFrame
    adopt: bool
    markdown: list[str]


def feasible(ceiling: pd.DataFrame) -> pd.DataFrame:
    """Per task (rows of :func:`_per_task`), whether the ceiling meets each detection goal:
    ``novel_called`` (tasks with a novel type) and ``known_called_novel``.
    """
    nn = ceiling["novel_called"]
    return pd.DataFrame({
        "novel_called": nn.notna() & meets_goal("novel_called", nn.fillna(0)),
        "known_called_novel": meets_goal("known_called_novel", ceiling["known_called_novel"]),
    }, index=ceiling.index)  # fmt: skip


def family_verdict(
    b: pd.DataFrame, a: pd.DataFrame, ceiling: pd.DataFrame, *, simulated: bool = False
) -> FamilyVerdict:
    """The leave-one-family-out judgement of ``a`` (after) against ``b`` (before), per-task
    means over seeds (:func:`_per_task`), on the tasks of the real dataset families
    (:func:`~._tasks.dataset_family`; the simulations are left out) where ``ceiling`` meets a
    goal. A family's score is the number of detection goals met on its feasible tasks. Held
    out in turn, each family sees the option that scores higher on the others (ties keep
    ``b``); ``a`` is adopted only when it is that option on every split and, on each family
    held out, scores at least ``b``'s with no task's all-class accuracy more than
    :data:`ACC_DROP` below ``b``'s. ``simulated``: the simulations' tasks alone, as one
    family.
    """
    from ._tasks import dataset_family, real_family

    common = [t for t in a.index if t in b.index and t in ceiling.index]
    fam = pd.Series({t: dataset_family(t) for t in common}, dtype=object)
    fam = fam[[real_family(t) != simulated for t in fam.index]]
    ok = feasible(ceiling.loc[fam.index])
    rows = []
    for family, tasks in fam.groupby(fam).groups.items():
        row = {"family": family, "tasks": len(tasks)}
        for goal in ("novel_called", "known_called_novel"):
            on = [t for t in tasks if ok.loc[t, goal]]
            row[f"{goal}_feasible"] = len(on)
            for name, run in (("before", b), ("after", a)):
                v = run.loc[on, goal].dropna()
                row[f"{goal}_{name}"] = int(meets_goal(goal, v).sum())
        for name, run in (("before", b), ("after", a)):
            row[f"score_{name}"] = row[f"novel_called_{name}"] + row[f"known_called_novel_{name}"]
            row[f"all_acc_{name}"] = float(run.loc[list(tasks), "all_acc"].mean())
        drop = a.loc[list(tasks), "all_acc"] < b.loc[list(tasks), "all_acc"] - ACC_DROP
        row["acc_drops"] = int(drop.sum())
        rows.append(row)
    table = pd.DataFrame(rows).set_index("family") if rows else pd.DataFrame()
    lines = [
        "## Per dataset family, on feasible tasks (leave one family out)",
        "",
        "Tasks where the ceiling (the supervised reference) meets the goal; mean over seeds.",
        "",
        "| family | tasks | novel→novel ≥ 0.9 | known→novel ≤ 0.05 | all-class acc | tasks "
        "> 2 points below | chosen on the others | holds here |",
        "|---|---|---|---|---|---|---|---|",
    ]
    adopt = not table.empty
    for family, r in table.iterrows():
        rest = table.drop(index=family)
        chosen = "after" if rest["score_after"].sum() > rest["score_before"].sum() else "before"
        holds = (
            r["score_after"] >= r["score_before"] and r["acc_drops"] == 0
            if chosen == "after"
            else None
        )
        adopt &= chosen == "after" and bool(holds)
        n = {k: int(v) for k, v in r.items() if not k.startswith("all_acc")}
        lines.append(
            f"| {family} | {n['tasks']} "
            f"| {n['novel_called_before']} → {n['novel_called_after']} of "
            f"{n['novel_called_feasible']} "
            f"| {n['known_called_novel_before']} → {n['known_called_novel_after']} of "
            f"{n['known_called_novel_feasible']} "
            f"| {r['all_acc_before']:.3f} → {r['all_acc_after']:.3f} | {n['acc_drops']} "
            f"| {chosen} "
            f"| {'–' if holds is None else 'yes' if holds else 'no'} |"
        )
    if not table.empty:
        tot = table[["score_before", "score_after"]].sum()
        lines += ["", f"Goals met on feasible tasks, all real families: {tot['score_before']:.0f} "
                  f"before, {tot['score_after']:.0f} after. Verdict: "
                  + ("adopt (chosen with every family held out, and no family loses)." if adopt
                     else "keep before (not chosen on every split, or a family held out loses a "
                     "goal or a task's all-class accuracy).")]  # fmt: skip
    return FamilyVerdict(table, adopt, lines)


@dataclass(frozen=True)
class RuleNeed:
    """Which real dataset families need a rule: per family (``table``), the detection goals met
    on feasible tasks with and without it, the tasks whose all-class accuracy is more than
    :data:`ACC_DROP` lower (``lower``) or higher (``higher``) without it, and those whose
    novel→novel falls or known→novel rises by more than :data:`DETECTION_DROP` and beyond two
    paired standard errors over the seeds without it (``worse``; ``better``: the reverse);
    ``needed_by``: the families that lose a goal, a task's accuracy or a detection figure
    without it (none: the rule goes), ``gains_without``: those that gain one.
    """

    table: pd.DataFrame
    needed_by: tuple[str, ...]
    gains_without: tuple[str, ...]

    @property
    def goes(self) -> bool:
        """No family judged needs the rule."""
        return not self.needed_by


#: a detection figure that moves more than this (and beyond noise) is a family's loss or gain
DETECTION_DROP = 0.02


def _detection_moves(with_rule: pd.DataFrame, without: pd.DataFrame) -> pd.DataFrame:
    """Per task, whether a detection figure is worse / better without the rule: novel→novel
    lower or known→novel higher by more than :data:`DETECTION_DROP` and by more than two
    paired standard errors (the runs share seeds, so they share splits).
    """
    m = with_rule.merge(without, on=["task", "seed"], suffixes=("_w", "_o"))
    rows = {}
    for task, g in m.groupby("task", sort=False):
        worse = better = False
        for metric, sign in (("novel_called", -1), ("known_called_novel", +1)):
            d = sign * (g[f"{metric}_o"] - g[f"{metric}_w"]).dropna()  # > 0: worse without
            if d.size < 2:
                continue
            se = float(d.std(ddof=1) / np.sqrt(d.size))
            beyond = abs(float(d.mean())) > max(DETECTION_DROP, 2 * se)
            worse |= beyond and d.mean() > 0
            better |= beyond and d.mean() < 0
        rows[task] = {"worse": worse, "better": better}
    return pd.DataFrame.from_dict(rows, orient="index")


def rule_need(
    with_rule: pd.DataFrame,
    without: pd.DataFrame,
    ceiling: pd.DataFrame,
    *,
    simulated: bool = False,
) -> RuleNeed:
    """The rule-by-rule ablation's judgement from two runs' ORCA rows (:func:`orca_runs`: the
    same tasks and seeds, with and without the rule) and the ceiling's per-task means
    (:func:`_per_task`): a rule stays where some real family needs it (without it, fewer
    detection goals met on the family's feasible tasks, a task's all-class accuracy more than
    :data:`ACC_DROP` lower, or a detection figure worse beyond noise: :func:`_detection_moves`)
    and goes where none does. Read on the tasks the runs share (an ablation that cannot act on
    a task, e.g. a query-batch rule on a one-batch task, is run without it). ``simulated``:
    the simulations' tasks instead, as one family.
    """
    from ._tasks import dataset_family

    w, o = _per_task(with_rule), _per_task(without)
    table = family_verdict(w, o, ceiling, simulated=simulated).table
    if table.empty:
        return RuleNeed(table, (), ())
    t = table.rename(columns={"score_before": "goals_with", "score_after": "goals_without",
                              "acc_drops": "lower"})  # fmt: skip
    t["higher"] = family_verdict(o, w, ceiling, simulated=simulated).table["acc_drops"]
    moves = _detection_moves(with_rule, without)
    fam = pd.Series({x: dataset_family(x) for x in moves.index})
    for col in ("worse", "better"):
        t[col] = moves[col].groupby(fam).sum().reindex(t.index, fill_value=0).astype(int)
    t = t[["tasks", "goals_with", "goals_without", "lower", "higher", "worse", "better"]]
    need = (t["goals_without"] < t["goals_with"]) | (t["lower"] > 0) | (t["worse"] > 0)
    gain = (t["goals_without"] > t["goals_with"]) | (t["higher"] > 0) | (t["better"] > 0)
    return RuleNeed(t, tuple(t.index[need]), tuple(t.index[gain]))


def _per_task(df: pd.DataFrame) -> pd.DataFrame:
    g = df.groupby("task", sort=False)
    out = g[[*METRICS, "exact", "seconds", "novel_true"]].mean()
    sd = g[["novel_called", "known_called_novel", "all_acc"]].std(ddof=0)
    return out.join(sd, rsuffix="_sd")


def _cell(b: float, a: float, bsd: float | None = None, asd: float | None = None) -> str:
    if np.isnan(a) and np.isnan(b):
        return "–"

    def sd(s):
        return "" if s is None or np.isnan(s) or s < 5e-4 else f" ± {s:.2f}"

    return f"{b:.3f}{sd(bsd)} → {a:.3f}{sd(asd)}"


def _goals(t: pd.DataFrame, base: pd.DataFrame) -> dict[str, str]:
    nn = t["novel_called"].dropna()
    stable = (t["novel_called_sd"].fillna(0) <= 0.05) & (t["known_called_novel_sd"] <= 0.05)
    drop = (t["all_acc"] < base.loc[t.index, "all_acc"] - 0.02).sum()
    return {
        "novel→novel ≥ 0.9": f"{meets_goal('novel_called', nn).sum()} of {nn.size}",
        "known→novel ≤ 0.05": (
            f"{meets_goal('known_called_novel', t['known_called_novel']).sum()} of {len(t)}"
        ),
        "clusters right in ≥ 70% of runs": (
            f"{meets_goal('found_exact', t['exact']).sum()} of {len(t)}"
        ),
        "runs with clusters right": f"{t['exact'].mean():.0%}",
        "seed sd of both ≤ 0.05": f"{stable.sum()} of {len(t)}",
        "all-class accuracy > 2 points below before": f"{drop} of {len(t)}",
    }


def _drops(before: pd.DataFrame, after: pd.DataFrame):
    m = before.merge(after, on=["task", "seed"], suffixes=("_b", "_a"))
    lines = ["| task | metric | before | after | change | paired SE | beyond noise |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    failing: list[str] = []
    beyond: list[str] = []
    for task, g in m.groupby("task", sort=False):
        for metric, worse, allowed in DROPS:
            d = (g[f"{metric}_a"] - g[f"{metric}_b"]).dropna()
            if d.empty:
                continue
            change = float(d.mean())
            se = float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else float("nan")
            if worse * change > allowed + 1e-12:
                noise = bool(np.isfinite(se) and worse * change > 2 * se)
                failing += [task] if task not in failing else []
                beyond += [task] if noise and task not in beyond else []
                lines.append(
                    f"| {task} | {metric} | {g[f'{metric}_b'].mean():.3f} | "
                    f"{g[f'{metric}_a'].mean():.3f} | {change:+.3f} | {se:.3f} | "
                    f"{'yes' if noise else 'no'} |"
                )
    lines += ["", f"Tasks failing the check: {len(failing)} of {m['task'].nunique()}; with a "
              f"change beyond two paired standard errors: {len(beyond)}."]  # fmt: skip
    return lines, tuple(failing), tuple(beyond)


def _steps(a: pd.DataFrame) -> list[str]:
    cols = ("warmup_steps", "warmup_max_steps", "open_world_steps", "open_world_max_steps")
    if not all(c in a for c in cols):
        return []
    steps = a.groupby("task", sort=False)[[*cols, "seconds"]].mean()
    stopped = a.groupby("task", sort=False)["open_world_stopped"].apply(
        lambda s: int((s == "converged").sum())
    )
    lines = ["", "## Training steps (after)", "",
             "| task | warm-up steps (schedule) | open-world steps (schedule) | "
             "open-world runs converged | seconds |", "|---|---|---|---|---|"]  # fmt: skip
    for task, r in steps.iterrows():
        lines.append(
            f"| {task} | {r['warmup_steps']:.0f} ({r['warmup_max_steps']:.0f}) | "
            f"{r['open_world_steps']:.0f} ({r['open_world_max_steps']:.0f}) | "
            f"{stopped[task]} of {int((a['task'] == task).sum())} | {r['seconds']:.1f} |"
        )
    tot = a[["warmup_steps", "open_world_steps"]].sum().sum()
    cap = a[["warmup_max_steps", "open_world_max_steps"]].sum().sum()
    lines += ["", f"Steps run: {tot:.0f} of the schedules' {cap:.0f} ({tot / cap:.0%})."]
    return lines
