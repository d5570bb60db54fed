"""The one configuration object shared by the Python API, the CLI and saved models."""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from ._errors import ConfigError

logger = logging.getLogger(__name__)

AlignMode = Literal["centroid", "standardize", "none"]

#: Scale ``s`` of the L2-normalised head (paper Eq. 3). Defined here once; the head multiplies its
#: cosine similarities by it and the margin is expressed in cosine units.
HEAD_SCALE: float = 10.0


#: the smallest sample the warm-ups and discovery may run on (``discovery_cells``)
MIN_DISCOVERY_CELLS = 1000


@dataclass(frozen=True)
class DiscoveryConfig:
    """The choices a user makes about the ``discover`` stage (:mod:`orca_sc._discover`): the
    space discovery reads, how finely it clusters, the level of its tests, and what it may
    report. The rules' own constants are not options (:class:`orca_sc._ablation.DiscoveryRules`;
    the measurement behind each is in ``docs/discovery.md``). Saved with the model.

    Attributes
    ----------
    calibration_fraction
        Share of each seen class's labelled cells held out of the warm-up to calibrate the out-of-distribution threshold (0: none). Worth setting where the reference has few labelled cells per type (known-type cells are then called novel less often, at the cost of some novel cells).
    self_check
        Hide some known types, run discovery's rules on them and report how they did (``uns['orca']['self_check']``).
    resolution
        Leiden resolution of the candidate clusters, or ``"auto"``: the one that best recovers the labels.
    n_neighbors
        Neighbours of every kNN graph of discovery (Leiden, labelled neighbourhoods, cluster cores).
    discovery_cells
        Above this many cells, the warm-ups and discovery (threshold, candidates, votes) run on a random sample of this many cells, so that their calls are those of data of that size; the open-world fit, inference and the novelty test's p-values use every cell (``None``: every cell).
    merge_threshold
        A novel cluster whose marker signature correlates this much with a known type of another batch takes its name (``None``: never); the correlation is corrected for the noise of the few cells behind either signature (Spearman's correction).
    novelty_alpha
        Level of the conformal novelty test: known-type cells exchangeable with the reference get p <= alpha at most this often.
    novelty_folds
        Folds of labelled cells cross-fitting the novelty p-values (one warm-up each; 0: no p-values, and the query vote by the share of out-of-distribution cells alone).
    cross_fit_threshold
        ``"per_type"``: the out-of-distribution threshold of a cell is the ``novelty_alpha`` quantile of the cross-fitted cosines (the novelty folds' warm-ups) of the type whose head scores it best, shifted in query batches; ``"none"``: the in-sample quantile of all labelled cells.
    pca_input
        What discovery's PCA reads: ``"log"``, the aligned log-normalised expression; ``"pearson"``, analytic Pearson residuals of the counts (Lause et al. 2021; gene shares per batch, overdispersion 100, clipped at the square root of the number of cells), where the input was counts (log-normalised input keeps ``"log"``); ``"auto"``, the residuals where the labelled cells' nearest labelled neighbours name their type right more often in them than in the log values (one-sided exact McNemar test, level 0.05), else the log values.
    integration
        ``"harmony"``: discovery reads the batches integrated by Harmony on the joint PCA; ``"mnn"``: corrected by mutual nearest neighbours on it, the reference kept and each query batch translated per neighbourhood (``"none"``: a PCA of each cell set).
    use_rep
        Key of ``obsm`` holding the user's own integrated embedding of every cell (e.g. ``"X_scVI"``), present on reference and query alike: discovery reads it instead of a PCA (``None``: not used).

    """

    calibration_fraction: float = 0.0
    self_check: bool = False
    resolution: float | str = "auto"
    n_neighbors: int = 15
    discovery_cells: int | None = 20_000
    merge_threshold: float | None = 0.8
    novelty_alpha: float = 0.05
    novelty_folds: int = 5
    cross_fit_threshold: str = "per_type"
    pca_input: str = "auto"
    integration: str = "none"
    use_rep: str | None = None

    def __post_init__(self) -> None:
        res = self.resolution
        if not (res == "auto" or (_is_finite(res) and res > 0)):
            _invalid("resolution", res, 'a positive number or "auto"')
        frac = self.calibration_fraction
        if not (_is_number(frac) and 0 <= frac <= 1):
            _invalid("calibration_fraction", frac, "a number in [0, 1]")
        cap = self.discovery_cells
        if cap is not None and (not _is_int(cap) or cap < MIN_DISCOVERY_CELLS):
            _invalid("discovery_cells", cap, f"None or an integer >= {MIN_DISCOVERY_CELLS}")
        if not _is_int(self.n_neighbors) or self.n_neighbors < 2:
            _invalid("n_neighbors", self.n_neighbors, "an integer >= 2")
        if not (_is_number(self.novelty_alpha) and 0 < self.novelty_alpha < 1):
            _invalid("novelty_alpha", self.novelty_alpha, "a number in (0, 1)")
        folds = self.novelty_folds
        if not _is_int(folds) or folds < 0 or folds == 1:
            _invalid("novelty_folds", folds, "0 (no p-values) or an integer >= 2")
        if not isinstance(self.self_check, bool):
            _invalid("self_check", self.self_check, "True or False")
        if self.cross_fit_threshold is None:  # as `--set cross_fit_threshold=none` reads it
            object.__setattr__(self, "cross_fit_threshold", "none")
        if self.cross_fit_threshold not in ("per_type", "none"):
            _invalid("cross_fit_threshold", self.cross_fit_threshold, '"per_type" or "none"')
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
        thr = self.merge_threshold
        if thr is not None and not (_is_number(thr) and 0 < thr <= 1):
            _invalid("merge_threshold", thr, "a number in (0, 1] or None")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DiscoveryConfig:
        """Inverse of ``to_dict``; unknown keys raise. A model file saved by an earlier version
        loads: its options that are no longer a user's (the rules' constants, the alternatives
        that were retired) are dropped.
        """
        d = {k: v for k, v in d.items() if k not in RETIRED_DISCOVERY_KEYS}
        if d.get("cross_fit_threshold") in (True, False, "cap"):  # the retired cap: the default
            d["cross_fit_threshold"] = "per_type" if d["cross_fit_threshold"] else "none"
        _check_keys(cls, d)
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able representation (tuples become lists)."""
        return _to_dict(self)


#: options that a model file saved by an earlier version may hold and this one does not: rules
#: removed because they did not pay, alternatives measured and retired, and the rules' constants
#: and the paper's ablations, which are no longer a user's options (:mod:`orca_sc._ablation`)
RETIRED_DISCOVERY_KEYS = frozenset(
    {"min_cluster_cells", "min_cluster_fraction", "calibration_probe", "ood_ensemble",
     "ood_quantile", "ood_max_rate", "calibration_max_cells", "self_check_types",
     "self_check_known", "resolution_grid", "fallback_resolution", "calibration_cells", "n_pcs",
     "max_cells", "support_fraction", "support_min", "desert_alpha", "segregated_support",
     "widen_label_neighbourhood", "query_resolution", "query_vote_cells", "query_scores",
     "query_vote", "query_min_fraction", "query_min_enrichment", "share_vote_test",
     "core_min_agree", "core_min_fraction", "anchor_significant", "anchor_supported",
     "min_novel_cells", "no_warmup_rel_threshold"}
)  # fmt: skip
RETIRED_KEYS = frozenset(
    {"min_shared_genes", "stop_tolerance", "stop_check_steps", "stop_every_epoch",
     "stop_min_steps", "min_steps", "anchor_epochs", "anchor_weight", "weight_decay", "eta1",
     "eta2", "lam", "margin", "fixed_margin", "max_margin", "supervised", "regularizer", "prior",
     "pair_space", "pair_pcs", "mutual_pairs"}
)  # fmt: skip

#: names of the :class:`DiscoveryConfig` fields (accepted as keywords by ``annotate``)
DISCOVERY_FIELDS = frozenset(f.name for f in dataclasses.fields(DiscoveryConfig))


@dataclass(frozen=True)
class OrcaConfig:
    """Every option of an ORCA run that a user sets (the keywords of
    :func:`orca_sc.tl.annotate`; the reasons for the defaults are in ``docs/method.md``). The
    method's own settings and the paper's ablations are not options: the benchmark varies them
    through :class:`orca_sc.benchmark.Ablation`.

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
        Epochs of training (warm-up included) at most; an epoch is one pass over all cells, or on small data as many mini-batches as fill 15 optimiser steps (so fewer epochs always cost less).
    batch_size
        Cells per mini-batch.
    lr
        Adam's learning rate (at most 1).
    warmup_epochs
        Supervised-only epochs before the novel heads are added (smaller than ``epochs``).
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
    warmup_epochs: int = 5
    lr: float = 1e-3
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
        for name in ("epochs", "batch_size"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                _invalid(name, getattr(self, name), "a positive integer")
        if not _is_int(self.warmup_epochs) or self.warmup_epochs < 0:
            _invalid("warmup_epochs", self.warmup_epochs, "a non-negative integer")
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
        if self.alignment not in ("centroid", "standardize", "none"):
            _invalid("alignment", self.alignment, '"centroid", "standardize" or "none"')
        if not (
            isinstance(self.device, str)
            and re.fullmatch(r"auto|cpu|mps|cuda(:[0-9]+)?", self.device) is not None
        ):
            _invalid("device", self.device, '"auto", "cpu", "cuda", "cuda:N" or "mps"')
        if isinstance(self.discovery, dict):
            object.__setattr__(self, "discovery", DiscoveryConfig.from_dict(self.discovery))
        if not isinstance(self.discovery, DiscoveryConfig):
            _invalid("discovery", self.discovery, "a DiscoveryConfig")
        if not isinstance(self.majority_vote, bool):
            _invalid("majority_vote", self.majority_vote, "True or False")
        if not (_is_int(self.seed) and 0 <= self.seed < 2**32):
            _invalid("seed", self.seed, "an integer from 0 to 2**32 - 1")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able representation (tuples become lists, ``discovery`` a nested dict)."""
        return _to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OrcaConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise. A model file saved by an earlier
        version loads: its options that are no longer a user's are dropped.
        """
        d = {k: v for k, v in d.items() if k not in RETIRED_KEYS}
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
        lab = [k for k in unknown if k in RETIRED_KEYS | RETIRED_DISCOVERY_KEYS]
        if lab:
            msg = (
                f"{where}: {lab} are not options but the method's own settings; a method study "
                "passes them as ablation=orca_sc.benchmark.Ablation.of(...)."
            )
            raise TypeError(msg)
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
