"""The trained ORCA model: network + everything needed to apply it to new cells, saveable."""

from __future__ import annotations

import json
import logging
import re
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
    aligned_group_means,
    centroid_shift,
    identity,
    profile_similarity,
    standardize,
)
from ._annotation import (
    Annotation,
    Naming,
    annotate_record,
    evidence_note,
    jsonable,
    novelty_test,
)
from ._calibration import apply_transfer, calibrate
from ._card import model_card
from ._config import OrcaConfig, resolve_config
from ._data import batch_column, check_unique_genes
from ._discover import match_known_types, match_novel_across_batches, name_heads
from ._discover.naming import cluster_reliabilities, naming_means
from ._engine import stage
from ._errors import OrcaInputError, check_anndata, check_input_file
from ._pipeline import Fit
from ._pipeline import fit as fit_run
from ._read import open_matrix, warn_empty
from ._store import spill_csr
from ._train import CellMatrix, infer, reproducible, resolve_device
from ._vote import Vote, majority_vote
from .module import OrcaNet

logger = logging.getLogger(__name__)

FORMAT = "orca_sc.model/1"
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
    for note in test.notes if test is not None else []:
        logger.warning(note)
    vote = _majority_vote(fit, labels) if cfg.majority_vote else None
    record = annotate_record(fit, model, head, naming, labels_key, mode, test, calibration,
                             majority_vote=None if vote is None else vote.record)  # fmt: skip
    if (note := evidence_note(record.novel_evidence)) is not None:
        logger.warning(note)
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
    too_few = counts < bar
    head_names, order = name_heads(np.where(too_few, 0, counts), classes, pairs, same)
    # the cells of each head that pruning took, largest first (a head merged into a known type
    # keeps its name)
    pruned = sorted((int(counts[h]) for h in range(n_novel) if too_few[h] and counts[h] > 0
                     and head_names[n_seen + h] is None), reverse=True)  # fmt: skip
    if pruned:
        logger.warning(
            "%d novel head(s) won only %s unlabelled cell(s), fewer than the %d a cluster needs: too "
            "few for a cluster the data can support, so their cells take their next most "
            "probable head (uns['orca']['n_novel']['pruned']).",
            len(pruned), ", ".join(map(str, pruned)), bar,
        )  # fmt: skip
    for (h, k, _), t in zip(pairs, tested, strict=True):
        if t["set_apart"] and counts[h] > 0:
            logger.warning(
                "A novel cluster of %d cells was reported as %s (its marker signature matches "
                "the type's), but matches %s less well than the %d query cells %s's head kept "
                "in its batch (permutation p = %.3f): it may be a novel type beside %s, or a "
                "part of %s that looks unlike it (uns['orca']['merged_into_known']).",
                int(counts[h]), classes[k], classes[k], t["n_kept"], classes[k], t["p_value"],
                classes[k], classes[k],
            )  # fmt: skip
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
    }
    return head_names, Naming(merged, order, {
        "cluster": [f"head_{a}" for a, _, _ in same],
        "same_as": [f"head_{b}" for _, b, _ in same],
        "name": [head_names[n_seen + b] for _, b, _ in same],
        "correlation": [round(r, 4) for _, _, r in same],
    }, pruned)  # fmt: skip


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


def _novel_similarity(fit: Fit, head: np.ndarray, head_names: list, novel_names: list) -> dict:
    """Centred expression correlation of each novel cluster (its unlabelled cells) with each known
    type (its labelled cells), both after batch alignment.

    Stored as ``{"clusters": [...], "types": [...], "similarity": (n_clusters, n_types)}``: cell
    type names may contain "/" and so cannot be keys of an h5ad group.
    """
    data, t = fit.data, fit.transform
    n_seen = len(data.classes)
    groups = np.where(data.labeled, data.labels, np.where(head >= n_seen, head, -1))
    means = aligned_group_means(data.X, groups, len(head_names), data.domain, t.scale, t.offset)
    known = means[:n_seen]
    sims = profile_similarity(means[n_seen:], known, known.mean(axis=0))
    order = [head_names.index(name) - n_seen for name in novel_names]
    return {
        "clusters": list(novel_names),
        "types": list(data.classes),
        "similarity": np.round(sims[order], 4).tolist(),
    }


def _confidence_map(value: Any, what: str) -> tuple[list[float], list[float]] | None:
    """A saved ``confidence_map`` (absent in older files: ``None``), checked."""
    if value is None:
        return None
    ok = isinstance(value, list) and len(value) == 2 and all(isinstance(v, list) for v in value)
    if ok:
        x, y = (np.asarray(v, dtype=np.float64) for v in value)
        ok = x.shape == y.shape and np.isfinite(x).all() and np.isfinite(y).all()
        ok = ok and bool(np.all(np.diff(x) >= 0)) and bool(((y >= 0) & (y <= 1)).all())
    if not ok:
        msg = f"{what} is damaged or was edited: its confidence map is not two lists of knots."
        raise OrcaInputError(msg + " Retrain it, or re-save it with orca_sc.")
    return value[0], value[1]


_NOVEL_NAME = re.compile(r"novel_[0-9]+")


def _check_model(payload: dict, meta: dict, what: str) -> tuple[OrcaConfig, OrcaNet, np.ndarray]:
    """The config, network and centroids of a loaded model file, after checking that its
    metadata and tensors are complete, consistent and finite (:class:`OrcaInputError` if not).
    """

    def bad(problem: str) -> OrcaInputError:
        return OrcaInputError(
            f"{what} is damaged or was edited: {problem}. Retrain it, or re-save it with orca_sc."
        )

    missing = [k for k in ("config", "genes", "classes", "head_names", "n_heads") if k not in meta]
    missing += [k for k in ("state_dict", "centroids") if k not in payload]
    if missing:
        raise bad(f"it has no {', '.join(map(repr, missing))}")
    genes, classes, names, n_heads = (
        meta["genes"], meta["classes"], meta["head_names"], meta["n_heads"]
    )  # fmt: skip

    def strings(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(v, str) for v in x)

    if not strings(genes) or not genes or len(set(genes)) != len(genes):
        raise bad("'genes' must be a non-empty list of unique gene names")
    if not strings(classes) or len(classes) < 2 or len(set(classes)) != len(classes):
        raise bad("'classes' must be a list of at least two unique cell-type names")
    if not (isinstance(n_heads, int) and not isinstance(n_heads, bool)):
        raise bad(f"'n_heads' is {n_heads!r}, not an integer")
    if not isinstance(names, list) or len(names) != n_heads or n_heads < len(classes):
        raise bad(
            f"'head_names' must list the {n_heads} heads (at least the {len(classes)} classes)"
        )
    if names[: len(classes)] != classes:
        raise bad("the first head names must be the classes")
    for name in names[len(classes) :]:
        if name is not None and not (
            isinstance(name, str) and (name in classes or _NOVEL_NAME.fullmatch(name))
        ):
            raise bad(f"head name {name!r} is neither a class nor a novel cluster (novel_N)")
    try:
        config = OrcaConfig.from_dict(meta["config"])
    except (ValueError, TypeError) as e:
        raise bad(f"its configuration is invalid ({e})") from None
    net = OrcaNet(len(genes), n_heads, config.hidden_dims, config.dropout)
    state = payload["state_dict"]
    expected = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    if not isinstance(state, dict) or set(state) != set(expected):
        raise bad("its weights are not those of an orca_sc network")
    for k, shape in expected.items():
        v = state[k]
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise bad(f"weight {k!r} has shape {got}, expected {shape} for {n_heads} heads")
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise bad(f"weight {k!r} holds NaN or infinite values")
    centroids = payload["centroids"]
    if not isinstance(centroids, torch.Tensor) or tuple(centroids.shape) != (
        len(classes),
        len(genes),
    ):
        raise bad("its class centroids do not match its classes and genes")
    if not torch.isfinite(centroids).all():
        raise bad("its class centroids hold NaN or infinite values")
    net.load_state_dict(state)
    net.eval()
    return config, net, centroids.numpy()


def _to_builtin(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    msg = f"Cannot store {type(obj).__name__} in model metadata."
    raise TypeError(msg)
