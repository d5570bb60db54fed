"""Markdown/CSV reports of :mod:`orca_sc.vision` runs, in the style of ``orca-sc benchmark``."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

METRICS = (
    ("seen", "seen"),
    ("novel", "novel"),
    ("all", "all"),
    ("novel_called_novel", "novel→novel"),
    ("seen_called_novel", "seen→novel"),
    ("novel_found", "novel found"),
    ("novel_true", "novel true"),
)


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def markdown_table(df: pd.DataFrame, columns: list[str], headers: list[str] | None = None) -> str:
    headers = headers or columns
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(_fmt(r[c]) for c in columns) + " |")
    return "\n".join(lines)


def summary(rows: pd.DataFrame, by: list[str], prefix: str) -> pd.DataFrame:
    """Mean ± sd over seeds of the ``prefix``-ed metrics (``u_``: unlabelled training images,
    ``t_``: test split), one row per group of ``by``.
    """
    out = []
    for key, g in rows.groupby(by, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        rec = dict(zip(by, key, strict=True))
        rec["seeds"] = len(g)
        for m, _ in METRICS:
            col = f"{prefix}{m}"
            if col not in g:
                continue
            vals = g[col].astype(float)
            if m in ("novel_found", "novel_true"):
                rec[m] = f"{vals.mean():.1f}"
            else:
                sd = vals.std(ddof=1) if len(vals) > 1 else float("nan")
                rec[m] = f"{vals.mean():.3f}" + (f" ± {sd:.3f}" if not math.isnan(sd) else "")
        out.append(rec)
    return pd.DataFrame(out)


def write_report(rows: pd.DataFrame, path: str | Path, title: str, notes: str = "") -> Path:
    """``path`` (.md) with a transductive and an inductive table, and ``path`` .csv beside it."""
    path = Path(path)
    rows.to_csv(path.with_suffix(".csv"), index=False)
    by = [c for c in ("dataset", "method") if c in rows]
    parts = [f"# {title}", ""]
    if notes:
        parts += [notes, ""]
    cols = by + ["seeds"] + [m for m, _ in METRICS]
    heads = by + ["seeds"] + [h for _, h in METRICS]
    for prefix, what in (
        ("u_", "Unlabelled training images (transductive, as the paper)"),
        ("t_", "Held-out test split (inductive)"),
    ):
        s = summary(rows, by, prefix)
        if s.empty or not any(m in s for m, _ in METRICS):
            continue
        present = [c for c in cols if c in s]
        parts += [
            f"## {what}",
            "",
            markdown_table(s, present, [heads[cols.index(c)] for c in present]),
            "",
        ]
    parts += [
        "seen: accuracy on seen-class images; novel / all: accuracy after Hungarian matching "
        "(novel heads never count as a seen class); novel→novel: share of novel-class images given "
        "a novel head; seen→novel: share of seen-class images given a novel head; novel found: "
        "novel heads holding ≥ 1% of the novel-class images.",
        "",
    ]
    path.write_text("\n".join(parts))
    return path
