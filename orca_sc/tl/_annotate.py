"""``orca_sc.tl.annotate``: open-world annotation of an AnnData (scanpy style)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from .._config import DEFAULT, OrcaConfig, resolve_config
from .._errors import check_anndata, check_copy, check_output_path


def annotate(
    adata: Any,
    reference: Any | None = None,
    *,
    labels_key: str,
    n_novel: int | str = DEFAULT,
    n_genes: int | None = DEFAULT,
    layer: str | None = DEFAULT,
    batch_key: str | None = DEFAULT,
    unlabeled_category: str | tuple[str, ...] = DEFAULT,
    key_added: str = "orca",
    copy: bool = False,
    save_model: str | None = None,
    config: OrcaConfig | None = None,
    ablation: Any | None = None,
    **kwargs: Any,
):
    """Assign every cell to a known cell type or to a newly discovered novel cluster (ORCA).

    Trains one model on labelled and unlabelled cells together (Cao, Brbić & Leskovec, ICLR
    2022): ``annotate(query, reference, labels_key=...)`` annotates every query cell;
    ``annotate(adata, labels_key=...)`` the cells whose label is missing (NaN, ``""``, "nan",
    "none", "null", "<NA>" in any case, or ``unlabeled_category``). Bad input raises
    :class:`orca_sc.OrcaInputError`. Under ``torchrun`` rank 0 saves the model.

    Parameters
    ----------
    adata
        Cells to annotate (counts or log-normalised values), or a list of such queries: one
        model is trained on all, each query is a batch of its own; only the fields below are
        written.
    reference
        Labelled reference AnnData; genes are matched by name.
    labels_key
        ``obs`` column with the cell types.
    n_novel
        Novel heads, or ``"auto"`` (estimated from the data;
        :attr:`OrcaConfig.n_novel <orca_sc.OrcaConfig>`).
    n_genes
        Highly variable genes to train on, or ``None`` for all.
    layer
        Expression layer to read instead of ``X``.
    batch_key
        ``obs`` column with the batches of a query (each aligned to the reference).
    unlabeled_category
        Label value(s) meaning "unlabelled" besides the missing ones.
    key_added
        Prefix of the fields written.
    copy
        Return an annotated copy instead of writing into ``adata``.
    save_model
        Save the trained :class:`orca_sc.OrcaModel` here (for ``tl.predict``).
    config, **kwargs
        A full :class:`~orca_sc.OrcaConfig`; any of its fields or of
        :class:`~orca_sc.DiscoveryConfig`'s given as keywords win over it.
    ablation
        For method studies (the benchmark): an :class:`orca_sc.benchmark.Ablation`, the
        paper's ablations and the method's internal settings. Users leave it out.

    Returns
    -------
    AnnData | list[AnnData] | None
        The annotated copy (a list of them for several queries) if ``copy``, else ``None``.
        Each query gets:

        - ``obs['{key_added}_label']``: a known type or ``novel_1``, ``novel_2``, ... by size;
        - ``obs['{key_added}_novel']``: the novel cluster, NaN for known types;
        - ``obs['{key_added}_confidence']``: for a known type the calibrated probability that
          the label is right, for a novel cluster the probability of its head;
        - ``obs['{key_added}_novelty']``: 0-1, how unlike the labelled cells;
        - ``obs['{key_added}_novelty_pvalue']`` and ``obs['{key_added}_novelty_qvalue']``: the
          conformal novelty test (not with ``novelty_folds=0``);
        - with ``majority_vote=True``: ``obs['{key_added}_label_per_cell']``,
          ``obs['{key_added}_overcluster']`` and ``obs['{key_added}_vote_mixed']``;
        - ``obsm['X_{key_added}']``: the embedding;
        - ``uns['{key_added}_label_colors']`` and ``uns['{key_added}_novel_colors']``: one
          colour per label, as scanpy keeps ``*_colors`` (a known type has the same colour in
          every run on the same reference);
        - ``uns['{key_added}']``: the run's record, ``params``, ``mode``, ``seen_classes``,
          ``novel_cluster_sizes``, ``novel_similarity``, ``merged_into_known``,
          ``same_novel_type``, ``n_novel``, ``estimate``, ``self_check``, ``confidence``,
          ``novelty_test``, ``novel_evidence``, ``majority_vote``, ``queries``,
          ``input_scale``, ``alignment``, ``data``, ``history``, ``training``, ``seed``,
          ``version`` and ``not_made`` (the sections this run did not make).
          :class:`orca_sc.tl.RunRecord` reads it back; the documentation's *Outputs in
          detail* says what each holds.

    """
    from .._dist import main_process
    from .._model import train

    queries = _check_inputs(adata, reference, copy)
    cfg = resolve_config(
        config,
        "annotate()",
        n_novel=n_novel,
        n_genes=n_genes,
        layer=layer,
        batch_key=batch_key,
        unlabeled_category=unlabeled_category,
        **kwargs,
    )
    model_path = check_output_path(save_model, "save_model")
    targets = [q.copy() for q in queries] if copy else queries
    several = isinstance(adata, (list, tuple))
    lab = _check_ablation(ablation)
    model, result = train(targets if several else targets[0], reference, labels_key, cfg, lab)
    ends = np.cumsum([t.n_obs for t in targets])
    names = ["query"] if not several else [f"query_{i + 1}" for i in range(len(targets))]
    counts = {}
    for t, name, stop in zip(targets, names, ends, strict=True):
        _write(t, key_added, result, slice(stop - t.n_obs, stop), model.classes)
        counts[name] = t.obs[f"{key_added}_label"].value_counts()
    # labels x queries (a table, not a dict keyed by label: a label such as "CD4+/CD25-" would
    # be taken as a path when the AnnData is written)
    table = pd.DataFrame(counts).fillna(0).astype(np.int64)
    table.index = table.index.astype(str)
    for t, name in zip(targets, names, strict=True):
        queries = {"this": name, "label_counts": table.copy()}
        t.uns[key_added] = replace(result.record, queries=queries).to_uns()
    if model_path is not None and main_process():
        model.save(model_path)
    if not copy:
        return None
    return targets if several else targets[0]


def _check_ablation(ablation: Any):
    """``ablation`` as an :class:`~orca_sc._ablation.Ablation` (``None``: ORCA's settings)."""
    from .._ablation import LAB, Ablation

    if ablation is None:
        return LAB
    if not isinstance(ablation, Ablation):
        msg = f"annotate(): ablation must be an orca_sc.benchmark.Ablation, got {type(ablation).__name__}."
        raise TypeError(msg)
    return ablation


def _check_inputs(adata: Any, reference: Any, copy: bool) -> list[Any]:
    """The query AnnData objects (one, or the list given), each checked, with the reference."""
    from .._errors import OrcaInputError

    if isinstance(adata, (list, tuple)):
        if not adata:
            raise OrcaInputError("adata is an empty list; pass an AnnData or a list of them.")
        if reference is None:
            msg = (
                "Several queries need a labelled reference: annotate([query1, query2], "
                "reference, labels_key=...)."
            )
            raise OrcaInputError(msg)
        for i, q in enumerate(adata):
            check_anndata(q, f"adata[{i}]")
        if len({id(q) for q in adata}) < len(adata):
            raise OrcaInputError("The same AnnData is given twice in adata; pass each query once.")
        queries = list(adata)
    else:
        check_anndata(adata, "adata", several=True)
        queries = [adata]
    if reference is not None:
        check_anndata(reference, "reference")
    for q in queries:
        check_copy(q, copy)
    return queries


def _write(adata: Any, key_added: str, result: Any, rows: slice, classes: list[str]) -> None:
    """The per-cell fields of ``result`` (an :class:`orca_sc._annotation.Annotation`) for its
    rows ``rows``, into ``adata``.
    """
    write_fields(
        adata, key_added, result.labels[rows], result.confidence[rows], result.novelty[rows],
        result.embedding[rows], classes=classes, novel_names=result.novel_names,
    )  # fmt: skip
    if result.per_cell_labels is not None:  # majority voting: the per-cell labels beside
        write_vote(adata, key_added, result.per_cell_labels[rows], result.vote_cluster[rows],
                   result.vote_mixed[rows], adata.obs[f"{key_added}_label"].cat.categories)  # fmt: skip
    if result.pvalue is not None:
        adata.obs[f"{key_added}_novelty_pvalue"] = result.pvalue[rows].astype(np.float32)
        adata.obs[f"{key_added}_novelty_qvalue"] = result.qvalue[rows].astype(np.float32)


def write_fields(
    adata: Any,
    key_added: str,
    labels: np.ndarray,
    confidence: np.ndarray,
    novelty: np.ndarray,
    embedding: np.ndarray,
    *,
    classes: list[str],
    novel_names: list[str],
) -> None:
    """Write ``obs['{key}_label' | '{key}_novel' | '{key}_confidence' | '{key}_novelty']``,
    ``obsm['X_{key}']`` and the colours of the labels, ``uns['{key}_label_colors']`` and
    ``uns['{key}_novel_colors']`` (:mod:`orca_sc._colors`).
    """
    from .._colors import label_colors

    present = set(labels)
    categories = [c for c in classes if c in present] + [n for n in novel_names if n in present]
    adata.obs[f"{key_added}_label"] = pd.Categorical(labels, categories=categories)
    is_novel = np.isin(labels, novel_names)
    found = [n for n in novel_names if n in present]
    adata.obs[f"{key_added}_novel"] = pd.Categorical(
        np.where(is_novel, labels, None), categories=found
    )
    adata.uns[f"{key_added}_label_colors"] = label_colors(categories, classes, novel_names)
    adata.uns[f"{key_added}_novel_colors"] = label_colors(found, classes, novel_names)
    adata.obs[f"{key_added}_confidence"] = np.asarray(confidence, dtype=np.float32)
    adata.obs[f"{key_added}_novelty"] = np.asarray(novelty, dtype=np.float32)
    adata.obsm[f"X_{key_added}"] = np.asarray(embedding, dtype=np.float32)


def write_vote(
    adata: Any,
    key_added: str,
    per_cell: np.ndarray,
    cluster: np.ndarray,
    mixed: np.ndarray,
    categories: Any,
) -> None:
    """With majority voting: ``obs['{key}_label_per_cell']`` (the label before the vote),
    ``obs['{key}_overcluster']`` (the cluster voted over; NaN for labelled cells) and
    ``obs['{key}_vote_mixed']`` (the cell's cluster had no label of at least half its cells, so
    the cell kept its own label).
    """
    present = set(per_cell)
    cats = [c for c in categories if c in present] + sorted(present - set(categories))
    adata.obs[f"{key_added}_label_per_cell"] = pd.Categorical(per_cell, categories=cats)
    order = [str(c) for c in np.unique(cluster[cluster >= 0])]
    names = np.where(cluster >= 0, cluster.astype(str), None)
    adata.obs[f"{key_added}_overcluster"] = pd.Categorical(names, categories=order)
    adata.obs[f"{key_added}_vote_mixed"] = np.asarray(mixed, dtype=bool)
