"""What every stage of a run reads, built once (:class:`RunContext`): the prepared data, its
alignment, the training matrix on the device, the options and the laboratory's settings, the
schedule and random streams, and the space discovery reads (a PCA of the aligned expression or
of Pearson residuals, an integrated embedding, or the user's own); on large data, the same on
the sample that the warm-ups and discovery run on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Any

import numpy as np
import torch

from ._ablation import LAB, Ablation, DiscoveryRules
from ._align import compute_transform
from ._cells import CellMatrix, infer, resolve_device
from ._config import OrcaConfig
from ._data import PreparedData, prepare
from ._discover import (
    PearsonResiduals,
    pca_embedding,
)
from ._discover.compute import kneighbors
from ._discover.graph import leiden, pca_input_verdict
from ._dist import Comm, init_from_env, rank_device
from ._engine import stage
from ._integrate import integrated_space
from ._train import Schedule, TrainRandom, schedule
from .module import OrcaNet


# ------------------------------------------------------------------------------------ context
@dataclass(frozen=True)
class Transform:
    """Per-batch alignment ``x * scale[batch] + offset[batch]`` (each ``(n_batches, G)``) and
    its JSON-able details (method, anchor batch, shift norms).
    """

    scale: np.ndarray
    offset: np.ndarray
    info: dict[str, Any]
    #: each cell's row of ``scale`` and ``offset`` where the per-type alignment gave it one of
    #: its own (``Ablation.type_alignment``); ``None``: every cell its batch's
    group: np.ndarray | None = None

    def code(self, domain: np.ndarray) -> np.ndarray:
        """Each cell's row of ``scale`` and ``offset`` (``domain``: the cells' batches)."""
        return domain if self.group is None else self.group

    def rows(self, sample: np.ndarray) -> Transform:
        """The alignment of the cells ``sample`` alone."""
        return self if self.group is None else replace(self, group=self.group[sample])


#: the level of the test that switches discovery's PCA to Pearson residuals (``pca_input="auto"``)
PCA_INPUT_ALPHA = 0.05


def choose_pca_input(run: RunContext, residuals: PearsonResiduals) -> dict[str, Any]:
    """``pca_input="auto"``: the Pearson residuals where the labelled cells say that they tell
    cell types apart better than the log-normalised expression, else the log values.

    The labelled cells (at most ``calibration_cells``, at random) are put in each PCA and each
    is given the majority label of its ``n_neighbors`` nearest labelled cells (itself left
    out). The residuals are used when they classify more cells right than the log values and a
    one-sided exact McNemar test on the cells the two disagree on rejects "no better" at
    :data:`PCA_INPUT_ALPHA`: the log values stay unless the data show the residuals pay.
    Returns the record (both accuracies, the discordant counts, the p-value).
    """
    d, dc, seed = run.data, run.rules, run.config.seed
    lab = np.flatnonzero(d.labels >= 0)
    if lab.size > dc.calibration_cells:
        lab = np.sort(np.random.default_rng(seed).choice(lab, dc.calibration_cells, replace=False))
    y = d.labels[lab]
    record: dict[str, Any] = {"pca_input": "log", "asked": "auto"}
    if np.unique(y).size < 2 or lab.size <= dc.n_neighbors:
        return {**record, "reason": "too few labelled cells to compare"}
    t = run.transform
    right = []
    for res in (None, residuals):
        z = pca_embedding(d.X, d.domain, t.scale, t.offset, n_comps=dc.n_pcs, seed=seed,
                          rows=lab, residuals=res, group=t.group)  # fmt: skip
        nb = y[kneighbors(z, dc.n_neighbors)]  # each cell itself left out
        votes = np.stack([(nb == k).sum(axis=1) for k in range(int(y.max()) + 1)], axis=1)
        right.append(votes.argmax(axis=1) == y)
    return {**record, **pca_input_verdict(right[0], right[1], PCA_INPUT_ALPHA)}


@dataclass(frozen=True)
class RunContext:
    """Everything a stage reads, built once: the prepared data, its alignment, the training
    matrix on the device, the configuration, the schedule, the random streams carried from the
    warm-up to the open-world fit, and the processes that train together.
    """

    data: PreparedData
    transform: Transform
    cells: CellMatrix
    config: OrcaConfig
    plan: Schedule
    rand: TrainRandom
    comm: Comm
    #: the laboratory's settings (ORCA's by default; the benchmark varies them)
    lab: Ablation = LAB
    #: the PCA of all cells per number of components (discovery and the pair partners read it)
    _pca_all: dict[int, np.ndarray] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: the Pearson residuals' depths and gene shares, fitted at the first PCA that reads them
    _residuals: list = field(default_factory=list, init=False, repr=False, compare=False)
    #: what the PCA reads and why, decided once (a context on a sample shares its run's)
    _pca_input: list = field(default_factory=list, repr=False, compare=False)
    #: the pretrained backbone and its record (``Ablation.pretrain``), made once per run
    _pretrained: list = field(default_factory=list, repr=False, compare=False)

    @property
    def pretrained(self) -> dict | None:
        """The pretrained backbone's ``state_dict`` the warm-ups start from (``None``: none)."""
        return self._pretrained[0][0] if self._pretrained else None

    @cached_property
    def rules(self) -> DiscoveryRules:
        """What discovery's rules read: the user's options and the rules' constants."""
        return DiscoveryRules.of(self.config.discovery, self.lab)

    @cached_property
    def warmup_cluster_targets(self) -> np.ndarray | None:
        """Each cell's Leiden cluster for the warm-ups' cluster term (``Ablation.warmup_clusters``;
        ``warmup_clusters_space`` says where it is cut), ``(n_cells,)``, ``-1`` for a cell
        without one; ``None`` without the term or where there is one cluster or none.
        """
        lab = self.lab
        if not lab.warmup_clusters:
            return None
        d, dc, seed = self.data, self.rules, self.config.seed
        cut = partial(leiden, resolution=dc.query_resolution, seed=seed,
                      n_neighbors=dc.n_neighbors)  # fmt: skip
        if lab.warmup_clusters_space != "batch":  # every cell, one space for all batches
            emb = self.pca(dc.n_pcs)
            if lab.warmup_clusters_space != "joint":
                joint = integrated_space(emb, d.domain, lab.warmup_clusters_space, seed,
                                         d.labeled)[0]  # fmt: skip
                emb = emb if joint is None else joint  # one batch: nothing to integrate
            out = cut(emb).astype(np.int64)
        else:  # each batch's unlabelled cells, codes unique over the batches
            out = np.full(d.n_cells, -1, dtype=np.int64)
            for b in np.unique(d.domain):  # loop over batches, not cells
                rows = np.flatnonzero((d.domain == b) & (d.labels < 0))
                if rows.size > dc.n_neighbors:
                    out[rows] = cut(self.pca(dc.n_pcs, rows)) + out.max() + 1
        return out if out.max() > 0 else None

    @property
    def n_seen(self) -> int:
        return len(self.data.classes)

    def pca(self, n_comps: int, rows: np.ndarray | None = None) -> np.ndarray:
        """PCA of the aligned expression of ``rows`` (all cells by default); that of all cells
        is computed once per number of components.
        """
        t = self.transform
        X, domain, seed = self.data.X, self.data.domain, self.config.seed
        n = self.data.n_cells
        every = rows is None or (rows.size == n and bool(np.array_equal(rows, np.arange(n))))
        if every and n_comps in self._pca_all:
            return self._pca_all[n_comps]
        out = pca_embedding(X, domain, t.scale, t.offset, n_comps=n_comps, seed=seed, rows=rows,
                            residuals=self.residuals(), group=t.group)  # fmt: skip
        if every:  # shared by its readers, which do not write to it
            self._pca_all[n_comps] = out
        return out

    @property
    def pca_input(self) -> str:
        """What the PCA reads: ``"pearson"`` or ``"log"`` (:meth:`pca_input_record`)."""
        return self.pca_input_record()["pca_input"]

    def pca_input_record(self) -> dict[str, Any]:
        """What the PCA reads and why, decided once: ``"log"`` where asked or where some input
        was not counts; ``"pearson"`` where asked; with ``"auto"``, the Pearson residuals where
        they tell the labelled types apart better (:func:`choose_pca_input`).
        """
        if self._pca_input:
            return self._pca_input[0]
        asked, counts = self.config.discovery.pca_input, self.has_counts
        record: dict[str, Any] = {"pca_input": "log" if asked == "log" or not counts else asked}
        if asked != "log" and not counts:
            record["reason"] = "not every input held counts"
        if record["pca_input"] == "auto":
            record = choose_pca_input(self, self.residuals_fit())
        self._pca_input.append(record)
        return record

    @property
    def has_counts(self) -> bool:
        """Whether every cell's total counts were recorded while reading (counts input)."""
        totals = self.data.totals
        return totals is not None and totals.size > 0 and bool(np.isfinite(totals).all())

    def residuals_fit(self) -> PearsonResiduals:
        """The Pearson residuals' depths and gene shares of all cells, fitted once."""
        if not self._residuals:
            d = self.data
            self._residuals.append(
                PearsonResiduals.fit(d.X, d.domain, d.totals, self.config.target_sum)
            )
        return self._residuals[0]

    def residuals(self) -> PearsonResiduals | None:
        """The Pearson residuals the PCA reads (``None``: the log-normalised expression)."""
        return self.residuals_fit() if self.pca_input == "pearson" else None

    def discovery_space(
        self, rows: np.ndarray, batch: np.ndarray
    ) -> tuple[Callable[[np.ndarray], np.ndarray], dict[str, Any]]:
        """The space discovery reads for the cells ``rows`` (``batch``: their batches):
        ``pca_of(idx)`` (positions into ``rows``) and its record. By default the PCA of each
        cell set's aligned expression; with ``discovery.integration="harmony"`` and several
        batches, the rows of one Harmony embedding of the joint PCA of all of ``rows``; with
        ``discovery.use_rep``, the rows of the user's embedding.
        """
        dc, seed = self.rules, self.config.seed
        if self.data.rep is not None:  # the user's own integrated embedding: no PCA
            rep = self.data.rep[rows]
            info = {"method": "use_rep", "key": dc.use_rep, "width": int(rep.shape[1])}
            return rep.__getitem__, info
        info: dict[str, Any] = {"method": "none", **self.pca_input_record()}
        if dc.integration == "none":
            return (lambda idx: self.pca(dc.n_pcs, rows[idx])), info
        done: list[np.ndarray | None] = []

        def pca_of(idx: np.ndarray) -> np.ndarray:
            if not done:  # computed at the first call (on the process that decides)
                with stage("integration"):
                    pcs = self.pca(dc.n_pcs, rows)
                    emb, record = integrated_space(
                        pcs, batch, dc.integration, seed, self.data.labeled[rows]
                    )
                done.append(emb)
                info.clear()
                info.update(record, **self.pca_input_record())
            if done[0] is None:
                return self.pca(dc.n_pcs, rows[idx])
            return done[0][idx]

        return pca_of, info


def _batch_clusters(X, domain, rows, scale, offset) -> np.ndarray:
    """Leiden clusters (resolution 1) of the cells ``rows`` on the PCA of their aligned
    expression (the per-type alignment's ``"cluster"`` study).
    """
    z = pca_embedding(X, domain, scale, offset, n_comps=30, seed=0, rows=rows)
    return leiden(z, 1.0, 0)


def run_context(
    adata: Any, reference: Any | None, labels_key: str, cfg: OrcaConfig, lab: Ablation = LAB
) -> RunContext:
    """Prepare the data, align its batches and put the training matrix on the device."""
    comm = init_from_env(cfg.device)
    device = resolve_device(rank_device(cfg.device, comm))  # options first, then the data
    if comm.active and not comm.main:
        cfg = cfg.replace(progress=False)
    with stage("prepare"):
        data = prepare(adata, reference, labels_key, cfg, comm, lab.min_shared_genes)
    n_batches, n_seen = len(data.domain_names), len(data.classes)
    with stage("alignment"):
        transform = Transform(
            *comm.on_main(
                compute_transform,
                cfg.alignment,
                data.X,
                data.labels,
                data.domain,
                n_batches,
                n_seen,
                lab.type_alignment,
                partial(_batch_clusters, data.X, data.domain),
            )
        )
    cells = CellMatrix(data.X, transform.code(data.domain), transform.scale, transform.offset,
                       device)  # fmt: skip
    return RunContext(
        data, transform, cells, cfg, schedule(data.n_cells, cfg, lab),
        TrainRandom(cfg.seed, device), comm, lab,
    )  # fmt: skip


def discovery_sample(run: RunContext) -> np.ndarray | None:
    """The cells (sorted rows) that the warm-ups and discovery run on: a random
    ``discovery.discovery_cells`` of them (the run's seed) above that many, else ``None`` (all).

    The warm-up's stopping rule ends it after a number of optimiser steps that hardly moves with
    the data's size, so the more cells, the less closely it fits each labelled cell, and the
    in-sample threshold and every vote built on it follow: on the simulated droplet-depth
    scale task the same data found 6-9 novel types at 20,000 cells and 0 at 100,000 at some
    seeds (docs/discovery.md). On a sample of fixed size the warm-ups see each labelled cell as
    often as at that size, whatever the size of the data.
    """
    cap, n = run.config.discovery.discovery_cells, run.data.n_cells
    if cap is None or n <= cap:
        return None
    rng = np.random.default_rng([run.config.seed, 0xD15C])
    return np.sort(rng.choice(n, cap, replace=False))


def sample_context(run: RunContext, sample: np.ndarray) -> RunContext:
    """The run's context on the cells ``sample`` alone: their rows of the data and training
    matrix, their own schedule, random streams (the run's seed) and PCA; same alignment,
    configuration, processes and choice of what the PCA reads (``pca_input``, decided once, on
    whichever cells ask first: the sample's, where discovery runs on one).
    """
    d, t, cfg = run.data, run.transform.rows(sample), run.config
    data = replace(
        d, X=d.X[sample], labels=d.labels[sample], domain=d.domain[sample],
        output_rows=np.flatnonzero(np.isin(sample, d.output_rows)),
        rep=None if d.rep is None else d.rep[sample],
        totals=None if d.totals is None else d.totals[sample],
    )  # fmt: skip
    cells = CellMatrix(data.X, t.code(data.domain), t.scale, t.offset, run.cells.device)
    rand = TrainRandom(cfg.seed, cells.device)
    if not run.has_counts:  # some input is not counts anywhere in the data: no test to run
        run.pca_input_record()
    # one choice of what the PCA reads per run, made on the sample where discovery runs: the
    # pair partners of all cells then read what discovery read (and the test is not repeated)
    return RunContext(data, t, cells, cfg, schedule(sample.size, cfg, run.lab), rand, run.comm,
                      run.lab, _pca_input=run._pca_input,
                      _pretrained=run._pretrained)  # fmt: skip


def seen_similarity(
    net: OrcaNet, cells: CellMatrix, idx: np.ndarray, comm: Comm | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The L2-normalised embedding of the cells ``idx`` ``(n, D)`` and their cosine to each seen
    head of ``net`` ``(n, n_seen)`` (the net has no novel heads yet).
    """
    _, emb = infer(net, cells, idx, comm)
    seen_w = torch.nn.functional.normalize(net.head.weight.detach(), dim=1).cpu().numpy()
    return emb, emb @ seen_w.T
