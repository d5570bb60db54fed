"""``orca_sc.tl.annotate``: open-world annotation of an AnnData (scanpy style)."""

from __future__ import annotations

import logging
import warnings
from functools import partial
from typing import Any

import numpy as np
import pandas as pd
import torch

from .. import __version__
from .._align import (
    aligned_group_means,
    class_centroids,
    compute_transform,
    match_known_types,
    profile_similarity,
)
from .._config import OrcaConfig
from .._data import prepare
from .._estimate import (
    QUERY_MIN_ENRICHMENT,
    QUERY_MIN_FRACTION,
    QUERY_RESOLUTION,
    RESOLUTION_GRID,
    SEGREGATED_SUPPORT,
    cluster_cores,
    estimate_n_novel,
    hidden_novel_clusters,
    label_deserts,
    labelled_neighbours,
    labelled_support,
    min_cluster_size,
    ood_clusters,
    pca_embedding,
    query_ood_clusters,
    resolve_resolution,
    segregated_batches,
    subsample_rows,
)
from .._model import OrcaModel
from .._train import infer, train

logger = logging.getLogger(__name__)


def annotate(
    adata: Any,
    reference: Any | None = None,
    *,
    labels_key: str,
    n_novel: int | str = "auto",
    n_genes: int | None = 2000,
    layer: str | None = None,
    batch_key: str | None = None,
    unlabeled_category: str | tuple[str, ...] = ("Unknown",),
    key_added: str = "orca",
    copy: bool = False,
    return_model: bool = False,
    config: OrcaConfig | None = None,
    **kwargs: Any,
):
    """Assign every cell to a known cell type or to a newly discovered novel cluster (ORCA).

    Trains one model on labelled and unlabelled cells together (Cao, Brbić & Leskovec, ICLR 2022)
    and annotates the unlabelled ones. Two ways to call it:

    * ``annotate(query, reference, labels_key=...)``: the reference's ``obs[labels_key]`` holds the
      known types, every query cell is annotated;
    * ``annotate(adata, labels_key=...)``: cells whose label is NaN or one of
      ``unlabeled_category`` are the query, the others the reference.

    Parameters
    ----------
    adata
        Cells to annotate (raw counts or log-normalised values in ``.X`` or ``layer``). Modified in
        place unless ``copy=True``.
    reference
        Labelled reference AnnData; genes are matched by name.
    labels_key
        ``obs`` column with the cell types.
    n_novel
        Expected number of novel types, or ``"auto"`` to estimate it from the data. Novel heads that
        receive no cells are dropped from the output.
    n_genes
        Number of highly variable genes to train on (``None``: all shared genes).
    layer
        Use ``layers[layer]`` instead of ``.X`` (in both AnnData objects).
    batch_key
        ``obs`` column with batches, for batch-aware gene selection and alignment.
    unlabeled_category
        Label values that mean "unlabelled".
    key_added
        Prefix of the fields written (see Returns).
    copy
        Return an annotated copy instead of writing into ``adata``.
    return_model
        Also return the trained :class:`orca_sc.OrcaModel` (to predict new data, or save it).
    config
        A full :class:`orca_sc.OrcaConfig`; the keyword arguments above and any other
        ``OrcaConfig`` field given in ``**kwargs`` (``epochs``, ``seed``, ``device``, ...) override it.

    Returns
    -------
    ``adata`` if ``copy`` (with the model: ``(adata, model)`` if ``return_model``), else ``None``
    or the model. Writes to ``adata``:

    ``obs['{key_added}_label']``
        Categorical, every cell: a reference cell type or a novel cluster ``novel_1``, ``novel_2``,
        ... (numbered by size, largest first).
    ``obs['{key_added}_novel']``
        Categorical: the novel cluster for cells in novel clusters, NaN for cells of known types.
    ``obs['{key_added}_confidence']``
        Maximum softmax probability (0-1).
    ``obsm['X_{key_added}']``
        The L2-normalised cell embedding of the backbone.
    ``uns['{key_added}']``
        ``params`` (the configuration and ``labels_key``), ``mode`` (``"single"`` or
        ``"reference"``), ``seen_classes``, ``novel_cluster_sizes`` (unlabelled cells per novel
        cluster), ``novel_similarity`` (each novel cluster's expression correlation with each
        known type), ``merged_into_known`` (novel clusters reported as a known type of another
        batch, with their correlation), ``n_novel`` (requested / estimated / heads used /
        found), ``estimate`` (how the candidate novel clusters were found: their sizes, how many
        came from out-of-distribution cells, query-batch clusters and hidden sub-clusters, the
        number of label deserts, the Leiden resolution and its calibration scores, the
        threshold, the regulariser prior), ``input_scale`` (detected per input), ``alignment``
        (method and batches), ``data`` (labelled and unlabelled cells, shared and used genes),
        ``history`` (per-epoch losses, uncertainty, margin, warm-up and anchor flags),
        ``training`` (epochs, steps, seconds, device), ``seed`` and ``version``.

    """
    fields = {
        "n_novel": n_novel,
        "n_genes": n_genes,
        "layer": layer,
        "batch_key": batch_key,
        "unlabeled_category": unlabeled_category,
        **kwargs,
    }
    base = config if config is not None else OrcaConfig()
    if config is not None:  # explicit keywords win only where they differ from the defaults
        defaults = OrcaConfig()
        fields = {k: v for k, v in fields.items() if k in kwargs or v != getattr(defaults, k)}
    cfg = base.replace(**fields)
    adata = adata.copy() if copy else adata

    data = prepare(adata, reference, labels_key, cfg)
    n_seen = len(data.classes)
    scale, offset, align_info = compute_transform(
        cfg.alignment, data.X, data.labels, data.domain, len(data.domain_names), n_seen
    )
    estimate: dict[str, Any] = {}
    hook = None
    if cfg.warmup_epochs > 0:
        # novel heads are added after the supervised warm-up, initialised on candidate clusters
        n_heads0 = n_seen
        hook = partial(
            _init_novel_heads,
            pca_of=partial(
                pca_embedding, data.X, data.domain, scale, offset, n_comps=30, seed=cfg.seed
            ),
            labels=data.labels,
            domain=data.domain,
            domain_names=data.domain_names,
            rows=subsample_rows(data.n_cells, cfg.seed),
            n_novel=cfg.n_novel,
            resolution=cfg.resolution,
            hidden=cfg.hidden_novel,
            seed=cfg.seed,
        )
    else:
        if cfg.n_novel == "auto":
            rows = subsample_rows(data.n_cells, cfg.seed)
            resolution, _ = resolve_resolution(
                cfg.resolution,
                data.labels[rows],
                lambda idx: pca_embedding(
                    data.X, data.domain, scale, offset, seed=cfg.seed, rows=rows[idx]
                ),
                seed=cfg.seed,
            )
            estimate = estimate_n_novel(
                data.X,
                data.labels,
                data.domain,
                scale,
                offset,
                seed=cfg.seed,
                resolution=resolution,
            )
        n_heads0 = n_seen + (estimate["n_novel"] if cfg.n_novel == "auto" else int(cfg.n_novel))
    pair_features = None
    if cfg.pair_space in ("pca", "both"):
        # the unlabelled cells' pairwise partners are chosen (also) in the PCA of the aligned
        # expression: the net's embedding, trained on the seen classes, does not yet separate
        # novel types
        pair_features = pca_embedding(
            data.X, data.domain, scale, offset, n_comps=cfg.pair_pcs, seed=cfg.seed
        )
    result = train(
        data.X, data.labels, data.domain, scale, offset, n_heads0, cfg, hook, pair_features
    )
    estimate = estimate or result.novel_info
    n_novel_heads = result.net.head.weight.shape[0] - n_seen
    logger.info(
        "Novel heads: %d (estimated novel types: %s).", n_novel_heads, estimate.get("n_novel")
    )

    anchor = align_info.get("anchor")
    anchor_rows = data.domain == (anchor if anchor is not None else data.domain[data.labeled][0])
    centroids = class_centroids(data.X[anchor_rows], data.labels[anchor_rows], n_seen)
    model = OrcaModel(
        result.net,
        cfg,
        data.genes,
        data.classes,
        list(data.classes) + [f"_head{i}" for i in range(n_novel_heads)],
        centroids,
        result.history,
    )
    pred = model.predict_arrays(data.X, data.domain, scale, offset)
    unl = ~data.labeled
    counts = np.bincount(pred.head[unl], minlength=n_seen + n_novel_heads)[n_seen:]
    head_names: list[str | None] = list(data.classes) + [None] * n_novel_heads
    # novel clusters that are a known type of another batch are reported as that type
    merged = []
    if cfg.merge_threshold is not None and n_novel_heads > 0:
        clusters = np.where(unl & (pred.head >= n_seen), pred.head - n_seen, -1)
        for h, k, r in match_known_types(
            data.X, data.labels, data.domain, clusters, n_novel_heads, n_seen, cfg.merge_threshold
        ):
            head_names[n_seen + h] = data.classes[k]
            merged.append({"type": data.classes[k], "n_cells": int(counts[h]), "correlation": r})
    # name the other novel heads by size among unlabelled cells; heads with no cells are pruned
    order = [
        h
        for h in np.argsort(-counts, kind="stable")
        if counts[h] > 0 and head_names[n_seen + h] is None
    ]
    for rank, h in enumerate(order):
        head_names[n_seen + h] = f"novel_{rank + 1}"
    model.head_names = head_names
    head = model.assign_heads(pred.probs)  # pruned heads excluded
    labels_all = model.labels_for(head)
    novel_sizes = {head_names[n_seen + h]: int(counts[h]) for h in order}
    similarity = _novel_similarity(data, scale, offset, head, head_names, model.novel_names)
    model.extra = {
        "alignment": _jsonable(align_info),
        "estimate": _jsonable(estimate),
        "novel_similarity": similarity,
        "version": __version__,
    }

    rows = data.output_rows
    write_fields(
        adata,
        key_added,
        labels_all[rows],
        pred.confidence[rows],
        pred.embedding[rows],
        classes=data.classes,
        novel_names=[f"novel_{i + 1}" for i in range(len(order))],
    )
    adata.uns[key_added] = _jsonable(
        {
            "params": {"labels_key": labels_key, **cfg.to_dict()},
            "mode": "single" if reference is None else "reference",
            "seen_classes": list(data.classes),
            "novel_cluster_sizes": novel_sizes,
            "novel_similarity": model.novel_similarity(),
            "merged_into_known": merged,
            "n_novel": {
                "requested": str(cfg.n_novel),
                "estimated": estimate.get("n_novel", -1),
                "heads": n_novel_heads,
                "found": len(order),
            },
            "estimate": estimate,
            "input_scale": data.input_scale,
            "alignment": {**align_info, "batches": data.domain_names},
            "data": data.info,
            "history": {k: np.array([h[k] for h in result.history]) for k in result.history[0]},
            "training": {
                "epochs": result.n_epochs,
                "steps": result.n_steps,
                "seconds": result.seconds,
                "device": result.device,
            },
            "seed": cfg.seed,
            "version": __version__,
        }
    )
    if copy:
        return (adata, model) if return_model else adata
    return model if return_model else None


def _novel_similarity(data, scale, offset, head, head_names, novel_names) -> dict[str, Any]:
    """Centred expression correlation of each novel cluster (its unlabelled cells) with each known
    type (its labelled cells), both after batch alignment.

    Stored as ``{"clusters": [...], "types": [...], "similarity": (n_clusters, n_types)}``: cell
    type names may contain "/" and so cannot be keys of an h5ad group.
    """
    n_seen = len(data.classes)
    n_heads = len(head_names)
    groups = np.where(data.labeled, data.labels, np.where(head >= n_seen, head, -1))
    means = aligned_group_means(data.X, groups, n_heads, data.domain, scale, offset)
    known = means[:n_seen]
    sims = profile_similarity(means[n_seen:], known, known.mean(axis=0))
    order = [head_names.index(name) - n_seen for name in novel_names]
    return {
        "clusters": list(novel_names),
        "types": list(data.classes),
        "similarity": np.round(sims[order], 4).tolist(),
    }


def write_fields(
    adata: Any,
    key_added: str,
    labels: np.ndarray,
    confidence: np.ndarray,
    embedding: np.ndarray,
    *,
    classes: list[str],
    novel_names: list[str],
) -> None:
    """Write ``obs['{key}_label' | '{key}_novel' | '{key}_confidence']`` and ``obsm['X_{key}']``."""
    present = set(labels)
    categories = [c for c in classes if c in present] + [n for n in novel_names if n in present]
    adata.obs[f"{key_added}_label"] = pd.Categorical(labels, categories=categories)
    is_novel = np.isin(labels, novel_names)
    adata.obs[f"{key_added}_novel"] = pd.Categorical(
        np.where(is_novel, labels, None),
        categories=[n for n in novel_names if n in present],
    )
    adata.obs[f"{key_added}_confidence"] = np.asarray(confidence, dtype=np.float32)
    adata.obsm[f"X_{key_added}"] = np.asarray(embedding, dtype=np.float32)


def _init_novel_heads(
    net, data, *, pca_of, labels, domain, domain_names, rows, n_novel, resolution, hidden, seed
):
    """Prototypes of candidate novel clusters (see :func:`orca_sc._train.train`).

    Candidates are clusters of the unlabelled cells that the warmed-up seen heads do not explain
    (:func:`orca_sc._estimate.ood_clusters`; in batches without labelled cells
    :func:`orca_sc._estimate.query_ood_clusters`), and sub-clusters of seen classes that lack their
    share of labels (:func:`orca_sc._estimate.hidden_novel_clusters`); each novel head starts at
    the mean embedding of one.
    """
    rng = np.random.default_rng(seed)
    pcas: dict[bytes, np.ndarray] = {}

    def pca_rows(idx: np.ndarray) -> np.ndarray:
        """PCA of the cells ``rows[idx]``, computed once per set of cells (on single-batch data
        the batch's cells and all cells are the same set).
        """
        key = np.asarray(idx, dtype=np.int64).tobytes()
        if key not in pcas:
            pcas[key] = pca_of(rows=rows[idx])
        return pcas[key]

    _, emb = infer(net, data, rows)  # (n_rows, D), L2-normalised
    seen_w = torch.nn.functional.normalize(net.head.weight.detach(), dim=1).cpu().numpy()
    sims = emb @ seen_w.T  # (n_rows, n_seen) cosine to each seen head
    maxcos = sims.max(axis=1)
    best_seen = sims.argmax(axis=1)
    lab_r = labels[rows]
    dom_r = domain[rows]
    # unlabelled cells among labelled ones (same batch) are of known types, however poorly the
    # seen heads score them
    nb_frac, tested = labelled_neighbours(lab_r >= 0, dom_r, pca_rows)
    supported = labelled_support(lab_r >= 0, dom_r, nb_frac, tested)
    # unlabelled cells among unlabelled ones, in batches labelled at random: a type nobody
    # labelled, even where a seen head scores it confidently
    desert = label_deserts(lab_r >= 0, dom_r, nb_frac, tested)
    # ... but only where labels were given among the batch's cells at random: where almost no
    # unlabelled cell has labelled neighbours, labelled and unlabelled cells are two populations
    # (e.g. a reference and a query concatenated without batch_key) and a lack of labels says
    # nothing
    for d in segregated_batches(lab_r >= 0, dom_r, supported, tested):
        desert[dom_r == d] = False
        where = f" of batch {domain_names[d]!r}" if len(domain_names) > 1 else ""
        warnings.warn(
            f"The labelled and unlabelled cells{where} barely share neighbourhoods (under "
            f"{SEGREGATED_SUPPORT:.0%} of the unlabelled cells have labelled neighbours). If they "
            "come from different samples or technologies, pass batch_key=... (or the reference "
            "as a separate AnnData) so that the unlabelled cells are aligned and treated as a "
            "query; as it is, known types may be reported as novel clusters.",
            stacklevel=2,
        )
    # batches without any labelled cell (a separate query): candidates are voted per cluster
    query = ~np.isin(dom_r, np.unique(dom_r[lab_r >= 0]))
    min_size = min_cluster_size(int((lab_r < 0).sum()))
    # candidates are cut at the granularity of the labelled types
    # (only where labelled and unlabelled cells share a batch: query batches are voted at
    # QUERY_RESOLUTION)
    resolution, scores = resolve_resolution(
        resolution, lab_r, pca_rows, seed=seed, calibrate=bool(((lab_r < 0) & ~query).any())
    )
    assign, sizes, tau = ood_clusters(
        maxcos,
        lab_r >= 0,
        pca_rows,
        resolution=resolution,
        seed=seed,
        exclude=supported | query,
        include=desert,
    )
    groups = []
    if query.any():
        groups = query_ood_clusters(
            maxcos < tau,
            np.flatnonzero(query),
            dom_r,
            pca_rows,
            min_size=min_size,
            resolution=QUERY_RESOLUTION,
            seed=seed,
        )
    n_query = len(groups)
    n_ood = len(sizes) + n_query
    if hidden:
        # novel types that the seen heads absorbed: sub-clusters of a seen class without their
        # share of labelled cells, in batches where cells were labelled
        groups += hidden_novel_clusters(
            np.where(assign >= 0, -1, best_seen),
            lab_r,
            ~query,
            sims.shape[1],
            pca_rows,
            min_size=min_size,
            resolution=resolution,
            seed=seed,
            class_fraction=_class_fraction(nb_frac, tested, lab_r, sims.shape[1]),
            exclude=supported,
        )
    for g in groups:
        assign[g] = len(sizes)
        sizes.append(int(g.size))
    if groups:  # candidates ranked by size, largest first
        order = np.argsort(-np.asarray(sizes), kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        assign = np.where(assign >= 0, rank[np.maximum(assign, 0)], -1)
        sizes = [sizes[i] for i in order]
    k = len(sizes) if n_novel == "auto" else int(n_novel)
    protos = rng.normal(size=(k, emb.shape[1]))
    for j in range(min(k, len(sizes))):
        protos[j] = emb[assign == j].mean(axis=0)
    protos /= np.linalg.norm(protos, axis=1, keepdims=True)
    # prior of the regulariser = estimated composition of all cells over the heads: labelled cells
    # by their label, candidate cells by their cluster, other unlabelled cells by their best seen
    # head after the warm-up (so a known type that is rare in the reference but common in the
    # query keeps its share)
    n_seen = seen_w.shape[0]
    head = np.where(lab_r >= 0, lab_r, best_seen)
    in_cand = (assign >= 0) & (assign < k)
    head = np.where(in_cand, n_seen + assign, head)
    counts = np.bincount(head, minlength=n_seen + k).astype(np.float64)
    core = cluster_cores(np.where(in_cand, assign, -1), pca_rows(np.arange(rows.size)))
    # novel heads without a candidate cluster (n_novel given above the estimate): no evidence of
    # any mass, so their prior is the detection limit (smallest candidate size), not an average
    # cluster; otherwise the regulariser fills them with cells of known types
    empty = counts[n_seen:] == 0
    if empty.any():
        counts[n_seen:][empty] = min_cluster_size(int((lab_r < 0).sum()))
    prior = counts / counts.sum()
    info = {
        "n_novel": len(sizes),
        "cluster_sizes": sizes,
        "n_out_of_distribution": n_ood,
        "n_hidden_in_seen": len(sizes) - n_ood,
        "n_supported_by_labels": int(supported.sum()),
        "n_label_deserts": int(desert.sum()),
        "resolution": resolution,
        "resolution_ari": dict(zip(map(str, RESOLUTION_GRID), scores, strict=False)),
        "n_anchored": int(core.sum()),
        "n_query_clusters": n_query,
        "method": f"Leiden clusters (resolution {resolution:g}) of cells below the 1% quantile of "
        "labelled max cosine or with improbably few labelled neighbours"
        + (
            f"; in batches without labels, Leiden clusters (resolution {QUERY_RESOLUTION:g}) "
            f"of the batch with at least "
            f"{QUERY_MIN_FRACTION:.0%} (or {QUERY_MIN_ENRICHMENT:g}x the batch's share) of such "
            "cells"
            if query.any()
            else ""
        )
        + ("; sub-clusters of seen classes without labelled cells" if hidden else ""),
        "threshold": tau,
        "prior": prior.tolist(),
        # the core cells of each candidate cluster are labelled with its head while anchored
        "anchor": (rows[core], n_seen + assign[core]),
    }
    return torch.as_tensor(protos, dtype=torch.float32), info


def _class_fraction(nb_frac, tested, labels, n_seen) -> np.ndarray | None:
    """Each seen class's labelled fraction: the mean labelled fraction of the neighbourhoods of
    its labelled cells (``None`` when no cell was tested).
    """
    lab = tested & (labels >= 0)
    if not lab.any():
        return None
    sums = np.bincount(labels[lab], weights=nb_frac[lab], minlength=n_seen)
    counts = np.bincount(labels[lab], minlength=n_seen)
    overall = nb_frac[lab].mean()
    return np.where(counts > 0, sums / np.maximum(counts, 1), overall)


def _jsonable(obj: Any) -> Any:
    """Make ``obj`` storable in ``uns`` and JSON: no None, tuples as lists, numpy scalars as Python."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj if v is not None]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj
