"""The hard corners of the development suite, built from the real data at hand:

* **sibling splits**: the novel types are those nearest to a type that stays known (centred
  correlation of log-normalised class means), in a separate query: another batch where the data
  has one, else a random half of the cells;
* **few labels**: 5, 10 or 25 labelled reference cells per known type;
* **tiny queries**: at most 15 query cells per type;
* **no novel type**: a query of known types only, from another batch or technology.

Every builder is deterministic given the seed, and the seed draws the labelled cells, the halves
and the subsamples.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from .._errors import OrcaInputError
from ._splits import Task, _labels, batch_split
from ._tasks import (
    PBMC3K,
    SORTED,
    TaskSpec,
    _baron,
    _pbmc_tech,
    _read,
    read_pbmc68k,
    read_pbmc_sorted,
    read_tm,
)

#: the novel types of a sibling split: about this share of the types (at least one)
SIBLING_SHARE = 0.25
#: a type becomes novel only with at least this many cells (so the query has some)
SIBLING_MIN_CELLS = 20
#: genes (highest variance of the class means) on which the class means are compared
SIBLING_GENES = 1000


def class_similarity(adata: Any, labels_key: str) -> tuple[list[str], np.ndarray]:
    """The classes of ``obs[labels_key]`` and their pairwise centred correlation ``(k, k)``
    of log-normalised mean expression (counts are normalised to 10⁴ per cell + ``log1p``) on the
    :data:`SIBLING_GENES` genes whose class means vary most.
    """
    from .._align import profile_similarity
    from .._read import get_matrix, to_log_normalized

    truth = _labels(adata, labels_key).to_numpy()
    classes, codes = np.unique(truth, return_inverse=True)
    X, _ = to_log_normalized(get_matrix(adata, None, "data"), 1e4)
    member = sp.csr_matrix((np.ones(codes.size), (codes, np.arange(codes.size))))
    sizes = np.bincount(codes).astype(np.float64)
    means = np.asarray((member @ X).todense()) / sizes[:, None]  # (k, G)
    top = np.argsort(-means.var(axis=0), kind="stable")[:SIBLING_GENES]
    means = means[:, top]
    return [str(c) for c in classes], profile_similarity(means, means, means.mean(axis=0))


def sibling_types(adata: Any, labels_key: str, share: float = SIBLING_SHARE) -> list[str]:
    """Novel types that each have a close known sibling: pairs of types are taken from the most
    similar down; of a pair whose two types are both still unassigned, the smaller (with at
    least :data:`SIBLING_MIN_CELLS` cells) becomes novel and the other stays known, until
    ``share`` of the types are novel (at least one; two types always stay known).
    """
    classes, sim = class_similarity(adata, labels_key)
    sizes = _labels(adata, labels_key).value_counts()
    k = len(classes)
    n_novel = min(max(1, int(round(share * k))), k - 2)
    if n_novel < 1:
        msg = f"a sibling split needs at least 3 types; obs[{labels_key!r}] has {k}."
        raise OrcaInputError(msg)
    iu = np.triu_indices(k, 1)
    order = np.argsort(-sim[iu], kind="stable")
    novel: list[str] = []
    taken: set[str] = set()
    for p in order:
        a, b = classes[iu[0][p]], classes[iu[1][p]]
        if a in taken or b in taken:
            continue
        small, big = (a, b) if sizes[a] <= sizes[b] else (b, a)
        if sizes[small] < SIBLING_MIN_CELLS:
            continue
        novel.append(small)
        taken |= {small, big}
        if len(novel) == n_novel:
            break
    return sorted(novel)


def sibling_split(
    adata: Any,
    labels_key: str,
    *,
    batch_key: str | None = None,
    reference_batch: str | None = None,
    seed: int = 0,
    name: str = "sibling",
) -> Task:
    """A separate-query split whose novel types are :func:`sibling_types`: the reference is
    ``reference_batch`` (with ``batch_key``) or a random half of the cells, less the novel types;
    the query is every other cell.
    """
    novel = sibling_types(adata, labels_key)
    if batch_key is None:
        adata = adata.copy()
        half = np.random.default_rng(seed).random(adata.n_obs) < 0.5
        adata.obs["_half"] = np.where(half, "reference", "query")
        batch_key, reference_batch = "_half", "reference"
    task = batch_split(adata, labels_key, batch_key, [reference_batch], novel_classes=novel,
                       seed=seed, name=name)  # fmt: skip
    task.info["design"] = "sibling"
    task.info["siblings"] = novel
    return task


def _per_type(labels: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted rows: at most ``n`` random rows of each label."""
    rows = []
    for t in np.unique(labels):
        members = np.flatnonzero(labels == t)
        rows.append(rng.choice(members, min(n, members.size), replace=False))
    return np.sort(np.concatenate(rows))


def few_labels(task: Task, per_type: int, name: str) -> Task:
    """``task`` with at most ``per_type`` labelled reference cells of each known type (drawn with
    the task's seed); the query is unchanged.
    """
    if task.single:
        raise OrcaInputError("few_labels takes a separate-query task, not a protocol split.")
    ref = task.reference
    keep = _per_type(ref.obs[task.labels_key].astype(str).to_numpy(), per_type,
                     np.random.default_rng([task.seed, 5]))  # fmt: skip
    out = replace(task, name=name, reference=ref[keep].copy(), info=dict(task.info))
    out.info["labelled_per_type"] = per_type
    return out


def tiny_query(task: Task, per_type: int, name: str) -> Task:
    """``task`` with at most ``per_type`` query cells of each true type (drawn with the task's
    seed).
    """
    if task.single:
        raise OrcaInputError("tiny_query takes a separate-query task, not a protocol split.")
    keep = _per_type(task.truth, per_type, np.random.default_rng([task.seed, 6]))
    out = replace(task, name=name, query=task.query[keep].copy(), info=dict(task.info))
    out.info["query_per_type"] = per_type
    return out


def known_only(task: Task, name: str) -> Task:
    """``task`` with the query's cells of types the reference lacks removed: nothing is novel."""
    keep = np.flatnonzero(np.isin(task.truth, task.seen))
    out = replace(task, name=name, query=task.query[keep].copy(), info=dict(task.info))
    out.info["design"] = "no novel type"
    return out


# ----------------------------------------------------------------------------- the tasks
def _sibling(load, name: str, seed: int, **kw) -> Task:
    return sibling_split(load(), "cell_type", seed=seed, name=name, **kw)


def _pair_sibling(path: Path, name: str, reference: str, seed: int) -> Task:
    """The sorted PBMC populations and pbmc3k on their shared vocabulary
    (``cell_type_common``), one experiment the reference: the sibling types of the two
    together hidden from it, besides the types only the query has.
    """
    return sibling_split(_read(path), "cell_type_common", batch_key="batch",
                         reference_batch=reference, seed=seed, name=name)  # fmt: skip


def _then(build, change, seed: int) -> Task:
    return change(build(seed))


def hard_tasks(data_dir: str | Path | None) -> list[TaskSpec]:
    """The sibling, few-label, tiny-query and no-novel tasks whose data is here (pbmc68k_reduced
    ships with scanpy). The PBMC cross-technology data has three types, so its sibling split
    would be the built-in task (B cells novel); it has no sibling task of its own.
    """
    specs: list[TaskSpec] = []
    d = Path(data_dir) if data_dir is not None else None

    def have(file: str) -> bool:
        return d is not None and (d / file).is_file()

    def add(name, kind, make, description):
        specs.append(TaskSpec(name, kind, make, description))

    sib = {}  # sibling builders by dataset, reused by the few-label and tiny-query tasks
    if have("tm_facs_scfind.h5ad"):
        sib["tm"] = partial(_sibling, partial(read_tm, d / "tm_facs_scfind.h5ad"), "sibling_tm")
    if have("baron_mouse.h5ad"):
        sib["baron"] = partial(_sibling, partial(_read, d / "baron_mouse.h5ad"),
                               "sibling_baron", batch_key="batch", reference_batch="mouse1")  # fmt: skip
    for file, key in (("mca_bladder.h5ad", "mca"), ("worm_neuron.h5ad", "worm")):
        if have(file):
            sib[key] = partial(_sibling, partial(_read, d / file), f"sibling_{key}")
    sib["pbmc68k"] = partial(_sibling, read_pbmc68k, "sibling_pbmc68k")
    if have("pbmc_sorted_vs_3k.h5ad"):  # five close T-cell subsets among nine populations
        sib["pbmc_sorted"] = partial(
            _sibling, partial(read_pbmc_sorted, d / "pbmc_sorted_vs_3k.h5ad"), "sibling_pbmc_sorted"
        )
    for key, build in sib.items():
        add(f"sibling_{key}", "sibling", build,
            f"{key}: novel types = those nearest to a known type, separate query")  # fmt: skip
    # the sibling splits across the real pairs, each way: the reference one batch of the pair
    # less the sibling types, the query the other batch
    if have("baron_mouse.h5ad"):
        add("sibling_baron_mouse2_to_mouse1", "sibling",
            partial(_sibling, partial(_read, d / "baron_mouse.h5ad"),
                    "sibling_baron_mouse2_to_mouse1", batch_key="batch", reference_batch="mouse2"),
            "pancreas: sibling types hidden, mouse 2 reference, mouse 1 query")  # fmt: skip
    if have("pbmc_sorted_vs_3k.h5ad"):
        for ref, name in ((SORTED, "sibling_pbmc_sorted_to_3k"),
                          (PBMC3K, "sibling_pbmc_3k_to_sorted")):  # fmt: skip
            add(name, "sibling",
                partial(_pair_sibling, d / "pbmc_sorted_vs_3k.h5ad", name, ref),
                f"PBMC sorted / pbmc3k on the shared vocabulary: sibling types hidden, {ref} "
                "reference, the other experiment the query")  # fmt: skip
    few_sources = {k: sib[k] for k in ("mca", "pbmc68k") if k in sib}
    if have("baron_mouse.h5ad"):
        few_sources = {"baron": partial(_baron, d / "baron_mouse.h5ad", "baron"), **few_sources}
    for key, build in few_sources.items():
        for n in (5, 10, 25):
            name = f"few{n}_{key}"
            add(name, "few labels",
                partial(_then, build, partial(few_labels, per_type=n, name=name)),
                f"{key}: {n} labelled reference cells per known type")  # fmt: skip
    tiny_sources = dict(few_sources)
    if have("scannotate_pbmc.h5ad"):
        tiny_sources["pbmc"] = partial(_pbmc_tech, d / "scannotate_pbmc.h5ad", "pbmc")
    for key, build in tiny_sources.items():
        name = f"tiny_{key}"
        add(name, "tiny query", partial(_then, build, partial(tiny_query, per_type=15, name=name)),
            f"{key}: at most 15 query cells per type")  # fmt: skip
    if have("scannotate_pbmc.h5ad"):
        for ref, other in (("Drop-seq", "inDrops"), ("inDrops", "Drop-seq")):
            name = f"none_pbmc_{ref.lower().replace('-', '')}_to_{other.lower().replace('-', '')}"
            build = partial(_pbmc_tech, d / "scannotate_pbmc.h5ad", name, reference=ref, hidden=())
            add(name, "no novel", partial(_then, build, partial(known_only, name=name)),
                f"PBMC {ref} -> {other}, every query type known")  # fmt: skip
    if have("baron_mouse.h5ad"):
        build = partial(_baron, d / "baron_mouse.h5ad", "none_baron", hidden=())
        add("none_baron", "no novel", partial(_then, build, partial(known_only, name="none_baron")),
            "pancreas mouse 1 -> mouse 2, query types absent from the reference removed")  # fmt: skip
    return specs


__all__ = [
    "class_similarity",
    "few_labels",
    "hard_tasks",
    "known_only",
    "sibling_split",
    "sibling_types",
    "tiny_query",
]
