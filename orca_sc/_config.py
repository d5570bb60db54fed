"""The one configuration object shared by the Python API, the CLI and saved models."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from ._errors import ConfigError

MarginMode = Literal["adaptive", "fixed", "zero"]
AlignMode = Literal["centroid", "standardize", "none"]
PriorMode = Literal["data", "uniform"]
PairSpace = Literal["both", "pca", "embedding"]

#: Scale ``s`` of the L2-normalised head (paper Eq. 3). Defined here once; the head multiplies its
#: cosine similarities by it and the margin is expressed in cosine units.
HEAD_SCALE: float = 10.0


@dataclass(frozen=True)
class DiscoveryConfig:
    """Every rule of the ``discover`` stage (:func:`orca_sc._discover.discover`): which unlabelled
    cells form candidate novel clusters after the warm-up, how many novel types there are, and
    which novel clusters are reported as known types. Saved with the model; each field names the
    measurement behind its default ("sim" = :func:`orca_sc.datasets.simulate`; the real tasks are
    those of ``orca-sc benchmark``).

    Candidate clusters
    ------------------
    ood_quantile
        An unlabelled cell is out-of-distribution when its best cosine to a seen head is below
        this quantile of the labelled training cells' (those the warm-up fitted) ...
    ood_max_rate, calibration_fraction, calibration_max_cells
        ... but, with ``calibration_fraction > 0``, never above the ``ood_max_rate`` quantile of
        labelled cells held out of the warm-up (that share of each seen class, at most
        ``calibration_max_cells`` in all; every class keeps a training cell): a known-type cell
        the net has not seen is then called out-of-distribution at most that often (split
        conformal). On the cells it fitted the net is over-confident, the more so the fewer the
        labels: the in-sample threshold called 4-25% of held-out known cells
        out-of-distribution on the shared real tasks, 45-71% with few labels. With
        ``calibration_fraction=0.2`` the development suite's few-label corners improve (5%
        labelled: known-type cells called novel 47% -> 8%; 200-cell reference: 17% -> 2%) but
        the real tasks lose (the warm-up trains on 80% of the labels: PBMC cross-technology
        loses its novel B cluster at one seed, MCA and worm novel accuracy -4 to -5 points), so
        it is off by default (``0``: every labelled cell trains and the threshold is in-sample).
    calibration_probe
        With ``calibration_fraction > 0``: leave the held-out cells out of a second, probe
        warm-up instead of the main one, and cap the main warm-up's threshold at the probe's
        calibrated one (cross-fitting, :func:`orca_sc._discover.probe_threshold`): every label
        trains the model, at the cost of one more warm-up.
    self_check, self_check_types, self_check_known
        Run a self-check on the reference (DTC's probe classes): hide ``self_check_types`` of
        the known types (at least one, each with at least ``n_neighbors`` labelled cells; two
        stay known) and ``self_check_known`` of every other type's labelled cells (as a query
        batch of their own where the real query is one), train a second warm-up without them
        and run these rules; report
        how many hidden-type cells they call novel, how many held-out known-type cells, and how
        the hidden types are clustered (``uns['orca']['self_check']``). It measures the rules on
        the data at hand at the cost of one more warm-up and does not change the annotation.
    resolution
        Leiden resolution of the candidate clusters, or ``"auto"``: the value of
        ``resolution_grid`` at which Leiden clusters of the labelled cells best match their
        labels (ARI), so novel types are cut as finely as the reference's. It only acts where
        labelled and unlabelled cells share a batch; there (development suite's protocol tasks,
        3 seeds) fixed 0.5 instead: worm novel 0.775 -> 0.669, pbmc68k 0.670 -> 0.648, MCA
        0.819 -> 0.841; mean novel 0.907 -> 0.894, all 0.912 -> 0.903.
    resolution_grid, fallback_resolution, calibration_cells
        The resolutions tried by ``"auto"``; the one used when it cannot be calibrated (fewer
        than two labelled classes, or no labelled cell shares a batch with unlabelled ones); at
        most this many labelled cells are clustered to calibrate.
    min_cluster_cells, min_cluster_fraction
        Smallest candidate: ``max(min_cluster_cells, min_cluster_fraction * n_unlabelled)``
        cells; smaller groups are not reported as novel types.
    n_neighbors
        Neighbours of the kNN graphs (Leiden, labelled neighbourhoods, cluster cores).
    n_pcs
        Principal components of the aligned expression used for every graph here.
    max_cells
        At most this many cells (a random subset) are clustered.

    Labels as evidence (batches where labelled and unlabelled cells share a batch)
    --------------------------------------------------------------------------------
    support_fraction, support_min
        An unlabelled cell with at least ``support_fraction`` of the labelled fraction expected
        around a known-type cell, and at least ``support_min`` labelled neighbours, is supported
        by labels and never a candidate (development suite's protocol tasks, 3 seeds, without
        it: mean seen 0.894 -> 0.846, pbmc68k 0.777 -> 0.582, 20% labelled 0.998 -> 0.910;
        known-type cells called novel 9.1% -> 14.8%).
    desert_alpha
        One-sided binomial level under which a cell has too few labelled neighbours for a known
        type: a label desert, a candidate however well a seen head scores it (development
        suite's protocol tasks, 3 seeds, without it: all-class MCA 0.829 -> 0.701, worm 0.848
        -> 0.782, pbmc68k 0.681 -> 0.659; novel subtypes nested in seen types, novel-type cells
        called novel 92.7% -> 56.0%; seen accuracy rises, pbmc68k 0.776 -> 0.819).
    segregated_support
        A batch whose unlabelled cells are supported less often than this was not labelled at
        random (a reference and a query concatenated without ``batch_key``): no deserts there,
        and a warning. No development-suite task is labelled that way, so it changes none; it
        guards that misuse (tested).

    Batches without labelled cells (a separate query)
    -------------------------------------------------
    query_resolution, query_min_fraction, query_min_enrichment
        The whole query batch is clustered at ``query_resolution``; a cluster is a candidate
        when at least ``query_min_fraction`` of its cells, or ``query_min_enrichment`` times the
        batch's share, are out-of-distribution. Development suite's separate-query tasks, 3
        seeds, with the query's out-of-distribution cells clustered like any other instead: TM
        kidney -> marrow novel 0.774 -> 0.627, PBMC Drop-seq -> inDrops all 0.965 -> 0.892,
        inDrops -> Drop-seq seen 0.897 -> 0.821; mean over the 22 tasks all 0.911 -> 0.898,
        error of the number of novel clusters 1.06 -> 1.47; TM marrow -> kidney and the 1,000 +
        1,000-cell simulation gain (novel 0.742 -> 0.948, 0.765 -> 0.874).

    Anchors and merging
    -------------------
    core_min_agree, core_min_fraction
        A candidate cell is at its cluster's core when at least ``core_min_agree`` of its
        neighbours are in the cluster; a cluster with less than ``core_min_fraction`` core cells
        is incoherent and not anchored. Whole development suite, 3 seeds, with almost no anchor
        (``core_min_agree = core_min_fraction = 1``: only clusters whose every cell has all its
        neighbours inside): mean novel 0.889 -> 0.804, all 0.911 -> 0.865
        (MCA novel 0.819 -> 0.755, TM kidney -> marrow 0.774 -> 0.651, 10 novel types 0.950 ->
        0.581); Baron mouse 2 -> 1 alone gains (novel 0.746 -> 0.950).
    merge_threshold
        A novel cluster found in a batch without labelled cells of a known type is reported as
        that type when their within-batch marker signatures correlate at least this much
        (closed-world baron mouse 2 -> 1: 6.4% -> 0.9% of known cells called novel; whole
        development suite, 3 seeds, without it: mean seen 0.894 -> 0.862, baron 1 -> 2 0.939 ->
        0.716, 200-cell reference 0.826 -> 0.312, novel accuracy unchanged). ``None`` keeps
        every novel cluster.
    no_warmup_rel_threshold
        Without a warm-up (``warmup_epochs=0``) the number of novel types is the number of
        Leiden clusters of all cells whose labelled fraction is below this times the overall one.
    """

    ood_quantile: float = 0.01
    ood_max_rate: float = 0.1
    calibration_fraction: float = 0.0
    calibration_max_cells: int = 2000
    calibration_probe: bool = False
    self_check: bool = False
    self_check_types: float = 0.25
    self_check_known: float = 0.2
    resolution: float | str = "auto"
    resolution_grid: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0)
    fallback_resolution: float = 0.5
    calibration_cells: int = 10_000
    min_cluster_cells: int = 5
    min_cluster_fraction: float = 0.005
    n_neighbors: int = 15
    n_pcs: int = 30
    max_cells: int = 50_000
    support_fraction: float = 0.5
    support_min: int = 2
    desert_alpha: float = 0.01
    segregated_support: float = 0.1
    query_resolution: float = 1.0
    query_min_fraction: float = 0.5
    query_min_enrichment: float = 2.5
    core_min_agree: float = 0.5
    core_min_fraction: float = 2 / 3
    merge_threshold: float | None = 0.7
    no_warmup_rel_threshold: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "resolution_grid", tuple(self.resolution_grid))
        res = self.resolution
        if not (res == "auto" or (_is_finite(res) and res > 0)):
            _invalid("resolution", res, 'a positive number or "auto"')
        if not self.resolution_grid or not all(
            _is_finite(r) and r > 0 for r in self.resolution_grid
        ):
            _invalid("resolution_grid", self.resolution_grid, "positive numbers")
        for name in ("fallback_resolution", "query_resolution", "query_min_enrichment"):
            if not (_is_finite(getattr(self, name)) and getattr(self, name) > 0):
                _invalid(name, getattr(self, name), "a finite positive number")
        for name in (
            "ood_quantile",
            "ood_max_rate",
            "calibration_fraction",
            "min_cluster_fraction",
            "support_fraction",
            "desert_alpha",
            "segregated_support",
            "query_min_fraction",
            "core_min_agree",
            "core_min_fraction",
            "no_warmup_rel_threshold",
            "self_check_types",
            "self_check_known",
        ):
            if not (_is_number(getattr(self, name)) and 0 <= getattr(self, name) <= 1):
                _invalid(name, getattr(self, name), "a number in [0, 1]")
        for name in (
            "calibration_cells",
            "calibration_max_cells",
            "min_cluster_cells",
            "max_cells",
        ):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                _invalid(name, getattr(self, name), "a positive integer")
        for name in ("n_neighbors", "n_pcs"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 2:
                _invalid(name, getattr(self, name), "an integer >= 2")
        if not _is_int(self.support_min) or self.support_min < 0:
            _invalid("support_min", self.support_min, "a non-negative integer")
        if not isinstance(self.calibration_probe, bool):
            _invalid("calibration_probe", self.calibration_probe, "True or False")
        if not isinstance(self.self_check, bool):
            _invalid("self_check", self.self_check, "True or False")
        thr = self.merge_threshold
        if thr is not None and not (_is_number(thr) and 0 < thr <= 1):
            _invalid("merge_threshold", thr, "a number in (0, 1] or None")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DiscoveryConfig:
        """Inverse of ``to_dict``; unknown keys raise. Options of rules since removed (see
        :data:`RETIRED_DISCOVERY_KEYS`) are dropped: a model file written before still loads.
        """
        d = {k: v for k, v in d.items() if k not in RETIRED_DISCOVERY_KEYS}
        _check_keys(cls, d)
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able representation (tuples become lists)."""
        return _to_dict(self)


#: names of the :class:`DiscoveryConfig` fields (accepted as keywords by ``annotate``)
DISCOVERY_FIELDS = frozenset(f.name for f in dataclasses.fields(DiscoveryConfig))


@dataclass(frozen=True)
class OrcaConfig:
    """Every option of an ORCA run.

    Data preparation
    ----------------
    n_genes
        Number of highly variable genes (computed on reference and query together, batch-aware);
        ``None`` keeps every shared gene.
    layer
        Read expression from ``adata.layers[layer]`` instead of ``.X``.
    batch_key
        ``obs`` column with batches; used for batch-aware gene selection and alignment. Without it the
        reference and the query are the two batches (or there is a single batch).
    unlabeled_category
        Label values that mark a cell as unlabeled (besides NaN).
    min_shared_genes
        Fewer genes shared between reference and query raise an error.
    target_sum
        Counts are normalised to this total per cell, then ``log1p``.
    alignment
        How query batches are brought onto the reference before training: ``"centroid"`` (default)
        shifts every non-reference batch by the mean offset between its cells and the reference
        class centroids they mutually match, which ignores cells of novel types and so is robust to
        composition differences; ``"standardize"`` z-scores each gene within each batch;
        ``"none"`` leaves the data as is.

    Model
    -----
    hidden_dims
        Sizes of the two fully connected layers of the backbone; the second is the embedding.
    dropout
        Dropout probability after each layer (the second forward pass of the pairwise loss sees a
        different dropout mask).
    n_novel
        Number of novel heads: an int, or ``"auto"`` to estimate the number of novel types from the
        data: the number of candidate novel clusters found after the warm-up.
    discovery
        A :class:`DiscoveryConfig`: every rule that decides candidate novel clusters, the number
        of novel types and the merging of clusters back into known types (the ``discover`` stage,
        :mod:`orca_sc._discover`). Its fields may also be given to ``annotate`` as keywords.

    Training (paper Eq. 1–6)
    ------------------------
    epochs, batch_size, lr, weight_decay
        Adam with ``lr`` (at most 1) and ``weight_decay``; an epoch is one pass over all cells.
    min_steps
        Small data trains for at least this many optimiser steps (epochs are added), so that a
        500-cell query gets as much training as a large atlas.
    warmup_epochs
        Epochs of supervised-only training (labelled cells) before the full objective; anchors the
        query's known types to their heads before the pairwise term starts forming clusters.
        Must be smaller than ``epochs``; ``annotate(epochs=N)`` with ``N`` at most the warm-up
        and no ``warmup_epochs`` given shortens the warm-up to ``N - 1`` epochs.
    anchor_epochs, anchor_weight
        For ``anchor_epochs`` epochs of the full objective right after the novel heads are added,
        the core cells of every coherent candidate novel cluster (see
    :func:`orca_sc._discover.cluster_cores`) are pulled towards their cluster's head by a
        cross-entropy term of weight ``anchor_weight``. The warmed-up embedding (fitted to the
        seen classes only) maps different novel types close together, so head prototypes alone
        cannot tell them apart: without the anchor, seen heads near a novel type absorb it in the
        first epochs and never let go (measured on 20k simulated cells: novel accuracy 0.69
        without, 1.00 with). Afterwards the ORCA objective refines the clusters freely.
        ``anchor_epochs=0`` switches it off.
    eta1, eta2, lam
        Weights of the pairwise term, the entropy regulariser and the uncertainty margin.
    margin
        ``"adaptive"``: margin = ``min(lam * u, max_margin)`` with ``u`` the mean ``1 - max softmax``
        over unlabelled cells, re-estimated in eval mode before every epoch; ``"fixed"``: the
        constant ``fixed_margin`` (ORCA-FNM); ``"zero"``: plain cross-entropy (ORCA-ZM).
    supervised, regularizer
        Switch the supervised term and the entropy regulariser off for ablations.
    prior
        Target of the regulariser (paper Eq. 5, ``KL(mean prediction || prior)``): ``"uniform"``
        is the paper's maximum-entropy choice; ``"data"`` (default) gives each seen head its
        labelled-class frequency and each novel head the size of its candidate cluster, so that
        a large query type is not split to fill the head of a rare known type. Used when novel
        heads are initialised after a warm-up; otherwise uniform.
    pair_space, pair_pcs
        Where an unlabelled cell's pairwise partner (paper Eq. 4: its most similar cell in the
        mini-batch) is looked for: ``"both"`` (default), the cell with the highest mean of the
        cosine similarities in the first ``pair_pcs`` principal components of the aligned
        expression (fixed for the whole run) and in the net's current embedding; ``"pca"``, the
        PCA alone; ``"embedding"``, the net's embedding alone, as in the paper. The paper's image
        models start from a self-supervised backbone whose features already group novel classes;
        an MLP trained on the seen classes maps cells of different novel types close together,
        so its neighbours alone pair them up (simulated 10 types, 5 novel, 5,000 cells, seeds
        0/1: novel accuracy 0.92/0.87 with ``"embedding"``, 1.00/1.00 with ``"pca"``, 0.99/1.00
        with ``"both"``). The PCA alone fails the other way: fitted to all cells, it resolves
        small types poorly, and PCA neighbours pair cells of different small types (simulated
        50 types, 25 novel, 30,000 cells, seeds 0/1, ``mutual_pairs=0``: seen accuracy
        0.80/0.83 with ``"pca"``, 0.88/0.90 with ``"both"``; see the changelog for the real
        tasks).
    mutual_pairs
        An unlabelled cell's nearest neighbour in the mini-batch is its partner only when the
        cell is also among the neighbour's ``mutual_pairs`` nearest cells of the batch;
        otherwise the cell is paired with itself (its two dropout views must agree). ``0``
        pairs every cell with its nearest neighbour, as in the paper. A type with a few hundred
        cells in an atlas has one or two cells in a batch of 512, rarely each other's nearest
        neighbours, so the paper's rule pairs them with cells of other types and the pairwise
        term erases what the supervised term taught about small seen types (simulated 50 types,
        25 novel, 30,000 cells, seeds 0/1: seen accuracy 0.88/0.90 with ``0``, 0.93/0.94 with
        ``3``; seen types under 300 cells 0.03 vs 0.38 at seed 0). A cell among many of its own
        type has closer cells of its own than a stranger does, so its pairs are kept.
    device
        ``"auto"`` (CUDA, then MPS, then CPU), ``"cpu"``, ``"cuda"``, ``"mps"``.
    seed
        Seeds every random choice; same seed and device give identical labels.
    progress
        Show a progress bar on stderr.
    """

    # data preparation
    n_genes: int | None = 2000
    layer: str | None = None
    batch_key: str | None = None
    unlabeled_category: tuple[str, ...] = ("Unknown",)
    min_shared_genes: int = 100
    target_sum: float = 1e4
    alignment: AlignMode = "centroid"
    # model
    hidden_dims: tuple[int, int] = (512, 128)
    dropout: float = 0.1
    n_novel: int | str = "auto"
    discovery: DiscoveryConfig = field(default_factory=lambda: DiscoveryConfig())
    # training
    epochs: int = 20
    batch_size: int = 512
    min_steps: int = 300
    warmup_epochs: int = 5
    anchor_epochs: int = 1
    anchor_weight: float = 0.3
    lr: float = 1e-3
    weight_decay: float = 0.0
    eta1: float = 1.0
    eta2: float = 1.0
    lam: float = 1.0
    margin: MarginMode = "adaptive"
    fixed_margin: float = 0.5
    max_margin: float = 0.5
    supervised: bool = True
    regularizer: bool = True
    prior: PriorMode = "data"
    pair_space: PairSpace = "both"
    pair_pcs: int = 30
    mutual_pairs: int = 3
    device: str = "auto"
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.unlabeled_category, str):
            object.__setattr__(self, "unlabeled_category", (self.unlabeled_category,))
        else:
            object.__setattr__(self, "unlabeled_category", tuple(self.unlabeled_category))
        object.__setattr__(self, "hidden_dims", tuple(int(h) for h in self.hidden_dims))
        if self.n_genes is not None and (not _is_int(self.n_genes) or self.n_genes < 2):
            _invalid("n_genes", self.n_genes, "an integer >= 2 or None (all shared genes)")
        if not (
            (_is_int(self.n_novel) and self.n_novel >= 0)
            or (isinstance(self.n_novel, str) and self.n_novel == "auto")
        ):
            _invalid("n_novel", self.n_novel, 'a non-negative integer or "auto"')
        if len(self.hidden_dims) != 2 or min(self.hidden_dims) < 1:
            _invalid("hidden_dims", self.hidden_dims, "two positive layer sizes")
        if not (_is_number(self.dropout) and 0.0 <= self.dropout < 1.0):
            _invalid("dropout", self.dropout, "a probability in [0, 1)")
        for name in ("epochs", "batch_size", "min_shared_genes"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                _invalid(name, getattr(self, name), "a positive integer")
        for name in ("min_steps", "warmup_epochs", "anchor_epochs"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                _invalid(name, getattr(self, name), "a non-negative integer")
        if self.warmup_epochs >= self.epochs:
            _invalid(
                "warmup_epochs",
                self.warmup_epochs,
                f"smaller than epochs={self.epochs} (the open-world phase follows the warm-up)",
            )
        if self.batch_size < 2:
            _invalid("batch_size", self.batch_size, "at least 2 (BatchNorm needs two cells)")
        # Adam steps larger than 1 on unit-scale features only diverge (--lr 1e30 used to fail as
        # "loss became nan" after the whole warm-up)
        if not (_is_finite(self.lr) and 0 < self.lr <= 1):
            _invalid("lr", self.lr, "a number in (0, 1] (Adam's learning rate; default 1e-3)")
        if not (_is_finite(self.target_sum) and self.target_sum > 0):
            _invalid("target_sum", self.target_sum, "a finite positive number")
        for name in (
            "weight_decay",
            "eta1",
            "eta2",
            "lam",
            "fixed_margin",
            "max_margin",
            "anchor_weight",
        ):
            if not (_is_finite(getattr(self, name)) and getattr(self, name) >= 0):
                _invalid(name, getattr(self, name), "a finite non-negative number")
        if self.margin not in ("adaptive", "fixed", "zero"):
            _invalid("margin", self.margin, '"adaptive", "fixed" or "zero"')
        if self.prior not in ("data", "uniform"):
            _invalid("prior", self.prior, '"data" or "uniform"')
        if self.alignment not in ("centroid", "standardize", "none"):
            _invalid("alignment", self.alignment, '"centroid", "standardize" or "none"')
        if not (
            isinstance(self.device, str)
            and re.fullmatch(r"auto|cpu|mps|cuda(:[0-9]+)?", self.device) is not None
        ):
            _invalid("device", self.device, '"auto", "cpu", "cuda", "cuda:N" or "mps"')
        if self.pair_space not in ("both", "pca", "embedding"):
            _invalid("pair_space", self.pair_space, '"both", "pca" or "embedding"')
        if not _is_int(self.pair_pcs) or self.pair_pcs < 2:
            _invalid("pair_pcs", self.pair_pcs, "an integer >= 2")
        if not _is_int(self.mutual_pairs) or self.mutual_pairs < 0:
            _invalid(
                "mutual_pairs", self.mutual_pairs, "a non-negative integer (0: the paper's rule)"
            )
        if isinstance(self.discovery, dict):
            object.__setattr__(self, "discovery", DiscoveryConfig.from_dict(self.discovery))
        if not isinstance(self.discovery, DiscoveryConfig):
            _invalid("discovery", self.discovery, "a DiscoveryConfig")
        if not (_is_int(self.seed) and 0 <= self.seed < 2**32):
            _invalid("seed", self.seed, "an integer from 0 to 2**32 - 1")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able representation (tuples become lists, ``discovery`` a nested dict)."""
        return _to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OrcaConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise. Files written before 0.2 kept three
        discovery options at the top level (``resolution``, ``hidden_novel``,
        ``merge_threshold``); they are read into ``discovery`` (``hidden_novel``, since removed,
        is dropped there).
        """
        d = dict(d)
        legacy = {k: d.pop(k) for k in _LEGACY_DISCOVERY_KEYS if k in d}
        if legacy:
            d["discovery"] = {**d.get("discovery", {}), **legacy}
        _check_keys(cls, d)
        return cls(**d)

    def replace(self, **changes: Any) -> OrcaConfig:
        """A copy with some fields changed (validated again). Fields of :class:`DiscoveryConfig`
        are accepted too and change ``discovery``.
        """
        disc = {k: changes.pop(k) for k in list(changes) if k in DISCOVERY_FIELDS}
        if disc:
            base = changes.pop("discovery", self.discovery)
            if isinstance(base, dict):
                base = DiscoveryConfig.from_dict(base)
            changes["discovery"] = dataclasses.replace(base, **disc)
        return dataclasses.replace(self, **changes)


def _to_dict(cfg: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = _to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


def _check_keys(cls: type, d: dict[str, Any]) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        msg = f"Unknown configuration keys {sorted(unknown)}; known keys are {sorted(names)}."
        raise ValueError(msg)


_LEGACY_DISCOVERY_KEYS = ("resolution", "hidden_novel", "merge_threshold")

#: options of discovery rules that were removed (the rule did not pay on the development suite):
#: ``hidden_novel`` (sub-clusters of a seen class without their share of labelled cells) changed
#: only pbmc68k (3 seeds: seen 0.776 -> 0.788 without it, all 0.681 -> 0.676) and nothing on
#: the novel subtypes nested in seen types, which label deserts find first
RETIRED_DISCOVERY_KEYS = frozenset({"hidden_novel", "hidden_alpha", "hidden_max_rel_fraction"})


def _invalid(name: str, value: Any, expected: str) -> None:
    raise ConfigError(name, value, expected)


def _is_number(x: Any) -> bool:
    import numbers

    return isinstance(x, numbers.Real) and not isinstance(x, bool) and x == x


def _is_finite(x: Any) -> bool:
    import math

    return _is_number(x) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    import numbers

    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
