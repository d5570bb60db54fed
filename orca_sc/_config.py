"""The one configuration object shared by the Python API, the CLI and saved models."""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from ._errors import ConfigError

logger = logging.getLogger(__name__)

MarginMode = Literal["adaptive", "fixed", "zero"]
AlignMode = Literal["centroid", "standardize", "none"]
PriorMode = Literal["data", "uniform"]
PairSpace = Literal["both", "query_pca", "pca", "embedding"]

#: Scale ``s`` of the L2-normalised head (paper Eq. 3). Defined here once; the head multiplies its
#: cosine similarities by it and the margin is expressed in cosine units.
HEAD_SCALE: float = 10.0


#: the smallest sample the warm-ups and discovery may run on (``discovery_cells``)
MIN_DISCOVERY_CELLS = 1000


@dataclass(frozen=True)
class DiscoveryConfig:
    """Every rule of the ``discover`` stage (:mod:`orca_sc._discover`): which unlabelled cells
    form candidate novel clusters after the warm-up, how many novel types there are, and which
    novel clusters are reported as known types. Saved with the model; the measurement behind
    each default is in ``docs/discovery.md``.

    Attributes
    ----------
    ood_quantile
        An unlabelled cell is out-of-distribution below this quantile of the labelled cells' best seen-head cosine.
    ood_max_rate
        With calibration: the share of unseen known-type cells that may be called out-of-distribution.
    calibration_fraction
        Share of each seen class's labelled cells held out of the warm-up to calibrate the threshold (0: none).
    calibration_max_cells
        At most this many labelled cells are held out for calibration.
    self_check
        Hide some known types, run these rules on them and report how they did (``uns['orca']['self_check']``).
    self_check_types
        Share of the known types hidden by the self-check.
    self_check_known
        Share of every other type's labelled cells held out by the self-check.
    resolution
        Leiden resolution of the candidate clusters, or ``"auto"``: the one that best recovers the labels.
    resolution_grid
        The resolutions ``"auto"`` tries.
    fallback_resolution
        The resolution used where ``"auto"`` cannot be calibrated.
    calibration_cells
        At most this many labelled cells are clustered to calibrate the resolution.
    n_neighbors
        Neighbours of every kNN graph here (Leiden, labelled neighbourhoods, cluster cores).
    n_pcs
        Principal components of the aligned expression behind those graphs.
    max_cells
        At most this many cells (a random subset) are clustered.
    discovery_cells
        Above this many cells, the warm-ups and discovery (threshold, candidates, votes) run on a random sample of this many cells, so that their calls are those of data of that size; the open-world fit, inference and the novelty test's p-values use every cell (``None``: every cell).
    support_fraction
        An unlabelled cell with this share of the expected labelled neighbours is of a known type ...
    support_min
        ... and at least this many labelled neighbours.
    desert_alpha
        Binomial level below which a cell has too few labelled neighbours for a known type (a label desert).
    segregated_support
        A batch whose unlabelled cells are supported less often than this was not labelled at random.
    widen_label_neighbourhood
        Where labels are sparse in a batch, the label tests read as many neighbours as a test at ``desert_alpha`` needs (``(1 - f)^k < desert_alpha``; 90 at 5% labelled) instead of ``n_neighbors``.
    query_resolution
        Leiden resolution of a batch without labelled cells (a separate query).
    query_vote_cells
        At most this many cells of a batch without labelled cells (a random sample, drawn with the run's seed) are clustered and vote; every other cell takes the cluster that most of its ``n_neighbors`` nearest sample cells hold, and the labelled pieces of the contrast vote's bar are cut from as many cells of their batch. Each cluster is then voted on its sample cells alone, so a vote's decision depends on the data, not on how many cells carry it (``None``: every cell).
    query_scores
        What the query vote's conformal p-values and its bar read of a query cell: ``"warmup"`` (the default), its best seen-head cosine in the main warm-up, ranked among the cross-fitted cosines of the labelled cells of the type that claims it; ``"folds"``, its best cosine in each cross-fitted warm-up ranked among the cells held out of that warm-up alone (cross-conformal: both sides of each comparison are cells the net never trained on, so the p-value does not depend on how closely the main warm-up fitted its cells, which falls with the number of cells). Costs one inference of the discovery sample's unlabelled cells per fold.
    query_vote
        How a cluster of a batch without labelled cells becomes a candidate. ``"contrast"`` (the default): by its share of out-of-distribution cells (``"share"``, below), or where its cells score below the unseen labelled cells of the known type whose head claims them (each cell's conformal p-value against that type's cross-fitted cosines, shifted by the batch; the cluster's mean p at most 0.36, a medium effect, and below 1/2 by a one-sided test at level 0.01 over the batch's clusters), below that type's cells in the batch's clusters that this vote leaves (one-sided Mann-Whitney at the same level, a medium effect: a known type that the batch shifts as a whole is not taken), and further below them (median cosine, in units of the type's spread) than any Leiden piece of the labelled cells, voted the same way, sits below the rest of its type (an edge piece of a known type is not taken either); without the cross-fitted cosines (``novelty_folds`` < 2) it is the share vote. ``"share"``: by the share alone (the earlier default; measured: docs/discovery.md). ``"either"`` (measured, not the default): the share or the conformal vote, without the contrast (needs ``novelty_folds`` >= 2 and ``cross_fit_threshold="per_type"``).
    query_min_fraction
        A query cluster is a candidate when this share of its cells is out-of-distribution ...
    query_min_enrichment
        ... or this many times the batch's share.
    share_vote_test
        Where the cluster has conformal p-values (``query_vote`` ``"contrast"`` or ``"either"``, at least 5 cells with one), the share vote's cluster must also score below the labelled cells as a whole: its cells' mean p-value below 1/2 by a one-sided test at level ``novelty_alpha`` (exact, Irwin-Hall, below 20 values; a z-test from 20) (a known-type cluster whose cells are exchangeable with its type's labelled cells is then taken with probability at most ``novelty_alpha``, however many of its cells fall in the tail below the threshold).
    core_min_agree
        A candidate cell is at its cluster's core when this share of its neighbours is in the cluster.
    core_min_fraction
        A cluster with a smaller share of core cells is not anchored.
    anchor_significant
        Also anchor the cells of a candidate of a batch without labelled cells whose conformal novelty p-value is significant at false discovery rate ``novelty_alpha`` (Benjamini-Hochberg over the query cells; needs the p-values of ``query_vote`` ``"contrast"`` or ``"either"``): a small query's candidates have no core, and training hands their novel cells to known heads.
    anchor_supported
        Also anchor, in the anchor epochs, each unlabelled cell the labels around it support (``support_fraction``) to the seen head that claims it after the warm-up: the labels say it is of a known type.
    min_novel_cells
        A novel head that wins fewer unlabelled cells than this is no cluster: its cells take their next most probable head (1: every head with a cell is kept).
    merge_threshold
        A novel cluster whose marker signature correlates this much with a known type of another batch takes its name (``None``: never); the correlation is corrected for the noise of the few cells behind either signature (Spearman's correction).
    no_warmup_rel_threshold
        Without a warm-up: clusters with a labelled share below this times the overall one count as novel.
    novelty_alpha
        Level of the conformal novelty test: known-type cells exchangeable with the reference get p <= alpha at most this often.
    novelty_folds
        Folds of labelled cells cross-fitting the novelty p-values (one warm-up each; 0: no p-values).
    cross_fit_threshold
        The out-of-distribution threshold from the labelled cells' cross-fitted cosines (the novelty folds' warm-ups; no label is lost): ``"per_type"``, the ``novelty_alpha`` quantile of the type whose head scores the cell best, shifted in query batches; ``"cap"``, the in-sample threshold capped at their ``ood_max_rate`` quantile; ``"none"``, the in-sample threshold.
    pca_input
        What discovery's PCA reads: ``"log"``, the aligned log-normalised expression; ``"pearson"``, analytic Pearson residuals of the counts (Lause et al. 2021; gene shares per batch, overdispersion 100, clipped at the square root of the number of cells), where the input was counts (log-normalised input keeps ``"log"``); ``"auto"``, the residuals where the labelled cells' nearest labelled neighbours name their type right more often in them than in the log values (one-sided exact McNemar test, level 0.05), else the log values.
    integration
        ``"harmony"``: discovery reads the batches integrated by Harmony on the joint PCA; ``"mnn"``: corrected by mutual nearest neighbours on it, the reference kept and each query batch translated per neighbourhood (``"none"``: a PCA of each cell set).
    use_rep
        Key of ``obsm`` holding the user's own integrated embedding of every cell (e.g. ``"X_scVI"``), present on reference and query alike: discovery reads it instead of a PCA (``None``: not used).

    """

    ood_quantile: float = 0.01
    ood_max_rate: float = 0.1
    calibration_fraction: float = 0.0
    calibration_max_cells: int = 2000
    self_check: bool = False
    self_check_types: float = 0.25
    self_check_known: float = 0.2
    resolution: float | str = "auto"
    resolution_grid: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0)
    fallback_resolution: float = 0.5
    calibration_cells: int = 10_000
    n_neighbors: int = 15
    n_pcs: int = 30
    max_cells: int = 50_000
    discovery_cells: int | None = 20_000
    support_fraction: float = 0.5
    support_min: int = 2
    desert_alpha: float = 0.01
    segregated_support: float = 0.1
    widen_label_neighbourhood: bool = True
    query_resolution: float = 1.0
    query_vote_cells: int | None = None
    query_scores: str = "warmup"
    query_vote: str = "contrast"
    query_min_fraction: float = 0.5
    query_min_enrichment: float = 2.5
    share_vote_test: bool = True
    core_min_agree: float = 0.5
    core_min_fraction: float = 2 / 3
    anchor_significant: bool = True
    anchor_supported: bool = True
    min_novel_cells: int = 5
    merge_threshold: float | None = 0.8
    no_warmup_rel_threshold: float = 0.1
    novelty_alpha: float = 0.05
    novelty_folds: int = 5
    cross_fit_threshold: str = "per_type"
    pca_input: str = "auto"
    integration: str = "none"
    use_rep: str | None = None

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
        for name in ("calibration_cells", "calibration_max_cells", "max_cells", "min_novel_cells"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                _invalid(name, getattr(self, name), "a positive integer")
        cap = self.discovery_cells
        if cap is not None and (not _is_int(cap) or cap < MIN_DISCOVERY_CELLS):
            _invalid("discovery_cells", cap, f"None or an integer >= {MIN_DISCOVERY_CELLS}")
        for name in ("n_neighbors", "n_pcs"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 2:
                _invalid(name, getattr(self, name), "an integer >= 2")
        if not _is_int(self.support_min) or self.support_min < 0:
            _invalid("support_min", self.support_min, "a non-negative integer")
        if not (_is_number(self.novelty_alpha) and 0 < self.novelty_alpha < 1):
            _invalid("novelty_alpha", self.novelty_alpha, "a number in (0, 1)")
        folds = self.novelty_folds
        if not _is_int(folds) or folds < 0 or folds == 1:
            _invalid("novelty_folds", folds, "0 (no p-values) or an integer >= 2")
        for name in (
            "self_check",
            "anchor_significant",
            "widen_label_neighbourhood",
            "anchor_supported",
            "share_vote_test",
        ):
            if not isinstance(getattr(self, name), bool):
                _invalid(name, getattr(self, name), "True or False")
        if self.query_scores not in ("warmup", "folds"):
            _invalid("query_scores", self.query_scores, '"warmup" or "folds"')
        if self.cross_fit_threshold is None:  # no cross-fitted threshold: the in-sample one
            object.__setattr__(self, "cross_fit_threshold", "none")
        if isinstance(self.cross_fit_threshold, bool):  # saved by 0.2.0: True was the cap
            object.__setattr__(
                self, "cross_fit_threshold", "cap" if self.cross_fit_threshold else "none"
            )
        if self.cross_fit_threshold not in ("per_type", "cap", "none"):
            _invalid("cross_fit_threshold", self.cross_fit_threshold, '"per_type", "cap" or "none"')
        if self.cross_fit_threshold == "cap" and folds == 0:
            _invalid(
                "cross_fit_threshold", self.cross_fit_threshold,
                '"none" or "per_type" when novelty_folds=0 (the cap reads the cross-fitted '
                "warm-ups; set novelty_folds >= 2)",
            )  # fmt: skip
        if self.query_vote not in ("either", "contrast", "share"):
            _invalid("query_vote", self.query_vote, '"contrast", "either" or "share"')
        if self.query_vote == "either" and (folds == 0 or self.cross_fit_threshold != "per_type"):
            _invalid(
                "query_vote", self.query_vote,
                '"share" unless novelty_folds >= 2 and cross_fit_threshold="per_type" (the '
                "conformal vote reads the cross-fitted cosines of each known type)",
            )  # fmt: skip
        if self.pca_input not in ("log", "pearson", "auto"):
            _invalid("pca_input", self.pca_input, '"log", "pearson" or "auto"')
        if self.integration is None:  # as `--set integration=none` reads it
            object.__setattr__(self, "integration", "none")
        if self.integration not in ("none", "harmony", "mnn"):
            _invalid("integration", self.integration, '"none", "harmony" or "mnn"')
        rep = self.use_rep
        if rep is not None and not (isinstance(rep, str) and rep):
            _invalid("use_rep", rep, "the name of an obsm key or None")
        if rep is not None and self.integration != "none":
            _invalid(
                "integration", self.integration,
                f'"none" when use_rep is given (use_rep={rep!r} is the integrated space already)',
            )  # fmt: skip
        qvc = self.query_vote_cells
        if qvc is not None and (not _is_int(qvc) or qvc < 2 * self.n_neighbors):
            _invalid(
                "query_vote_cells",
                qvc,
                f"None or an integer >= {2 * self.n_neighbors} (twice n_neighbors)",
            )
        thr = self.merge_threshold
        if thr is not None and not (_is_number(thr) and 0 < thr <= 1):
            _invalid("merge_threshold", thr, "a number in (0, 1] or None")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DiscoveryConfig:
        """Inverse of ``to_dict``; unknown keys raise, options of removed rules (in model files
        saved by an earlier version) are dropped.
        """
        d = {k: v for k, v in d.items() if k not in _RETIRED_KEYS}
        _check_keys(cls, d)
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able representation (tuples become lists)."""
        return _to_dict(self)


#: options of discovery rules that were removed because they did not pay on the development
#: suite (docs/discovery.md); a model file that still has them loads without them
_RETIRED_KEYS = frozenset(
    {"min_cluster_cells", "min_cluster_fraction", "calibration_probe", "ood_ensemble"}
)

#: names of the :class:`DiscoveryConfig` fields (accepted as keywords by ``annotate``)
DISCOVERY_FIELDS = frozenset(f.name for f in dataclasses.fields(DiscoveryConfig))


@dataclass(frozen=True)
class OrcaConfig:
    """Every option of an ORCA run (the keywords of :func:`orca_sc.tl.annotate`; the reasons
    for the defaults are in ``docs/method.md``).

    Attributes
    ----------
    n_genes
        Highly variable genes, chosen on reference and query together (``None``: every shared gene).
    layer
        Read expression from ``adata.layers[layer]`` instead of ``.X``.
    batch_key
        ``obs`` column with batches, for gene selection and alignment (default: reference and query).
    unlabeled_category
        Label values that mean "unlabelled" (besides NaN).
    min_shared_genes
        Fewer genes shared by reference and query is an error.
    target_sum
        Counts are normalised to this total per cell, then ``log1p``.
    alignment
        ``"centroid"`` shifts each batch onto the reference's class centroids, ``"standardize"`` z-scores each gene per batch, ``"none"``.
    hidden_dims
        Sizes of the backbone's two fully connected layers; the second is the embedding.
    dropout
        Dropout probability after each layer.
    n_novel
        Number of novel heads, or ``"auto"``: one per candidate novel cluster found after the warm-up.
    discovery
        A :class:`DiscoveryConfig`; its fields may also be given to ``annotate`` as keywords.
    epochs
        Epochs of training (warm-up included) at most; an epoch is one pass over all cells.
    batch_size
        Cells per mini-batch.
    lr
        Adam's learning rate (at most 1).
    weight_decay
        Adam's weight decay.
    min_steps
        The schedule of small data has at least this many optimiser steps (epochs are added).
    stop_tolerance
        A phase (warm-up, open-world fit) stops before its epochs are done once the loss fell by
        less than two standard errors and the share of a fixed sample of 2,000 cells that changed
        head since the last check is below this, or no longer falling (two binomial standard
        errors); ``0`` trains every epoch (the paper's schedule).
    stop_check_steps
        Optimiser steps between two such checks, or one epoch where an epoch has more steps
        (``stop_every_epoch``) ...
    stop_every_epoch
        Checks at least one epoch apart: each compares the net after a whole pass over the
        cells with the one before, so when a phase stops does not depend on how many cells
        carry the data (``False``, the default: every ``stop_check_steps`` steps at any size;
        measured in docs/discovery.md, not the default: it trains longer at large sizes);
        ``"warm-up"``: so in the warm-ups (the main one and its cross-fitted copies) alone, the
        open-world fit checked every ``stop_check_steps`` steps.
    stop_min_steps
        ... and the steps every phase runs before it may stop.
    warmup_epochs
        Supervised-only epochs before the novel heads are added (smaller than ``epochs``).
    anchor_epochs
        Epochs after the warm-up in which candidate clusters' core cells are pulled to their heads ...
    anchor_weight
        ... with this weight of the anchor cross-entropy.
    eta1
        Weight of the pairwise term (paper Eq. 1).
    eta2
        Weight of the entropy regulariser (paper Eq. 1).
    lam
        The adaptive margin is ``lam`` times the unlabelled cells' mean uncertainty (paper Eq. 4).
    margin
        ``"adaptive"`` (ORCA), ``"fixed"`` (ORCA-FNM, ``fixed_margin``) or ``"zero"`` (ORCA-ZM).
    fixed_margin
        The margin of ``margin="fixed"``.
    max_margin
        Upper bound of the adaptive margin.
    supervised
        Keep the supervised term (off for ablations).
    regularizer
        Keep the entropy regulariser (off for ablations).
    prior
        Target of the regulariser: ``"data"`` (estimated class sizes) or ``"uniform"`` (the paper).
    pair_space
        Where unlabelled cells' pair partners are found: ``"both"``, ``"query_pca"`` (``"pca"`` for the cells of batches without labelled cells, ``"both"`` elsewhere), ``"pca"`` or ``"embedding"`` (the paper).
    pair_pcs
        Principal components of that PCA.
    mutual_pairs
        A nearest neighbour is a partner only if the cell is among its this many nearest (0: the paper's rule).
    device
        ``"auto"`` (CUDA, then MPS, then CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"mps"``.
    majority_vote
        Refine the labels by majority voting over an over-clustering of the annotated cells
        (CellTypist's rule); the per-cell labels are kept beside them.
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
    stop_tolerance: float = 0.01
    stop_check_steps: int = 25
    stop_every_epoch: bool | str = False
    stop_min_steps: int = 100
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
    pair_space: PairSpace = "query_pca"
    pair_pcs: int = 30
    mutual_pairs: int = 3
    majority_vote: bool = False
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
        for name in ("epochs", "batch_size", "min_shared_genes", "stop_check_steps"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                _invalid(name, getattr(self, name), "a positive integer")
        for name in ("min_steps", "warmup_epochs", "anchor_epochs", "stop_min_steps"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                _invalid(name, getattr(self, name), "a non-negative integer")
        if self.warmup_epochs >= self.epochs:
            _invalid(
                "warmup_epochs",
                self.warmup_epochs,
                f"smaller than epochs={self.epochs} (the open-world phase follows the warm-up)",
            )
        if not (_is_number(self.stop_tolerance) and 0 <= self.stop_tolerance <= 1):
            _invalid("stop_tolerance", self.stop_tolerance, "a share in [0, 1] (0: every epoch)")
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
        if self.pair_space not in ("both", "query_pca", "pca", "embedding"):
            _invalid("pair_space", self.pair_space, '"both", "query_pca", "pca" or "embedding"')
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
        if not isinstance(self.majority_vote, bool):
            _invalid("majority_vote", self.majority_vote, "True or False")
        if not (isinstance(self.stop_every_epoch, bool) or self.stop_every_epoch == "warm-up"):
            _invalid("stop_every_epoch", self.stop_every_epoch, 'True, False or "warm-up"')
        if not (_is_int(self.seed) and 0 <= self.seed < 2**32):
            _invalid("seed", self.seed, "an integer from 0 to 2**32 - 1")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able representation (tuples become lists, ``discovery`` a nested dict)."""
        return _to_dict(self)

    def stop_check_interval(self, steps_per_epoch: int, phase: str = "warm-up") -> int:
        """Optimiser steps between two checks of the stopping rule in a ``phase``
        (``"warm-up"`` or ``"open-world"``) of epochs of ``steps_per_epoch`` steps
        (``stop_check_steps``, or an epoch where that is longer and ``stop_every_epoch`` holds
        for the phase).
        """
        every = self.stop_every_epoch
        if every is True or (every == "warm-up" and phase == "warm-up"):
            return max(self.stop_check_steps, steps_per_epoch)
        return self.stop_check_steps

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OrcaConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise."""
        d = dict(d)
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


# ----------------------------------------------------------------------- options of a call
class _Default:
    """Marks a keyword the caller did not give (its value comes from ``config`` or the
    defaults).
    """

    def __repr__(self) -> str:
        return "<default>"


DEFAULT: Any = _Default()

_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(OrcaConfig))


def resolve_config(config: OrcaConfig | None, where: str, **options: Any) -> OrcaConfig:
    """``config`` (or the defaults) with every option the caller gave: an explicit keyword always
    wins over ``config``. Options are :class:`OrcaConfig` or :class:`DiscoveryConfig` fields.
    """
    if config is not None and not isinstance(config, OrcaConfig):
        msg = f"{where}: config must be an orca_sc.OrcaConfig, got {type(config).__name__}."
        raise TypeError(msg)
    given = {k: v for k, v in options.items() if v is not DEFAULT}
    unknown = sorted(set(given) - _CONFIG_FIELDS - DISCOVERY_FIELDS)
    if unknown:
        msg = (
            f"{where} got unexpected keyword argument(s) {unknown}; options are the fields of "
            "orca_sc.OrcaConfig and orca_sc.DiscoveryConfig."
        )
        raise TypeError(msg)
    base = config if config is not None else OrcaConfig()
    epochs = given.get("epochs")
    if "warmup_epochs" not in given and _is_int(epochs) and 1 <= epochs <= base.warmup_epochs:
        # a run of fewer epochs than the default warm-up: shorten the warm-up, not refuse
        given["warmup_epochs"] = epochs - 1
        logger.info("epochs=%d: the supervised warm-up is shortened to %d.", epochs, epochs - 1)
    return base.replace(**given)
