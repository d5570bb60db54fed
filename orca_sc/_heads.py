"""The trained heads named: each cell's head, the novel clusters that are a known type of another
batch or one novel type in several batches (orca_sc._discover.naming), the heads too small to be
a cluster pruned, and the novelty score's reference quantiles.
"""

from __future__ import annotations

import numpy as np

from ._align import (
    aligned_group_means,
    profile_similarity,
)
from ._annotation import (
    Naming,
)
from ._discover import match_known_types, match_novel_across_batches, name_heads
from ._discover.naming import cluster_reliabilities, naming_means, too_few_cells
from ._discover.ood import cells_for_quantile
from ._engine import publish
from ._notes import Note
from ._pipeline import Fit
from .module import OrcaNet


def best_head(probs: np.ndarray, head_names: list[str | None]) -> np.ndarray:
    """Most probable head of each cell among the kept heads (a ``None`` name: pruned, never
    wins).
    """
    kept = np.array([n is not None for n in head_names])
    return np.where(kept[None, :], probs, -1.0).argmax(axis=1)


def canonical_heads(head_names: list[str | None], head: np.ndarray) -> np.ndarray:
    """``head`` with every head replaced by the first head of the same name (novel heads that
    are one type in several batches share a name).
    """
    first: dict[str | None, int] = {}
    for i, n in enumerate(head_names):
        first.setdefault(n, i)
    canon = np.array([first[n] if n is not None else i for i, n in enumerate(head_names)])
    return canon[head]


def novel_names_of(head_names: list[str | None], classes: list[str]) -> list[str]:
    """Names of the novel clusters (kept novel heads): ``novel_1`` (largest), ``novel_2``, ...;
    a novel head merged into a known type carries that type's name and is not one.
    """
    known = set(classes)
    names = {n for n in head_names[len(classes) :] if n is not None and n not in known}
    return sorted(names, key=lambda n: int(n.rsplit("_", 1)[1]))


def seen_cosine(net: OrcaNet, n_seen: int, embedding: np.ndarray) -> np.ndarray:
    """Each cell's cosine to its nearest seen-class head of ``net``, ``(n,)``, from its
    L2-normalised ``embedding`` ``(n, D)``.
    """
    w = net.head.weight.detach().cpu().numpy()[:n_seen]
    w = w / np.maximum(np.linalg.norm(w, axis=1, keepdims=True), 1e-12)
    return (embedding @ w.T).max(axis=1)


def novelty_quantiles(net: OrcaNet, n_seen: int, embedding: np.ndarray) -> list[float]:
    """1,001 quantiles of the labelled cells' cosine to their nearest seen head (``embedding``
    of the labelled cells), against which :meth:`OrcaModel.novelty` scores cells.
    """
    cos = seen_cosine(net, n_seen, embedding)
    return np.quantile(cos, np.linspace(0, 1, 1001)).tolist()


def name_heads_of_fit(fit: Fit, head: np.ndarray) -> tuple[list[str | None], Naming]:
    """Every head's name from the training cells' heads ``head``: novel clusters that are a
    known type of another batch carry its name (:func:`orca_sc._discover.match_known_types`),
    the others are ``novel_1``, ``novel_2``, ... by size; heads with fewer unlabelled cells than
    ``DiscoveryRules.min_novel_cells`` are pruned (``None``). Also the record of the merges.
    """
    data, classes = fit.data, list(fit.data.classes)
    n_seen, n_novel = len(classes), fit.found.n_heads
    unl = ~data.labeled
    counts = np.bincount(head[unl], minlength=n_seen + n_novel)[n_seen:]
    pairs, same, tested = [], [], []
    threshold = fit.config.discovery.merge_threshold
    if threshold is not None and n_novel > 0:
        # the batches' background, the clusters' and the known types' means: one pass over X
        clusters = np.where(unl & (head >= n_seen), head - n_seen, -1)
        background, (means, n_in), known = naming_means(
            data.X, data.labels, data.domain, clusters, n_novel, n_seen
        )
        kept = np.where(unl & (head < n_seen), head, -1)  # the query cells of known heads
        # each cluster's reliability, once for both matches
        rel = cluster_reliabilities(
            data.X, data.domain, clusters, (means, n_in), background, fit.config.seed
        )
        pairs = match_known_types(
            data.X, data.labels, data.domain, clusters, n_novel, n_seen, threshold,
            background=background, cluster_means=(means, n_in), known_means=known, kept=kept,
            alpha=fit.config.discovery.novelty_alpha, seed=fit.config.seed, tested=tested,
            cluster_reliability=rel,
        )  # fmt: skip
    if threshold is not None and n_novel > 1:  # one novel type found in several batches
        into_known = [h for h, _, _ in pairs]
        clusters[np.isin(clusters, into_known)] = -1
        means, n_in = means.copy(), n_in.copy()
        means[into_known], n_in[into_known] = 0.0, 0.0  # as if their cells were no cluster's
        same = match_novel_across_batches(
            data.X, data.domain, clusters, n_novel, threshold,
            background=background, cluster_means=(means, n_in), seed=fit.config.seed,
            cluster_reliability=rel,
        )  # fmt: skip
    # a head that won fewer cells than a cluster needs is no cluster: pruned (its cells take
    # their next most probable head), unless its signature made it a known type above
    bar = fit.rules.min_novel_cells
    too_few = too_few_cells(counts, bar)
    publish("heads", lambda: {
        "head": head.copy(), "n_seen": n_seen, "merged_into_known": [h for h, _, _ in pairs],
        "pruned": np.flatnonzero(too_few).tolist(),
    })  # fmt: skip
    head_names, order = name_heads(np.where(too_few, 0, counts), classes, pairs, same)
    # the cells of each head that pruning took, largest first (a head merged into a known type
    # keeps its name)
    pruned = sorted((int(counts[h]) for h in range(n_novel) if too_few[h] and counts[h] > 0
                     and head_names[n_seen + h] is None), reverse=True)  # fmt: skip
    notes = []
    if pruned:
        sizes = ", ".join(map(str, pruned))
        notes.append(Note(
            f"{len(pruned)} novel head(s) of {sizes} cell(s), under the {bar} a cluster needs, "
            "pruned (uns['orca']['n_novel']['pruned']).",
            f"{len(pruned)} novel head(s) won only {sizes} unlabelled cell(s), fewer than the "
            f"{bar} a cluster needs: too few for a cluster the data can support, so their cells "
            "take their next most probable head (uns['orca']['n_novel']['pruned']).",
        ))  # fmt: skip
    for (h, k, _), t in zip(pairs, tested, strict=True):
        if t["set_apart"] and counts[h] > 0:
            n, name = int(counts[h]), classes[k]
            notes.append(Note(
                f"A cluster of {n} cells kept as '{name}' matches it less well than its own "
                f"cells (p = {t['p_value']:.3f}): maybe a type beside it "
                "(uns['orca']['merged_into_known']).",
                f"A novel cluster of {n} cells was reported as {name} (its marker signature "
                f"matches the type's), but matches {name} less well than the {t['n_kept']} query "
                f"cells {name}'s head kept in its batch (permutation p = {t['p_value']:.3f}): it "
                f"may be a novel type beside {name}, or a part of {name} that looks unlike it "
                "(uns['orca']['merged_into_known']).",
            ))  # fmt: skip
    notes += thin_merge_notes(pairs, tested, counts, classes, threshold,
                              cells_for_quantile(fit.config.discovery.novelty_alpha))  # fmt: skip
    merged = {
        "cluster": [f"head_{h}" for h, _, _ in pairs],
        "type": [classes[k] for _, k, _ in pairs],
        "n_cells": [int(counts[h]) for h, _, _ in pairs],
        "correlation": [round(r, 4) for _, _, r in pairs],
        # the type's own query cells in the cluster's batch, and whether the cluster matches
        # the type less well than they do (a novel sibling, or a part the fit split off)
        "n_type_cells": [t["n_kept"] for t in tested],
        "p_beside": [round(t["p_value"], 4) for t in tested],
        "beside": [t["set_apart"] for t in tested],
        # the correlation before the correction for few cells, and the labelled cells behind
        # the type's signature
        "raw_correlation": [round(t["raw"], 4) for t in tested],
        "n_type_labelled": [t["n_labelled"] for t in tested],
    }
    return head_names, Naming(merged, order, {
        "cluster": [f"head_{a}" for a, _, _ in same],
        "same_as": [f"head_{b}" for _, b, _ in same],
        "name": [head_names[n_seen + b] for _, b, _ in same],
        "correlation": [round(r, 4) for _, _, r in same],
    }, pruned, notes)  # fmt: skip


def thin_merge_notes(pairs: list, tested: list, counts: np.ndarray, classes: list[str],
                     threshold: float, min_cells: int) -> list[Note]:  # fmt: skip
    """One note for the novel clusters reported as known types (``pairs``, with ``tested``: the
    records of :func:`orca_sc._discover.match_known_types`) whose marker-signature correlation
    meets ``threshold`` only once corrected for the few cells behind the signatures, where the
    type's signature rests on fewer than ``min_cells`` labelled cells (as few as a 5% quantile
    cannot be read from): the correction divides by a reliability those cells estimate
    poorly, so the data cannot tell the type from a novel type beside it.
    """
    thin = [
        (int(counts[h]), classes[k], t["raw"], r, t["n_labelled"])
        for (h, k, r), t in zip(pairs, tested, strict=True)
        if counts[h] > 0 and t["raw"] < threshold and t["n_labelled"] < min_cells
    ]
    if not thin:
        return []
    short = "; ".join(f"{n} cells as '{name}' ({raw:.2f} -> {r:.2f}, {m} labelled)"
                      for n, name, raw, r, m in thin)  # fmt: skip
    long = "; ".join(
        f"{n} cells reported as {name}: correlation {raw:.2f}, {r:.2f} corrected, {name}'s "
        f"signature from {m} labelled cells"
        for n, name, raw, r, m in thin
    )
    return [Note(
        f"{len(thin)} cluster(s) reported as known types only on matches corrected for the few "
        f"labelled cells behind them ({short}): maybe types beside them "
        "(uns['orca']['merged_into_known']).",
        f"{len(thin)} novel cluster(s) were reported as known types whose marker-signature "
        f"correlation reaches the {threshold:g} a merge needs only once corrected for the few "
        f"cells behind the two signatures ({long}). With fewer than the {min_cells} labelled "
        "cells that estimate a signature's noise, the correction may overstate the match: each "
        "may be a novel type beside the known one (uns['orca']['merged_into_known']).",
    )]  # fmt: skip


def _novel_similarity(fit: Fit, head: np.ndarray, head_names: list, novel_names: list) -> dict:
    """Centred expression correlation of each novel cluster (its unlabelled cells) with each known
    type (its labelled cells), both after batch alignment.

    Stored as ``{"clusters": [...], "types": [...], "similarity": (n_clusters, n_types)}``: cell
    type names may contain "/" and so cannot be keys of an h5ad group.
    """
    data, t = fit.data, fit.transform
    n_seen = len(data.classes)
    groups = np.where(data.labeled, data.labels, np.where(head >= n_seen, head, -1))
    means = aligned_group_means(
        data.X, groups, len(head_names), t.code(data.domain), t.scale, t.offset
    )
    known = means[:n_seen]
    sims = profile_similarity(means[n_seen:], known, known.mean(axis=0))
    order = [head_names.index(name) - n_seen for name in novel_names]
    return {
        "clusters": list(novel_names),
        "types": list(data.classes),
        "similarity": np.round(sims[order], 4).tolist(),
    }
