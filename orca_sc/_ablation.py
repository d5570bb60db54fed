"""The laboratory's settings, apart from the user's options: the paper's ablations, the training
schedule's internals and the constants of discovery's rules.

A user sets :class:`~orca_sc.OrcaConfig` and :class:`~orca_sc.DiscoveryConfig`. What the method
fixes is here: :class:`Ablation` holds the values the benchmark and the tests vary (the paper's
margin, loss terms and regulariser prior; where pair partners are found; the schedule's floor and
stopping checks; any constant of a discovery rule, by name), and :class:`DiscoveryRules` is what
every discovery rule reads, the user's :class:`~orca_sc.DiscoveryConfig` with the rules'
constants beside it. ``orca_sc.benchmark.Ablation`` is this class; ``tl.annotate`` takes one as
``ablation=`` (users leave it out). Neither is saved with a model: a model predicts with the
user's options alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from ._config import (
    DiscoveryConfig,
    _invalid,
    _is_finite,
    _is_int,
    _is_number,
    _to_dict,
)

MarginMode = Literal["adaptive", "fixed", "zero"]
PriorMode = Literal["data", "uniform"]
PairSpace = Literal["both", "query_pca", "pca", "embedding"]

#: upper bound of the adaptive margin (cosine units)
MAX_MARGIN = 0.5
#: the default number of epochs: the schedule's floor of optimiser steps is set per epoch of it
DEFAULT_EPOCHS = 20


#: the parts of discovery's rules an ablation can switch off (``DiscoveryRules.drop``), and what
#: each does without them; the others are switched off by a constant (``anchor_epochs=0``,
#: ``anchor_supported=False``, ``min_novel_cells=1``) or a user's option (``pca_input="log"``,
#: ``merge_threshold=None``, ``cross_fit_threshold="none"``)
DROPPABLE = {
    "label_support": "no unlabelled cell is supported by, or a desert of, labelled neighbours",
    "resolution": "candidate clusters at fallback_resolution, not calibrated on the labels",
    "query_shift": "a query batch's thresholds and p-values not moved by its shift of a type",
    "share_vote": "a query cluster is a candidate by the contrast vote alone",
    "share_test": "the share vote takes a cluster without testing its p-values",
    "contrast_vote": "a query cluster is a candidate by the share vote alone",
    "significant_anchors": "a query candidate's cells anchored only where they are core",
}


@dataclass(frozen=True)
class DiscoveryRules(DiscoveryConfig):
    """What discovery's rules read: the user's :class:`~orca_sc.DiscoveryConfig` and the rules'
    own constants, each measured on the development suite (``docs/discovery.md``).

    Attributes
    ----------
    ood_quantile
        An unlabelled cell is out-of-distribution below this quantile of the labelled cells' best seen-head cosine (with ``cross_fit_threshold="none"``).
    ood_max_rate
        With calibration: the share of unseen known-type cells that may be called out-of-distribution.
    calibration_max_cells
        At most this many labelled cells are held out for calibration.
    self_check_types, self_check_known
        Share of the known types the self-check hides, and of every other type's labelled cells it holds out.
    resolution_grid, fallback_resolution
        The resolutions ``resolution="auto"`` tries, and the one used where it cannot be calibrated.
    calibration_cells
        At most this many labelled cells are clustered to calibrate the resolution.
    n_pcs
        Principal components of the aligned expression behind discovery's graphs.
    max_cells
        At most this many cells (a random subset) are clustered.
    support_fraction, support_min
        An unlabelled cell with this share of the expected labelled neighbours, and at least this many, is of a known type.
    desert_alpha
        Binomial level below which a cell has too few labelled neighbours for a known type (a label desert; where labels are sparse the test reads as many neighbours as it needs).
    segregated_support
        A batch whose unlabelled cells are supported less often than this was not labelled at random.
    query_resolution, query_resolution_grid
        Leiden resolution of a batch without labelled cells (a separate query); ``"reference"``:
        per batch, the finest of the grid at which a sample of the labelled cells of the
        batch's size keeps every labelled type whole (:func:`orca_sc._discover.graph.
        reference_resolution`; a study of "ORCA core 5", not the default).
    query_vote_cells
        At most this many cells of a batch without labelled cells are clustered and vote (``None``: every cell).
    query_min_fraction, query_min_enrichment
        A query cluster is a candidate when this share of its cells is out-of-distribution, or this many times the batch's share.
    absence_vote
        A query cluster is also a candidate when the labelled cells of the known type that claims
        it lack the state that sets it apart from the type's other cells in the batch
        (:func:`orca_sc._discover.query.absence_pvalue`; a study of "ORCA core 5", not the default).
    core_min_agree, core_min_fraction
        A candidate cell is at its cluster's core when this share of its neighbours is in the cluster; a cluster with a smaller share of core cells is not anchored.
    anchor_supported
        Anchor each unlabelled cell the labels around it support to the seen head that claims it.
    min_novel_cells
        A novel head that wins fewer unlabelled cells than this is no cluster (pruned).
    drop
        Parts of discovery's rules switched off, by name (:data:`DROPPABLE`): the rule-by-rule
        ablation (``--set drop=share_vote``; several: ``--set "drop=('share_vote', 'share_test')"``).
    no_warmup_rel_threshold
        Without a warm-up: clusters with a labelled share below this times the overall one count as novel.

    """

    ood_quantile: float = 0.01
    ood_max_rate: float = 0.1
    calibration_max_cells: int = 2000
    self_check_types: float = 0.25
    self_check_known: float = 0.2
    resolution_grid: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0)
    fallback_resolution: float = 0.5
    calibration_cells: int = 10_000
    n_pcs: int = 30
    max_cells: int = 50_000
    support_fraction: float = 0.5
    support_min: int = 2
    desert_alpha: float = 0.01
    segregated_support: float = 0.1
    query_resolution: float | str = 1.0
    query_resolution_grid: tuple[float, ...] = (0.5, 1.0, 2.0, 3.0)
    query_vote_cells: int | None = None
    query_min_fraction: float = 0.5
    query_min_enrichment: float = 2.5
    absence_vote: bool = False
    core_min_agree: float = 0.5
    core_min_fraction: float = 2 / 3
    anchor_supported: bool = True
    min_novel_cells: int = 5
    no_warmup_rel_threshold: float = 0.1
    drop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        drop = (self.drop,) if isinstance(self.drop, str) else self.drop
        object.__setattr__(self, "drop", tuple(drop))
        unknown = sorted(set(self.drop) - set(DROPPABLE))
        if unknown:
            _invalid("drop", self.drop, f"names of rule parts, of {sorted(DROPPABLE)}")
        object.__setattr__(self, "resolution_grid", tuple(self.resolution_grid))
        if not self.resolution_grid or not all(
            _is_finite(r) and r > 0 for r in self.resolution_grid
        ):
            _invalid("resolution_grid", self.resolution_grid, "positive numbers")
        object.__setattr__(self, "query_resolution_grid", tuple(self.query_resolution_grid))
        if not self.query_resolution_grid or not all(
            _is_finite(r) and r > 0 for r in self.query_resolution_grid
        ):
            _invalid("query_resolution_grid", self.query_resolution_grid, "positive numbers")
        qr = self.query_resolution
        if qr != "reference" and not (_is_finite(qr) and qr > 0):
            _invalid("query_resolution", qr, 'a finite positive number or "reference"')
        for name in ("fallback_resolution", "query_min_enrichment"):
            if not (_is_finite(getattr(self, name)) and getattr(self, name) > 0):
                _invalid(name, getattr(self, name), "a finite positive number")
        for name in ("ood_quantile", "ood_max_rate", "support_fraction", "desert_alpha",
                     "segregated_support", "query_min_fraction", "core_min_agree",
                     "core_min_fraction", "no_warmup_rel_threshold", "self_check_types",
                     "self_check_known"):  # fmt: skip
            if not (_is_number(getattr(self, name)) and 0 <= getattr(self, name) <= 1):
                _invalid(name, getattr(self, name), "a number in [0, 1]")
        for name in ("calibration_cells", "calibration_max_cells", "max_cells", "min_novel_cells"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                _invalid(name, getattr(self, name), "a positive integer")
        if not _is_int(self.n_pcs) or self.n_pcs < 2:
            _invalid("n_pcs", self.n_pcs, "an integer >= 2")
        if not _is_int(self.support_min) or self.support_min < 0:
            _invalid("support_min", self.support_min, "a non-negative integer")
        for name in ("anchor_supported", "absence_vote"):
            if not isinstance(getattr(self, name), bool):
                _invalid(name, getattr(self, name), "True or False")
        qvc = self.query_vote_cells
        if qvc is not None and (not _is_int(qvc) or qvc < 2 * self.n_neighbors):
            _invalid("query_vote_cells", qvc,
                     f"None or an integer >= {2 * self.n_neighbors} (twice n_neighbors)")  # fmt: skip

    @classmethod
    def of(cls, config: DiscoveryConfig, ablation: Ablation | None = None) -> DiscoveryRules:
        """The rules of a run: the user's ``config`` and ``ablation``'s rule constants."""
        user = {f.name: getattr(config, f.name) for f in dataclasses.fields(DiscoveryConfig)}
        return cls(**user, **(dict(ablation.rules) if ablation is not None else {}))


#: where the warm-ups' cluster term cuts its clusters (``Ablation.warmup_clusters_space``)
CLUSTER_SPACES = ("batch", "joint", "harmony", "mnn")

#: the rules' constants (the fields of :class:`DiscoveryRules` that are not a user's option)
RULE_FIELDS = frozenset(f.name for f in dataclasses.fields(DiscoveryRules)) - frozenset(
    f.name for f in dataclasses.fields(DiscoveryConfig)
)


@dataclass(frozen=True)
class Ablation:
    """What the benchmark varies beside a user's options: the paper's ablations (ORCA-ZM,
    ORCA-FNM, no supervised term, no regulariser, a uniform prior, pairs in the embedding), the
    training schedule's internals, and any discovery rule's constant (``rules``, by the name of
    its :class:`DiscoveryRules` field). The defaults are ORCA as ``tl.annotate`` runs it.

    Attributes
    ----------
    margin
        ``"adaptive"`` (ORCA: ``lam`` times the unlabelled cells' mean uncertainty, at most 0.5), ``"fixed"`` (ORCA-FNM, ``fixed_margin``) or ``"zero"`` (ORCA-ZM).
    fixed_margin
        The margin of ``margin="fixed"``.
    lam, eta1, eta2
        The margin's factor and the weights of the pairwise and entropy terms (paper Eq. 1, 4).
    supervised, regularizer
        Keep the supervised term, the entropy regulariser.
    prior
        Target of the regulariser: ``"data"`` (estimated class sizes) or ``"uniform"`` (the paper).
    pair_space
        Where unlabelled cells' pair partners are found: ``"query_pca"`` (``"pca"`` for the cells of batches without labelled cells, ``"both"`` elsewhere), ``"both"``, ``"pca"`` or ``"embedding"`` (the paper).
    pair_pcs
        Principal components of that PCA.
    mutual_pairs
        A nearest neighbour is a partner only if the cell is among its this many nearest (0: the paper's rule).
    anchor_epochs, anchor_weight
        Epochs after the warm-up in which candidate clusters' core cells are pulled to their heads, and the weight of that cross-entropy.
    epoch_min_steps
        On small data an epoch has at least this many optimiser steps (the schedule cycles through the cells): a run of ``epochs`` epochs has at least ``epoch_min_steps * epochs`` steps.
    stop_tolerance, stop_check_steps, stop_min_steps
        The stopping rule (:class:`orca_sc._train.StopRule`): its tolerance of cells changing head (``0``: every epoch, the paper's schedule), the steps between two checks and before the first.
    min_shared_genes
        Fewer genes shared by reference and query is an error.
    type_alignment
        ``"none"`` (ORCA), or with ``alignment="centroid"`` a shift per known type onto its
        centroid, estimated on the query cells matched to it with confidence
        (:func:`orca_sc._align.type_groups`): ``"matched"`` moves those cells alone,
        ``"nearest"`` every cell whose nearest centroid is the type's, ``"cluster"`` every cell
        of a query cluster most of whose cells match the type (a study of "ORCA core 5", not
        the default).
    pretrain
        ``"none"`` (ORCA), or ``"scarf"``: the backbone pretrained on every cell, labelled or
        not, to tell each cell's two corrupted views from other cells' (NT-Xent on SCARF views,
        as the paper pretrains its image backbones with SimCLR; :mod:`orca_sc._pretrain`), the
        warm-ups starting from it (a study of "ORCA core 5", not the default); ``"mask"``: the
        same with views whose replaced genes are set to zero (undetected, as in a shallower
        library).
    pretrain_steps, pretrain_corruption
        The pretraining's optimiser steps and the share of each view's genes replaced.
    pretrain_cells
        The cells the pretraining reads: ``"all"`` (the paper's), or ``"labelled"`` (the
        paper's appendix: the labelled cells alone).
    pretrain_pairs
        ``"cell"``: the two views are of one cell; ``"mnn"``: a cell with mutual nearest
        neighbours in another batch (labelled batches against each batch without labels) takes
        one of them as its second view, so that a pair shares a type across the batches;
        ``"vouched"``: only those pairs whose query cell a warm-up from random weights scores as
        the labelled cell's type, above that head's 5% quantile of its own labelled cells.
    pretrain_freeze
        Keep the pretrained first layer fixed in the warm-ups and the open-world fit (the
        paper's protocol).
    warmup_recon
        Weight of a reconstruction term in the warm-ups (``0``: none, ORCA): a decoder given
        each cell's embedding and its batch rebuilds the cell's input, for every cell of the
        mini-batch, labelled or not, so that the embedding keeps what tells cells of a batch
        apart beyond the known types, while the batch itself is the decoder's to explain (a
        study of "ORCA core 5", not the default; the warm-ups' mini-batches then hold the
        unlabelled cells it reads too).
    warmup_recon_cells
        The cells the reconstruction reads: ``"labelled_batches"``, every cell of the batches
        that hold labelled cells (not a separate query's, whose own differences the embedding
        would then keep), or ``"all"``.
    warmup_clusters
        Weight of a cluster term in the warm-ups (``0``: none, ORCA): a second cosine head on
        the embedding learns each cell's Leiden cluster (resolution ``query_resolution``, on
        ``n_pcs`` components), so that the embedding keeps what tells the query's own clusters
        apart, which the labelled types alone do not ask of it (a study of "ORCA core 5",
        not the default; the head is dropped after each warm-up, and its mini-batches hold the
        cells with a cluster too; the self-check's warm-up, which hides types, runs without it).
    warmup_clusters_space
        Where those clusters are cut: ``"batch"``, the unlabelled cells of each batch in their
        own PCA (labelled cells have none); ``"joint"``, every cell in one PCA of all batches;
        ``"harmony"`` or ``"mnn"``, every cell in that integration of the joint PCA
        (:func:`orca_sc._integrate.integrated_space`), so that a known type's cells of every
        batch share clusters where the integration mixes them.
    query_mapping
        ``"none"`` (ORCA), or ``"frozen"``: each batch without labelled cells learns an offset of
        its own on the frozen nets of the labelled cells, which discovery then reads it through
        (:mod:`orca_sc._mapping`; a study of "ORCA core 5", not the default).
    rules
        Constants of discovery's rules, by field name of :class:`DiscoveryRules`.

    """

    margin: MarginMode = "adaptive"
    fixed_margin: float = 0.5
    lam: float = 1.0
    eta1: float = 1.0
    eta2: float = 1.0
    supervised: bool = True
    regularizer: bool = True
    prior: PriorMode = "data"
    pair_space: PairSpace = "query_pca"
    pair_pcs: int = 30
    mutual_pairs: int = 3
    anchor_epochs: int = 1
    anchor_weight: float = 0.3
    epoch_min_steps: int = 15
    stop_tolerance: float = 0.01
    stop_check_steps: int = 25
    stop_min_steps: int = 100
    min_shared_genes: int = 100
    type_alignment: str = "none"
    query_mapping: str = "none"
    pretrain: str = "none"
    pretrain_steps: int = 300
    pretrain_corruption: float = 0.6
    pretrain_cells: str = "all"
    pretrain_pairs: str = "cell"
    pretrain_freeze: bool = True
    warmup_recon: float = 0.0
    warmup_recon_cells: str = "labelled_batches"
    warmup_clusters: float = 0.0
    warmup_clusters_space: str = "batch"
    rules: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", dict(self.rules))
        unknown = sorted(set(self.rules) - RULE_FIELDS)
        if unknown:
            msg = f"Unknown discovery rule constants {unknown}; known: {sorted(RULE_FIELDS)}."
            raise ValueError(msg)
        DiscoveryRules(**self.rules)  # validated as the rules will read them
        if self.margin not in ("adaptive", "fixed", "zero"):
            _invalid("margin", self.margin, '"adaptive", "fixed" or "zero"')
        if self.prior not in ("data", "uniform"):
            _invalid("prior", self.prior, '"data" or "uniform"')
        if self.type_alignment not in ("none", "matched", "nearest", "cluster"):
            _invalid("type_alignment", self.type_alignment,
                     '"none", "matched", "nearest" or "cluster"')  # fmt: skip
        if self.query_mapping not in ("none", "frozen"):
            _invalid("query_mapping", self.query_mapping, '"none" or "frozen"')
        if self.pretrain not in ("none", "scarf", "mask"):
            _invalid("pretrain", self.pretrain, '"none", "scarf" or "mask"')
        if not _is_int(self.pretrain_steps) or self.pretrain_steps < 1:
            _invalid("pretrain_steps", self.pretrain_steps, "a positive integer")
        if not (_is_number(self.pretrain_corruption) and 0 <= self.pretrain_corruption < 1):
            _invalid("pretrain_corruption", self.pretrain_corruption, "a share in [0, 1)")
        if self.pretrain_cells not in ("all", "labelled"):
            _invalid("pretrain_cells", self.pretrain_cells, '"all" or "labelled"')
        if self.pretrain_pairs not in ("cell", "mnn", "vouched"):
            _invalid("pretrain_pairs", self.pretrain_pairs, '"cell", "mnn" or "vouched"')
        if self.pretrain_pairs != "cell" and self.pretrain_cells != "all":
            _invalid("pretrain_pairs", self.pretrain_pairs,
                     '"cell" with pretrain_cells="labelled" (partners are of other batches)')  # fmt: skip
        if not isinstance(self.pretrain_freeze, bool):
            _invalid("pretrain_freeze", self.pretrain_freeze, "True or False")
        if self.warmup_recon_cells not in ("labelled_batches", "all"):
            _invalid("warmup_recon_cells", self.warmup_recon_cells, '"labelled_batches" or "all"')
        if self.warmup_clusters_space not in CLUSTER_SPACES:
            _invalid("warmup_clusters_space", self.warmup_clusters_space,
                     '"batch", "joint", "harmony" or "mnn"')  # fmt: skip
        if self.pair_space not in ("both", "query_pca", "pca", "embedding"):
            _invalid("pair_space", self.pair_space, '"both", "query_pca", "pca" or "embedding"')
        weights = ("fixed_margin", "lam", "eta1", "eta2", "anchor_weight", "warmup_recon",
                   "warmup_clusters")  # fmt: skip
        for name in weights:
            if not (_is_finite(getattr(self, name)) and getattr(self, name) >= 0):
                _invalid(name, getattr(self, name), "a finite non-negative number")
        if self.warmup_clusters and self.warmup_recon:
            _invalid("warmup_clusters", self.warmup_clusters,
                     "0 with warmup_recon (one extra warm-up term at a time)")  # fmt: skip
        for name in ("supervised", "regularizer"):
            if not isinstance(getattr(self, name), bool):
                _invalid(name, getattr(self, name), "True or False")
        for name in ("mutual_pairs", "anchor_epochs", "epoch_min_steps", "stop_min_steps"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                _invalid(name, getattr(self, name), "a non-negative integer")
        for name in ("stop_check_steps", "min_shared_genes"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                _invalid(name, getattr(self, name), "a positive integer")
        if not _is_int(self.pair_pcs) or self.pair_pcs < 2:
            _invalid("pair_pcs", self.pair_pcs, "an integer >= 2")
        if not (_is_number(self.stop_tolerance) and 0 <= self.stop_tolerance <= 1):
            _invalid("stop_tolerance", self.stop_tolerance, "a share in [0, 1] (0: every epoch)")

    @classmethod
    def of(cls, **settings: Any) -> Ablation:
        """An ablation from flat ``settings``: its own fields, and rule constants by name
        (ORCA's settings :meth:`replace`-d; an unknown name raises).
        """
        unknown = sorted(set(settings) - ABLATION_FIELDS)
        if unknown:
            msg = f"Unknown settings {unknown}; known: {sorted(ABLATION_FIELDS)}."
            raise ValueError(msg)
        return LAB.replace(**settings)

    def replace(self, **settings: Any) -> Ablation:
        """A copy with some settings changed (rule constants by name too)."""
        rules = {**self.rules, **{k: settings.pop(k) for k in list(settings) if k in RULE_FIELDS}}
        return dataclasses.replace(self, **settings, rules=rules)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able representation."""
        return _to_dict(self)

    def changes(self) -> dict[str, Any]:
        """The settings that differ from ORCA's (flat; empty for the defaults)."""
        base = Ablation()
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "rules" and getattr(self, f.name) != getattr(base, f.name)
        }
        return {**out, **self.rules}


#: every name :meth:`Ablation.of` takes
ABLATION_FIELDS = frozenset(f.name for f in dataclasses.fields(Ablation)) - {"rules"} | RULE_FIELDS

#: ORCA as ``tl.annotate`` runs it
LAB = Ablation()


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], Ablation | None]:
    """Flat ``options`` (as the benchmark's ``--set`` gives them) parted into a user's options
    and an :class:`Ablation` of the rest (``None`` when there is none); an ``ablation`` entry
    is the base the others change.
    """
    options = dict(options)
    base = options.pop("ablation", None)
    lab = {k: options.pop(k) for k in list(options) if k in ABLATION_FIELDS}
    if not lab:
        return options, base
    return options, (base or LAB).replace(**lab)
