"""The trained ORCA model: network + everything needed to apply it to new cells, saveable."""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from . import __version__
from ._ablation import LAB, Ablation
from ._align import (
    centroid_shift,
    identity,
    standardize,
)
from ._annotation import (
    Annotation,
    annotate_record,
    jsonable,
    novelty_test,
)
from ._calibration import apply_transfer, calibrate
from ._card import model_card
from ._cells import CellMatrix, infer, reproducible, resolve_device
from ._config import OrcaConfig, resolve_config
from ._data import batch_column, check_unique_genes
from ._engine import stage
from ._errors import OrcaInputError, check_anndata, check_input_file
from ._heads import (
    _novel_similarity,
    best_head,
    canonical_heads,
    name_heads_of_fit,
    novel_names_of,
    novelty_quantiles,
    seen_cosine,
)
from ._model_file import FORMAT, _check_model, _confidence_map, _to_builtin
from ._pipeline import Fit
from ._pipeline import fit as fit_run
from ._read import open_matrix, warn_empty
from ._store import spill_csr
from ._vote import Vote, majority_vote
from .module import OrcaNet

logger = logging.getLogger(__name__)

#: ``predict`` refuses data that has fewer than this fraction of the model's genes.
MIN_GENE_FRACTION = 0.5


@dataclass
class Prediction:
    """Model output for a set of cells (numpy only)."""

    probs: np.ndarray  # (n, K) softmax over heads
    embedding: np.ndarray  # (n, D) L2-normalised
    head: np.ndarray  # (n,) argmax head

    @property
    def confidence(self) -> np.ndarray:
        return self.probs.max(axis=1)


def train(
    adata: Any, reference: Any | None, labels_key: str, cfg: OrcaConfig, lab: Ablation = LAB
) -> tuple[OrcaModel, Annotation]:
    """Train ORCA on ``adata`` (+ ``reference``) and annotate ``adata``'s cells: the one
    assembly behind :func:`orca_sc.tl.annotate`, :meth:`OrcaModel.fit` and ``orca-sc annotate``.
    """
    with reproducible(resolve_device(cfg.device)):
        fit = fit_run(adata, reference, labels_key, cfg, lab)
        with stage("naming, novelty and calibration"):
            return _assemble(fit, reference, labels_key, cfg)


def _assemble(
    fit: Fit, reference: Any | None, labels_key: str, cfg: OrcaConfig
) -> tuple[OrcaModel, Annotation]:
    """The model and the annotation of a finished fit: novel heads named, novelty and
    confidence calibrated, the novelty test and majority vote applied.
    """
    data = fit.data
    classes = list(data.classes)
    # every head the run trained, named: the novel ones from the cells they won
    trained = classes + [f"_head{i}" for i in range(fit.found.n_heads)]
    head_names, naming = name_heads_of_fit(fit, best_head(fit.probs, trained))
    head = canonical_heads(head_names, best_head(fit.probs, head_names))  # pruned heads excluded
    novel_names = novel_names_of(head_names, classes)
    sizes = np.bincount(head[~data.labeled], minlength=len(head_names))
    novel_sizes = {n: int(sizes[head_names.index(n)]) for n in novel_names}
    confidence, calibration, confidence_map = _confidence(fit, head, len(classes))
    model = OrcaModel(
        fit.net, fit.config, data.genes, classes, head_names, fit.centroids, fit.history,
        novelty_quantiles=novelty_quantiles(fit.net, len(classes), fit.embedding[data.labeled]),
        similarity=_novel_similarity(fit, head, head_names, novel_names),
        alignment=jsonable(fit.transform.info), estimate=jsonable(fit.found.record()),
        trained_with=__version__, confidence_map=confidence_map,
        card=model_card(fit, novel_sizes, labels_key),
    )  # fmt: skip
    mode = "single" if reference is None else "reference"
    out = data.output_rows
    labels = model.labels_for(head)
    test = novelty_test(fit.novelty_pvalues, labels, data.labeled, novel_names, cfg.discovery,
                        (data.domain, list(data.domain_names)))  # fmt: skip
    vote = _majority_vote(fit, labels) if cfg.majority_vote else None
    record = annotate_record(fit, model, head, naming, labels_key, mode, test, calibration,
                             majority_vote=None if vote is None else vote.record)  # fmt: skip
    for note in record.notes:  # where the data cannot support a call: one line each
        logger.warning(note.line)
    annotation = Annotation(
        labels=(labels if vote is None else vote.labels)[out],
        confidence=confidence[out],
        novelty=model.novelty(fit.embedding[out]),
        embedding=fit.embedding[out],
        novel_names=model.novel_names,
        record=record,
        pvalue=test.pvalue[out] if test is not None else None,
        qvalue=test.qvalue[out] if test is not None else None,
        per_cell_labels=None if vote is None else labels[out],
        vote_cluster=None if vote is None else vote.cluster[out],
        vote_mixed=None if vote is None else vote.mixed[out],
    )
    return model, annotation


def _majority_vote(fit: Fit, labels: np.ndarray) -> Vote:
    """Labels voted over an over-clustering of the annotated (unlabelled) cells
    (:mod:`orca_sc._vote`), as arrays over all cells: labelled cells keep their labels, cluster
    ``-1`` and are not mixed.
    """
    unl = ~fit.data.labeled
    v = majority_vote(fit.embedding[unl], labels[unl], seed=fit.config.seed,
                      max_cells=fit.rules.max_cells)  # fmt: skip
    voted = labels.copy()
    voted[unl] = v.labels
    cluster = np.full(labels.size, -1, dtype=np.int64)
    cluster[unl] = v.cluster
    mixed = np.zeros(labels.size, dtype=bool)
    mixed[unl] = v.mixed
    return Vote(voted, cluster, mixed, v.record)


def _confidence(fit: Fit, head: np.ndarray, n_seen: int):
    """Every cell's confidence, its record for ``uns`` and the map that ``predict`` applies
    (``None``: not calibrated): for cells labelled a known type by a seen head, the calibrated
    probability that the label is right (:mod:`orca_sc._calibration`); for cells of novel
    clusters (and all cells without the cross-fitted warm-ups, ``novelty_folds=0``) the final
    net's probability of the cell's head.
    """
    final = fit.probs[np.arange(head.size), head]
    if fit.fold_predictions is None:
        return final, {"calibrated": False, "meaning": CONFIDENCE_MEANING[False]}, None
    cal = calibrate(fit.fold_predictions, final, head < n_seen)
    record = {"calibrated": True, "meaning": CONFIDENCE_MEANING[True], **cal.record}
    return cal.confidence, record, cal.transfer


#: what ``obs['orca_confidence']`` means, calibrated or not (``uns['orca']['confidence']``)
CONFIDENCE_MEANING = {
    True: "known types: the probability that the label is right (calibrated on held-out "
    "labelled cells); novel clusters: the model's probability of the cluster's head",
    False: "the model's probability of the cell's head (maximum softmax; not calibrated)",
}


class OrcaModel:
    """A trained ORCA network with its genes, classes, configuration and preprocessing.

    ``head_names`` maps every head to its output label: a seen class name, a novel cluster name
    (``novel_1`` = largest) or ``None`` for heads pruned after training (fewer unlabelled
    cells than ``min_novel_cells``). A novel head whose cluster matched a known type of another
    batch carries that type's name.
    ``novelty_quantiles``: 1,001 quantiles of the labelled cells' cosine to their nearest seen
    head (:meth:`novelty`; empty: no novelty score); ``similarity``:
    see :meth:`novel_similarity`; ``alignment`` and ``estimate``: the training run's alignment
    and discovery records; ``trained_with``: the orca_sc version that trained it;
    ``confidence_map``: isotonic knots ``(x, y)`` from a cell's maximum probability to its
    calibrated confidence (:meth:`confidence`; empty: not calibrated); ``card``: what it was
    trained on and how well it labels held-out reference cells (:meth:`describe`).
    """

    def __init__(
        self,
        net: OrcaNet,
        config: OrcaConfig,
        genes: list[str],
        classes: list[str],
        head_names: list[str | None],
        centroids: np.ndarray,
        history: list[dict] | None = None,
        *,
        novelty_quantiles: list[float] | None = None,
        similarity: dict[str, Any] | None = None,
        alignment: dict[str, Any] | None = None,
        estimate: dict[str, Any] | None = None,
        trained_with: str = "",
        confidence_map: tuple[list[float], list[float]] | None = None,
        card: dict[str, Any] | None = None,
    ) -> None:
        self.net = net
        self.config = config
        self.genes = list(genes)
        self.classes = list(classes)
        self.head_names = list(head_names)
        self.centroids = np.asarray(centroids, dtype=np.float32)
        self.history = history or []
        self.novelty_quantiles = list(novelty_quantiles or [])
        self.similarity = similarity or {"clusters": [], "types": list(classes), "similarity": []}
        self.alignment = alignment or {}
        self.estimate = estimate or {}
        self.trained_with = trained_with
        x, y = confidence_map or ([], [])
        self.confidence_map = ([float(v) for v in x], [float(v) for v in y])
        self.card = card or {}

    # ------------------------------------------------------------------------------------ fit
    @classmethod
    def fit(
        cls,
        adata: Any,
        reference: Any | None = None,
        *,
        labels_key: str,
        config: OrcaConfig | None = None,
        ablation: Ablation | None = None,
        **kwargs: Any,
    ) -> OrcaModel:
        """Train a model as :func:`orca_sc.tl.annotate` does (same arguments, same result for
        the same seed), without writing anything into ``adata``; label cells with
        :meth:`predict`, keep it with :meth:`save`.
        """
        check_anndata(adata, "adata")
        if reference is not None:
            check_anndata(reference, "reference")
        cfg = resolve_config(config, "OrcaModel.fit()", **kwargs)
        model, _ = train(adata, reference, labels_key, cfg, LAB if ablation is None else ablation)
        return model

    # -------------------------------------------------------------------------------- inference
    def predict_arrays(
        self,
        X: sp.csr_matrix,
        domain: np.ndarray,
        scale: np.ndarray,
        offset: np.ndarray,
        device: str | None = None,
    ) -> Prediction:
        """Head probabilities, embedding and head of the cells of ``X`` (log-normalised, the
        model's genes), aligned per batch (``domain``) by ``scale`` and ``offset``.
        """
        cells = CellMatrix(X, domain, scale, offset, resolve_device(device or self.config.device))
        self.net.to(cells.device)
        with reproducible(cells.device):
            probs, emb = infer(self.net, cells)
        return Prediction(probs, emb, self.assign_heads(probs))

    def assign_heads(self, probs: np.ndarray) -> np.ndarray:
        """Most probable head of each cell among the kept heads (pruned heads never win)."""
        return best_head(probs, self.head_names)

    def canonical_heads(self, head: np.ndarray) -> np.ndarray:
        """``head`` with every head replaced by the first head of the same name (novel heads
        that are one type in several batches share a name).
        """
        return canonical_heads(self.head_names, head)

    def seen_cosine(self, embedding: np.ndarray) -> np.ndarray:
        """Each cell's cosine to its nearest seen-class head, ``(n,)``, from its L2-normalised
        ``embedding`` ``(n, D)``.
        """
        return seen_cosine(self.net, len(self.classes), embedding)

    def novelty(self, embedding: np.ndarray) -> np.ndarray:
        """Novelty score of each cell (0-1): one minus the share of labelled reference cells that
        are less similar to their nearest seen head than the cell is to its own. Cells of known
        types score about uniformly; a cell less like any known type than almost every labelled
        cell scores near 1. NaN for a model without ``novelty_quantiles``.
        """
        q = self.novelty_quantiles
        if not q:
            return np.full(embedding.shape[0], np.nan, dtype=np.float32)
        q = np.asarray(q)
        below = np.interp(self.seen_cosine(embedding), q, np.linspace(0, 1, q.size))
        return (1.0 - below).astype(np.float32)

    def confidence(self, pred: Prediction) -> np.ndarray:
        """Confidence of new cells: for those labelled a known type, the calibrated probability
        that the label is right, through the training run's map from the maximum probability
        (``confidence_map``); otherwise (novel clusters, or a model without a map) the maximum
        probability.
        """
        conf = pred.confidence.astype(np.float32)
        known = pred.head < len(self.classes)
        return np.where(known, apply_transfer(self.confidence_map, conf), conf)

    def describe(self) -> str:
        """The model's card as text (what ``orca-sc predict --info MODEL`` prints): the reference
        (cells per type, genes, batches), the accuracy of each known type on held-out reference
        cells, the novel clusters, the self-check, notes, options and versions; the card itself
        is ``model.card``.
        """
        from ._card import format_card

        return format_card(self.card, self.genes)

    def labels_for(self, head: np.ndarray) -> np.ndarray:
        """Output label (class or novel cluster name) of each cell's head."""
        names = np.array([n if n is not None else "" for n in self.head_names], dtype=object)
        return names[head]

    @property
    def novel_names(self) -> list[str]:
        """Names of the novel clusters (kept novel heads): ``novel_1`` (largest), ``novel_2``, ..."""
        return novel_names_of(self.head_names, self.classes)

    def novel_similarity(self) -> dict[str, Any]:
        """Expression similarity of each novel cluster to every known type (computed at training:
        centred correlation of the cluster's mean aligned expression with each reference type's),
        to say which known types a discovered cluster resembles (MARS-style naming).

        ``{"clusters": [names], "types": [known types], "similarity": n_clusters x n_types}``.
        """
        return dict(self.similarity)

    def predict(
        self,
        adata: Any,
        *,
        layer: str | None = None,
        batch_key: str | None = None,
        device: str | None = None,
    ):
        """Apply the model to new cells without retraining.

        Genes are aligned by name; genes of the model missing from ``adata`` are set to zero (an
        error when fewer than half are present). The batch shift of the new data (of each batch
        in ``obs[batch_key]``, if given) is corrected the same way as during training
        (``config.alignment``), against the stored reference centroids. Returns
        ``(labels, prediction, info)``.
        """
        check_anndata(adata, "adata")
        check_unique_genes(adata.var_names, "data to predict")
        layer = layer if layer is not None else self.config.layer
        reader = open_matrix(adata, layer, "data to predict", self.config.target_sum)
        idx = adata.var_names.astype(str).get_indexer(self.genes)
        found = idx >= 0
        if found.mean() < MIN_GENE_FRACTION:
            missing = [g for g, f in zip(self.genes, found, strict=True) if not f][:5]
            msg = (
                f"Only {int(found.sum())} of the model's {len(self.genes)} genes are in the data "
                f"(need at least {MIN_GENE_FRACTION:.0%}); missing e.g. {missing}. Use the same gene "
                "identifiers as the reference the model was trained on."
            )
            raise OrcaInputError(msg)
        if not found.all():
            logger.warning(
                "%d of the model's %d genes are missing from the data; they are set to 0.",
                int((~found).sum()),
                len(self.genes),
            )
        # reorder columns to the model's genes; missing genes become empty columns
        sel = sp.csr_matrix(
            (np.ones(found.sum(), dtype=np.float32), (idx[found], np.flatnonzero(found))),
            shape=(adata.n_vars, len(self.genes)),
        )
        blocks = ((m @ sel).tocsr() for _, _, m in reader)
        if reader.on_disk:  # only the model's genes are held, in a scratch file
            Xg = spill_csr(blocks, len(self.genes))
        else:
            Xg = sp.vstack([sp.csr_matrix((0, len(self.genes)), dtype=np.float32), *blocks],
                           format="csr", dtype=np.float32)  # fmt: skip
        if reader.n_empty:
            warn_empty(reader.n_empty, stacklevel=3)
        scale_kind = reader.scale
        if batch_key is None:
            domain = np.zeros(Xg.shape[0], dtype=np.int64)
            n_domains = 1
        else:
            batches = batch_column(adata, batch_key, "data to predict")
            _, domain = np.unique(batches.astype(str), return_inverse=True)
            domain = domain.astype(np.int64)
            n_domains = int(domain.max()) + 1
        scale, offset = self._transform_new(Xg, domain, n_domains)
        pred = self.predict_arrays(Xg, domain, scale, offset, device)
        labels = self.labels_for(pred.head)
        info = {
            "input_scale": scale_kind,
            "n_genes_missing": int((~found).sum()),
            "alignment": self.config.alignment,
        }
        return labels, pred, info

    def _transform_new(
        self, X: sp.csr_matrix, domain: np.ndarray, n_domains: int
    ) -> tuple[np.ndarray, np.ndarray]:
        if self.config.alignment == "standardize":
            return standardize(X, domain, n_domains)
        scale, offset = identity(n_domains, X.shape[1])
        if self.config.alignment == "centroid":
            for d in range(n_domains):
                offset[d] = centroid_shift(X[domain == d], self.centroids)
        return scale, offset

    # ------------------------------------------------------------------------------- save/load
    def save(self, path: str | Path) -> None:
        """Save as ``state_dict`` + JSON-able metadata (loadable with ``weights_only=True``).

        Written to a temporary file first and renamed, so an interrupted save leaves no partial file.
        """
        path = Path(path)
        meta = {
            "format": FORMAT,
            "version": __version__,
            "config": self.config.to_dict(),
            "genes": self.genes,
            "classes": self.classes,
            "head_names": self.head_names,
            "n_heads": len(self.head_names),
            "history": self.history,
            "extra": {
                "alignment": self.alignment,
                "estimate": self.estimate,
                "novel_similarity": self.similarity,
                "version": self.trained_with,
                "seen_cosine_quantiles": self.novelty_quantiles,
                "confidence_map": list(self.confidence_map),
                "card": self.card,
            },
        }
        payload = {
            "meta": json.loads(json.dumps(meta, default=_to_builtin)),  # plain JSON types only
            "state_dict": {k: v.detach().cpu() for k, v in self.net.state_dict().items()},
            "centroids": torch.as_tensor(self.centroids),
        }
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            torch.save(payload, tmp)
            tmp.replace(path)
        finally:
            if tmp.exists():
                tmp.unlink()

    @classmethod
    def load(cls, path: str | Path) -> OrcaModel:
        """Load a model saved by :meth:`save`. Files carrying code (arbitrary pickles) are refused,
        and so is a file whose metadata and weights do not fit together (missing keys, head
        names that are not strings, a head count that does not match the weights) or whose
        weights are not finite: such a model could only give wrong labels.
        """
        path = check_input_file(path, "Model", "the model file (e.g. model.pt)")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's notes on foreign pickle protocols
                payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means an unusable file
            msg = (
                f"Cannot read model file {str(path)!r}: it is not an orca_sc model or it is corrupt "
                f"({type(e).__name__}). Files that carry code are refused; re-save the model with "
                "orca_sc."
            )
            raise OrcaInputError(msg) from None
        meta = payload.get("meta") if isinstance(payload, dict) else None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            got = meta.get("format") if isinstance(meta, dict) else None
            msg = (
                f"Model file {str(path)!r} has format {got!r}, expected {FORMAT!r}; it was written by "
                "another program or an incompatible orca_sc version. Retrain the model."
            )
            raise OrcaInputError(msg)
        config, net, centroids = _check_model(payload, meta, f"Model file {str(path)!r}")
        extra = meta.get("extra") or {}
        return cls(
            net, config, meta["genes"], meta["classes"], meta["head_names"], centroids,
            meta.get("history"), novelty_quantiles=extra.get("seen_cosine_quantiles"),
            similarity=extra.get("novel_similarity"), alignment=extra.get("alignment"),
            estimate=extra.get("estimate"), trained_with=extra.get("version", ""),
            confidence_map=_confidence_map(extra.get("confidence_map"), f"Model file {str(path)!r}"),
            card=extra.get("card") if isinstance(extra.get("card"), dict) else None,
        )  # fmt: skip
