"""``orca_sc.tl.annotate``: open-world annotation of an AnnData (scanpy style)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from .._config import DEFAULT, OrcaConfig, resolve_config
from .._errors import check_output_path


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
    **kwargs: Any,
):
    """Assign every cell to a known cell type or to a newly discovered novel cluster (ORCA).

    Trains one model on labelled and unlabelled cells together (Cao, Brbić & Leskovec, ICLR 2022)
    and annotates the unlabelled ones. Two ways to call it:

    * ``annotate(query, reference, labels_key=...)``: the reference's ``obs[labels_key]`` holds the
      known types, every query cell is annotated;
    * ``annotate(adata, labels_key=...)``: cells whose label is NaN or one of
      ``unlabeled_category`` are the query, the others the reference.

    The method runs as stages (:func:`orca_sc._pipeline.fit`): prepare the data, align batches,
    a supervised warm-up, discover candidate novel clusters, the open-world fit; the model
    (:func:`orca_sc._model.train`) then names the clusters and scores novelty, and this function
    writes the results. Under ``torchrun`` every process gets the annotation and only rank 0
    saves the model.

    Parameters
    ----------
    adata
        Cells to annotate (raw counts or log-normalised values in ``.X`` or ``layer``). Only the
        fields listed under Returns are written (nothing with ``copy=True``); the expression
        matrices of ``adata`` and ``reference`` are never modified. Options are checked before
        the data are read; bad input raises :class:`orca_sc.OrcaInputError` (a
        :class:`ValueError`) saying what is wrong.
    reference
        Labelled reference AnnData; genes are matched by name.
    labels_key
        ``obs`` column with the cell types. ``NaN``, ``None`` and the strings ``""``, ``"nan"``,
        ``"none"``, ``"null"``, ``"<NA>"`` (any case, as a NaN looks once a column was turned
        into strings) mean unlabelled, like ``unlabeled_category``. A class named like a
        novel cluster (``novel_1``: an annotated query used as a reference) stays a known type;
        the run's own novel clusters are numbered past it.
    n_novel
        Expected number of novel types, or ``"auto"`` (default) to estimate it from the data.
        Novel heads that receive no cells are dropped from the output.
    n_genes
        Number of highly variable genes to train on (default 2000; ``None``: all shared genes).
    layer
        Use ``layers[layer]`` instead of ``.X`` (in both AnnData objects).
    batch_key
        ``obs`` column with batches, for batch-aware gene selection and alignment.
    unlabeled_category
        Label values that mean "unlabelled" (default ``("Unknown",)``).
    key_added
        Prefix of the fields written (see Returns).
    copy
        Return an annotated copy instead of writing into ``adata``.
    save_model
        Save the trained :class:`orca_sc.OrcaModel` to this file (for ``tl.predict`` or
        ``orca-sc predict``). To keep the model in Python, use :meth:`orca_sc.OrcaModel.fit`.
    config
        A full :class:`orca_sc.OrcaConfig`. Every keyword given explicitly (those above and any
        :class:`~orca_sc.OrcaConfig` or :class:`~orca_sc.DiscoveryConfig` field in ``**kwargs``:
        ``epochs``, ``seed``, ``device``, ``merge_threshold``, ...) wins over it.

    Returns
    -------
    The annotated copy if ``copy``, else ``None``. Writes to ``adata``:

    ``obs['{key_added}_label']``
        Categorical, every cell: a reference cell type or a novel cluster ``novel_1``, ``novel_2``,
        ... (numbered by size, largest first).
    ``obs['{key_added}_novel']``
        Categorical: the novel cluster for cells in novel clusters, NaN for cells of known types.
    ``obs['{key_added}_confidence']``
        Maximum softmax probability (0-1).
    ``obs['{key_added}_novelty']``
        How unlike every known type the cell is (0-1): the share of the reference's labelled
        cells that are less similar to their nearest seen head than this cell is to its own,
        subtracted from 1 (cosine in the model's embedding). About uniform on cells of known
        types; near 1 for cells less like any known type than almost every labelled cell.
    ``obsm['X_{key_added}']``
        The L2-normalised cell embedding of the backbone.
    ``uns['{key_added}']``
        ``params`` (the configuration with its ``discovery`` rules, and ``labels_key``),
        ``mode`` (``"single"`` or ``"reference"``), ``seen_classes``, ``novel_cluster_sizes``
        (unlabelled cells per novel cluster), ``novel_similarity`` (each novel cluster's
        expression correlation with each known type), ``merged_into_known`` (novel clusters
        reported as a known type of another batch: columns ``cluster``, ``type``, ``n_cells``,
        ``correlation``), ``n_novel`` (requested / estimated / heads used / found), ``estimate``
        (what the discover stage found: candidate sizes, how many came from query-batch
        clusters, cells supported by labels and label deserts, anchored cells,
        the Leiden resolution and its calibration scores, the threshold), ``self_check`` (with
        ``self_check=True``: the known types hidden, the share of their cells the discover rules
        called novel, the share of held-out known-type cells they called novel, the hidden
        types' clustering accuracy, clusters found against types hidden, the threshold beside
        the best cut on the hidden cells (Youden), and notes), ``input_scale``
        (detected per input), ``alignment`` (method and batches), ``data`` (labelled and
        unlabelled cells, shared and used genes), ``history`` (per-epoch losses, uncertainty,
        margin, warm-up and anchor flags, steps), ``training`` (epochs, steps, seconds of
        training and of discovery, device), ``seed`` and ``version``. Every field can be
        written with ``adata.write_h5ad``.

    """
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
    adata = adata.copy() if copy else adata
    from .._dist import main_process
    from .._model import train

    model, result = train(adata, reference, labels_key, cfg)
    write_fields(
        adata, key_added, result.labels, result.confidence, result.novelty, result.embedding,
        classes=model.classes, novel_names=result.novel_names,
    )  # fmt: skip
    adata.uns[key_added] = result.uns
    if model_path is not None and main_process():
        model.save(model_path)
    return adata if copy else None


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
    """Write ``obs['{key}_label' | '{key}_novel' | '{key}_confidence' | '{key}_novelty']`` and
    ``obsm['X_{key}']``.
    """
    present = set(labels)
    categories = [c for c in classes if c in present] + [n for n in novel_names if n in present]
    adata.obs[f"{key_added}_label"] = pd.Categorical(labels, categories=categories)
    is_novel = np.isin(labels, novel_names)
    adata.obs[f"{key_added}_novel"] = pd.Categorical(
        np.where(is_novel, labels, None),
        categories=[n for n in novel_names if n in present],
    )
    adata.obs[f"{key_added}_confidence"] = np.asarray(confidence, dtype=np.float32)
    adata.obs[f"{key_added}_novelty"] = np.asarray(novelty, dtype=np.float32)
    adata.obsm[f"X_{key_added}"] = np.asarray(embedding, dtype=np.float32)
