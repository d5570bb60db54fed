"""ORCA as explicit stages: prepare -> align -> warm-up -> discover -> open-world fit -> predict
-> name. :func:`fit` runs them on AnnData and returns the trained :class:`OrcaModel` and the
:class:`Annotation` of the cells; ``tl.annotate`` writes the annotation, ``OrcaModel.fit`` keeps
the model. Each stage is a function of arrays in its own module: data preparation
(:mod:`orca_sc._data`, the only one that reads AnnData), alignment (:mod:`orca_sc._align`),
training (:mod:`orca_sc._train`) and discovery (:mod:`orca_sc._discover`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import __version__
from ._align import aligned_group_means, class_centroids, compute_transform, profile_similarity
from ._config import DISCOVERY_FIELDS, OrcaConfig, _is_int
from ._data import OrcaInputError, prepare
from ._discover import (
    Discovery,
    calibration_split,
    discover,
    discover_without_warmup,
    match_known_types,
    name_heads,
    pca_embedding,
    probe_threshold,
    self_check_report,
    self_check_split,
    subsample_rows,
)
from ._dist import Comm, init_from_env, rank_device
from ._model import OrcaModel
from ._train import (
    CellMatrix,
    NovelHeads,
    TrainRandom,
    fit_open_world,
    fit_warmup,
    infer,
    resolve_device,
    schedule,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Annotation:
    """Per-cell results for the rows of the AnnData being annotated, plus run details (``uns``)."""

    labels: np.ndarray  # (n,) known type or novel cluster name
    confidence: np.ndarray  # (n,) max softmax
    novelty: np.ndarray  # (n,) see OrcaModel.novelty
    embedding: np.ndarray  # (n, D)
    novel_names: list[str]
    uns: dict[str, Any]


def fit(adata: Any, reference: Any | None, labels_key: str, cfg: OrcaConfig):
    """Train ORCA on ``adata`` (+ ``reference``) and annotate ``adata``'s cells.

    Returns ``(model, annotation)``.

    Under ``torchrun`` (or in a process group the caller initialised) the ranks train one model
    together (:mod:`orca_sc._dist`); every rank returns the same model and annotation.
    """
    comm = init_from_env(cfg.device)
    device = resolve_device(rank_device(cfg.device, comm))  # options first, then the data
    if comm.active and not comm.main:
        cfg = cfg.replace(progress=False)
    data = prepare(adata, reference, labels_key, cfg, comm)
    n_seen = len(data.classes)
    scale, offset, align_info = comm.on_main(
        lambda: compute_transform(
            cfg.alignment, data.X, data.labels, data.domain, len(data.domain_names), n_seen
        )
    )
    cells = CellMatrix(data.X, data.domain, scale, offset, device)
    plan, rand = schedule(data.n_cells, cfg), TrainRandom(cfg.seed, device)

    # labelled cells held out of the warm-up calibrate the out-of-distribution threshold
    dc = cfg.discovery
    calib = calibration_split(
        data.labels, dc.calibration_fraction, dc.calibration_max_cells, cfg.seed
    )
    probe = dc.calibration_probe and calib.any() and plan.warmup > 0
    t0 = time.perf_counter()
    held = np.zeros_like(calib) if probe else calib  # with a probe every label trains the net
    net, history = fit_warmup(cells, np.where(held, -1, data.labels), n_seen, cfg, plan, rand, comm)
    cap = None
    if probe:  # cross-fitting: a second warm-up without the held-out cells caps the threshold
        probe_net, _ = fit_warmup(
            cells, np.where(calib, -1, data.labels), n_seen, cfg, plan,
            TrainRandom(cfg.seed + 1, device), comm,
        )  # fmt: skip
        lab = np.flatnonzero(data.labeled)
        cos = _seen_similarity(probe_net, cells, lab, comm)[1].max(axis=1)
        cap = comm.on_main(lambda: probe_threshold(cos, ~calib[lab], calib[lab], dc))
    check = _self_check(cells, data, scale, offset, cfg, plan, comm) if dc.self_check else None
    t1 = time.perf_counter()
    found, rows, _ = _discover(
        net, cells, data, scale, offset, cfg, held, comm, warmed_up=plan.warmup > 0, ood_cap=cap
    )
    t2 = time.perf_counter()
    novel = NovelHeads(found.prototypes, found.prior, rows[found.anchor_cells], found.anchor_heads)
    pairs = comm.on_main(lambda: _pair_features(data, scale, offset, cfg))
    net, history_ow = fit_open_world(net, cells, data.labels, novel, cfg, plan, rand, pairs, comm)
    t3 = time.perf_counter()
    logger.info("Novel heads: %d (estimated novel types: %d).", found.n_heads, found.n_novel)
    notes = found.diagnostics.get("notes", []) + (check or {}).get("notes", [])
    for note in notes:  # where the data cannot support a call
        logger.warning(note)

    anchor = align_info.get("anchor")
    anchor_rows = data.domain == (anchor if anchor is not None else data.domain[data.labeled][0])
    model = OrcaModel(
        net,
        cfg,
        data.genes,
        data.classes,
        list(data.classes) + [f"_head{i}" for i in range(found.n_heads)],
        # labels outside the anchor batch masked instead of a copy of its rows (same sums)
        class_centroids(data.X, np.where(anchor_rows, data.labels, -1), n_seen),
        history + history_ow,
    )
    pred = model.predict_cells(cells, comm)
    layout, density = cells.layout, cells.density
    del cells  # the training matrix on the device
    names, merged, order = _name(data, pred.head, found.n_heads, cfg)
    model.head_names = names
    model.calibrate_novelty(pred.embedding[data.labeled])
    head = model.assign_heads(pred.probs)  # pruned heads excluded
    labels_all = model.labels_for(head)
    similarity = _novel_similarity(data, scale, offset, head, names, model.novel_names)
    estimate = _jsonable(found.diagnostics)
    model.extra.update(
        {
            "alignment": _jsonable(align_info),
            "estimate": estimate,
            "novel_similarity": similarity,
            "version": __version__,
        }
    )
    counts = np.bincount(head[~data.labeled], minlength=len(names))
    out = data.output_rows
    uns = {
        "params": {"labels_key": labels_key, **cfg.to_dict()},
        "mode": "single" if reference is None else "reference",
        "seen_classes": list(data.classes),
        "novel_cluster_sizes": {n: int(counts[names.index(n)]) for n in model.novel_names},
        "novel_similarity": similarity,
        "merged_into_known": merged,
        "n_novel": {
            "requested": str(cfg.n_novel),
            "estimated": found.n_novel,
            "heads": found.n_heads,
            "found": len(order),
        },
        "estimate": estimate,
        "self_check": check,
        "input_scale": data.input_scale,
        "alignment": {**align_info, "batches": data.domain_names},
        "data": data.info,
        "history": {k: np.array([h[k] for h in model.history]) for k in model.history[0]},
        "training": {
            "epochs": plan.n_epochs,
            "steps": int(sum(h["steps"] for h in model.history)),
            "seconds": (t1 - t0) + (t3 - t2),
            "discovery_seconds": t2 - t1,
            "device": str(device),
            "layout": layout,
            "density": density,  # share of non-zeros of the training matrix
            "processes": comm.world,
        },
        "seed": cfg.seed,
        "version": __version__,
    }
    annotation = Annotation(
        labels=labels_all[out],
        confidence=pred.confidence[out],
        novelty=model.novelty(pred.embedding[out]),
        embedding=pred.embedding[out],
        novel_names=model.novel_names,
        uns=_jsonable(uns),
    )
    return model, annotation


def _seen_similarity(
    net, cells, idx: np.ndarray, comm: Comm | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The L2-normalised embedding of the cells ``idx`` ``(n, D)`` and their cosine to each seen
    head of ``net`` ``(n, n_seen)`` (the net has no novel heads yet).
    """
    _, emb = infer(net, cells, idx, comm)
    seen_w = torch.nn.functional.normalize(net.head.weight.detach(), dim=1).cpu().numpy()
    return emb, emb @ seen_w.T


def _self_check(cells, data, scale, offset, cfg, plan, comm) -> dict[str, Any]:
    """The run-time self-check (``discovery.self_check``): a second warm-up without some known
    types and some known-type cells (:func:`orca_sc._discover.self_check_split`), the discover
    stage on it, and how the rules did (:func:`orca_sc._discover.self_check_report`).
    """
    dc = cfg.discovery
    split = self_check_split(
        data.labels, data.domain, type_fraction=dc.self_check_types,
        known_fraction=dc.self_check_known, min_cells=dc.n_neighbors, seed=cfg.seed,
    )  # fmt: skip
    if split is None:
        msg = (
            f"no known type can be hidden: it needs three known types, one of them with at "
            f"least {dc.n_neighbors} labelled cells"
        )
        return {"skipped": msg, "notes": []}
    t0 = time.perf_counter()
    n_keep = int(split.labels.max()) + 1
    rand = TrainRandom(cfg.seed + 2, cells.device)
    net, _ = fit_warmup(cells, split.labels, n_keep, cfg, plan, rand, comm)
    with warnings.catch_warnings():  # the probe's own notes are not the user's
        warnings.simplefilter("ignore")
        found, rows, maxcos = _discover(
            net, cells, data, scale, offset, cfg, np.zeros_like(split.novel), comm,
            warmed_up=True, labels=split.labels, domain=split.domain,
        )  # fmt: skip
    report = comm.on_main(
        lambda: self_check_report(
            found.assign, maxcos, found.diagnostics["threshold"], data.labels[rows],
            split.subset(rows), data.classes, dc,
        )
    )  # fmt: skip
    report["seconds"] = time.perf_counter() - t0
    return report


def _discover(
    net,
    cells,
    data,
    scale,
    offset,
    cfg,
    calib,
    comm,
    *,
    warmed_up,
    ood_cap=None,
    labels=None,
    domain=None,
) -> tuple[Discovery, np.ndarray, np.ndarray | None]:
    """The discover stage on (at most ``discovery.max_cells``) cells ``rows``: returns what it
    found, with indices into ``rows``, ``rows``, and their best cosine to a seen head (``None``
    without a warm-up). ``labels`` and ``domain`` replace the data's (the self-check hides some).
    """
    labels = data.labels if labels is None else labels
    domain = data.domain if domain is None else domain
    dc = cfg.discovery
    rows = subsample_rows(data.n_cells, cfg.seed, dc.max_cells)

    def pca_of(idx: np.ndarray) -> np.ndarray:
        return pca_embedding(
            data.X, data.domain, scale, offset, n_comps=dc.n_pcs, seed=cfg.seed, rows=rows[idx]
        )

    if not warmed_up:
        dim = cfg.hidden_dims[1]
        found = comm.on_main(
            lambda: discover_without_warmup(
                labels[rows], pca_of, dim, n_novel=cfg.n_novel, cfg=dc, seed=cfg.seed
            )
        )
        return found, rows, None
    emb, seen_similarity = _seen_similarity(net, cells, rows, comm)
    found = comm.on_main(  # a decision: made once, on rank 0
        lambda: discover(
            emb,
            seen_similarity,
            labels[rows],
            domain[rows],
            pca_of,
            calibration=calib[rows],
            ood_cap=ood_cap,
            n_novel=cfg.n_novel,
            cfg=dc,
            seed=cfg.seed,
            domain_names=[*data.domain_names, "self-check"],
        )
    )
    return found, rows, seen_similarity.max(axis=1)


def _pair_features(data, scale, offset, cfg) -> np.ndarray | None:
    """The unlabelled cells' pairwise partners are chosen (also) in the PCA of the aligned
    expression (``pair_space``): the net's embedding, trained on the seen classes, does not yet
    separate novel types.
    """
    if cfg.pair_space not in ("pca", "both"):
        return None
    return pca_embedding(data.X, data.domain, scale, offset, n_comps=cfg.pair_pcs, seed=cfg.seed)


def _name(data, pred_head, n_novel_heads, cfg):
    """Names of all heads; novel clusters that are a known type of another batch carry its name.

    Returns ``(names, merged, order)``: ``merged`` is column-wise (``cluster``, ``type``,
    ``n_cells``, ``correlation``: one entry per merged cluster), so that it can be stored in an
    h5ad file.
    """
    n_seen = len(data.classes)
    unl = ~data.labeled
    counts = np.bincount(pred_head[unl], minlength=n_seen + n_novel_heads)[n_seen:]
    pairs = []
    if cfg.discovery.merge_threshold is not None and n_novel_heads > 0:
        clusters = np.where(unl & (pred_head >= n_seen), pred_head - n_seen, -1)
        pairs = match_known_types(
            data.X,
            data.labels,
            data.domain,
            clusters,
            n_novel_heads,
            n_seen,
            cfg.discovery.merge_threshold,
        )
    names, order = name_heads(counts, data.classes, pairs)
    merged = {
        "cluster": [f"head_{h}" for h, _, _ in pairs],
        "type": [data.classes[k] for _, k, _ in pairs],
        "n_cells": [int(counts[h]) for h, _, _ in pairs],
        "correlation": [round(r, 4) for _, _, r in pairs],
    }
    return names, merged, order


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


# ------------------------------------------------------------------------------- configuration
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
    if "return_model" in options:
        msg = (
            f"{where}: return_model was removed in orca_sc 0.2. Save the trained model with "
            "save_model='model.pt', or train it with orca_sc.OrcaModel.fit(...)."
        )
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


def check_output_path(path: Any, what: str) -> Any:
    """Refuse, before any work, a path that cannot be written."""
    from pathlib import Path

    if path is None:
        return None
    p = Path(path)
    if str(path) == "" or p.is_dir():
        msg = f"{what} {str(path)!r} is a directory or empty; give a file name (e.g. model.pt)."
        raise OrcaInputError(msg)
    if not p.parent.is_dir():
        msg = f"{what} {str(path)!r}: the folder {str(p.parent)!r} does not exist; create it first."
        raise OrcaInputError(msg)
    return p


def _jsonable(obj: Any) -> Any:
    """Make ``obj`` storable in ``uns`` and JSON: no None, tuples as lists, numpy scalars as Python."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj if v is not None]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj
