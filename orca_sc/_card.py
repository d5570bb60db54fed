"""A saved model's card: what a user needs to trust it on other data (the reference it learned,
how well it labels held-out reference cells, type by type, what it discovered, the self-check,
the versions and the command or options that trained it). Built at training
(:func:`model_card`), saved with the model, printed by ``orca-sc predict --info``
(:func:`format_card`).
"""

from __future__ import annotations

import platform
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from . import __version__
from ._ambient import ambient, current
from ._config import OrcaConfig


@contextmanager
def command_line(argv: list[str]) -> Iterator[None]:
    """Within the block, cards record ``orca-sc`` with ``argv`` as the command that trained."""
    with ambient(command=shlex.join(["orca-sc", *argv])):
        yield


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"orca_sc": __version__, "python": platform.python_version()}
    for name in ("torch", "anndata", "scanpy", "numpy", "scikit-learn"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:  # pragma: no cover - all are dependencies
            out[name] = "not installed"
    return out


def _changed_options(cfg: OrcaConfig) -> dict[str, Any]:
    """The options that differ from the defaults (``discovery.`` prefixed for its fields; the
    progress bar left out).
    """
    given, default = cfg.to_dict(), OrcaConfig().to_dict()
    skip = ("discovery", "progress")
    out = {k: v for k, v in given.items() if k not in skip and v != default.get(k)}
    for k, v in given["discovery"].items():
        if v != default["discovery"].get(k):
            out[f"discovery.{k}"] = v
    return out


def model_card(fit: Any, novel_sizes: dict[str, int], labels_key: str) -> dict[str, Any]:
    """The card of a training run (``fit``: :class:`orca_sc._pipeline.Fit`; ``novel_sizes``:
    cells of each novel cluster among the cells annotated), JSON-able.
    """
    data = fit.data
    lab = data.labeled
    per_type = np.bincount(data.labels[lab], minlength=len(data.classes))
    accuracy: dict[str, Any] = {}
    pred = fit.fold_predictions
    if pred is not None:
        y = data.labels[pred.fold >= 0]  # the labelled cells a fold's net was scored on
        scored = np.bincount(y, minlength=len(data.classes))
        right = np.bincount(y, pred.held_correct.astype(np.float64), minlength=len(data.classes))
        accuracy = {
            "how": (
                f"each labelled cell predicted by a warm-up trained without it "
                f"({int(pred.label_prob.shape[0])}-fold cross-fitting)"
            ),
            "overall": float(np.mean(pred.held_correct)),
            "per_type": {
                c: float(right[i] / scored[i]) if scored[i] else None
                for i, c in enumerate(data.classes)
            },
        }
    check = fit.self_check or {}
    return {
        "command": current().command,
        "labels_key": labels_key,
        "reference": {
            "n_cells": int(lab.sum()),
            "cells_per_type": {c: int(n) for c, n in zip(data.classes, per_type, strict=True)},
            "n_genes": len(data.genes),
            "batches": list(data.domain_names),
        },
        "n_cells_annotated": int((~lab).sum()),
        "accuracy": accuracy,
        "novel_clusters": dict(novel_sizes),
        "self_check": {k: v for k, v in check.items() if k != "notes"} or None,
        "notes": [*fit.found.notes, *check.get("notes", [])],
        "options": _changed_options(fit.config),
        "versions": _versions(),
    }


def format_card(card: dict[str, Any], genes: list[str]) -> str:
    """The card as text, for a terminal."""
    if not card:
        return (
            "This model file has no card (saved by an orca_sc version before 0.3); its genes: "
            f"{len(genes)}."
        )
    ref = card["reference"]
    v = card["versions"]
    lines = [
        f"orca_sc model, trained with orca_sc {v['orca_sc']} (python {v['python']}, torch "
        f"{v['torch']}, anndata {v['anndata']}, scanpy {v['scanpy']})",
        f"Command: {card['command'] or 'from Python (orca_sc.tl.annotate / OrcaModel.fit)'}",
        f"Reference: {ref['n_cells']:,} labelled cells of {len(ref['cells_per_type'])} types "
        f"(obs[{card['labels_key']!r}]), {ref['n_genes']:,} genes, batches "
        f"{', '.join(ref['batches'])}; {card['n_cells_annotated']:,} cells annotated",
    ]
    acc = card.get("accuracy") or {}
    per = acc.get("per_type", {})
    lines.append(
        "Known types (reference cells; accuracy on held-out reference cells):"
        if per
        else "Known types (reference cells; no held-out accuracy: novelty_folds=0):"
    )
    width = max(len(t) for t in ref["cells_per_type"])
    for t, n in ref["cells_per_type"].items():
        a = per.get(t)
        lines.append(f"  {t:<{width}}  {n:>7,}" + (f"  {a:.3f}" if a is not None else ""))
    if per:
        lines.append(f"  overall accuracy {acc['overall']:.3f} ({acc['how']})")
    novel = card.get("novel_clusters") or {}
    lines.append(
        "Novel clusters: "
        + (", ".join(f"{k} ({n:,} cells)" for k, n in novel.items()) if novel else "none")
    )
    check = card.get("self_check")
    if check:
        if "skipped" in check:
            lines.append(f"Self-check: skipped ({check['skipped']})")
        else:
            lines.append(
                f"Self-check ({', '.join(check['hidden_types'])} hidden): "
                f"{check['novel_called']:.1%} of their cells called novel, "
                f"{check['known_called_novel']:.1%} of held-out known-type cells called novel, "
                f"{check['hidden_clusters_found']} clusters for {check['hidden_types_true']} types"
            )
    lines += [f"Note: {n}" for n in card.get("notes", [])]
    options = card.get("options") or {}
    lines.append(
        "Options (not default): "
        + (", ".join(f"{k}={val!r}" for k, val in options.items()) if options else "none")
    )
    return "\n".join(lines)
