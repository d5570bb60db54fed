"""``orca_sc.tl.annotate``: open-world annotation of an AnnData (scanpy style)."""

from __future__ import annotations

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
        Cells to annotate (counts or log-normalised values); only the fields below are written.
    reference
        Labelled reference AnnData; genes are matched by name.
    labels_key
        ``obs`` column with the cell types.
    n_novel, n_genes, layer, batch_key, unlabeled_category
        The :class:`~orca_sc.OrcaConfig` fields: novel heads or ``"auto"``, highly variable
        genes or ``None``, expression layer, batch column, labels meaning "unlabelled".
    key_added
        Prefix of the fields written.
    copy
        Return an annotated copy instead of writing into ``adata``.
    save_model
        Save the trained :class:`orca_sc.OrcaModel` here (for ``tl.predict``).
    config, **kwargs
        A full :class:`~orca_sc.OrcaConfig`; any of its fields or of
        :class:`~orca_sc.DiscoveryConfig`'s given as keywords win over it.

    Returns
    -------
    The annotated copy if ``copy``, else ``None``. Writes ``obs['{key_added}_label']`` (a type or
    ``novel_1``, ``novel_2``, ... by size), ``obs['{key_added}_novel']`` (NaN for known types),
    ``obs['{key_added}_confidence']`` (max softmax), ``obs['{key_added}_novelty']`` (0-1),
    ``obs['{key_added}_novelty_pvalue']`` and ``_qvalue`` (the conformal novelty test; not with
    ``novelty_folds=0``), ``obsm['X_{key_added}']`` (embedding), ``uns['{key_added}']``:
    ``params``, ``mode``, ``seen_classes``, ``novel_cluster_sizes``, ``novel_similarity``,
    ``merged_into_known``, ``n_novel``, ``estimate``, ``self_check``, ``novelty_test``,
    ``input_scale``, ``alignment``, ``data``,
    ``history``, ``training``, ``seed``, ``version`` (see the README's Outputs).

    """
    from .._dist import main_process
    from .._model import train

    check_anndata(adata, "adata")
    if reference is not None:
        check_anndata(reference, "reference")
    check_copy(adata, copy)
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
    model, result = train(adata, reference, labels_key, cfg)
    write_fields(
        adata, key_added, result.labels, result.confidence, result.novelty, result.embedding,
        classes=model.classes, novel_names=result.novel_names,
    )  # fmt: skip
    if result.pvalue is not None:
        adata.obs[f"{key_added}_novelty_pvalue"] = result.pvalue.astype(np.float32)
        adata.obs[f"{key_added}_novelty_qvalue"] = result.qvalue.astype(np.float32)
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
