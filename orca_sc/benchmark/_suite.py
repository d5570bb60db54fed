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

from ._splits import Task, batch_split, grow_task, protocol_split
from ._tasks import TaskSpec, builtin_tasks, dataset_family, real_family, reversed_tasks


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
    name where there is one (``sim_novel1`` is not also ``sim_novel10``), ``family:real``
    every task of a real dataset family (the families a default is judged on), ``family:TEXT``
    every task whose dataset family contains ``TEXT`` (``family:worm``, any case), else every
    task whose name contains it (``scale50k``, ``grown``).
    """
    names = {s.name for s in specs}
    exact = {o for o in only if o in names}
    families = [o.removeprefix(FAMILY).lower() for o in only if o.startswith(FAMILY)]
    parts = [o for o in only if o not in exact and not o.startswith(FAMILY)]

    def in_family(name: str) -> bool:
        family, real = dataset_family(name), real_family(name)
        return any((f == "real" and real) or (f != "real" and f in family.lower())
                   for f in families)  # fmt: skip

    return [s for s in specs
            if s.name in exact or in_family(s.name) or any(o in s.name for o in parts)]  # fmt: skip


#: ``--only family:...`` selects tasks by dataset family (:func:`select_tasks`)
FAMILY = "family:"
