"""``orca_sc.tl.predict``: annotate new cells with a trained model, without retraining."""

from __future__ import annotations

from typing import Any

from .._annotation import predict_record
from .._errors import check_anndata, check_copy
from .._model import OrcaModel
from ._annotate import write_fields


def predict(
    adata: Any,
    model: OrcaModel | str,
    *,
    layer: str | None = None,
    batch_key: str | None = None,
    key_added: str = "orca",
    device: str | None = None,
    copy: bool = False,
):
    """Label new cells with a trained :class:`orca_sc.OrcaModel` (no retraining).

    Each cell gets the known type or the novel cluster (as named when the model was trained) of
    its most probable head. Genes are matched by name; a model gene missing from ``adata`` is set
    to zero, and fewer than half of the model's genes present is an error
    (:data:`orca_sc._model.MIN_GENE_FRACTION`). The batch shift of the new cells is corrected
    against the reference as during training.

    Parameters
    ----------
    adata
        Cells to label (raw counts or log-normalised values in ``.X`` or ``layer``).
    model
        A trained model, or the path of one saved with :meth:`orca_sc.OrcaModel.save`.
    layer
        Use ``layers[layer]`` instead of ``.X`` (default: the layer the model was trained on).
    batch_key
        ``obs`` column with batches of the new cells; each is aligned to the reference separately.
    key_added
        Prefix of the fields written.
    device
        Device for inference (default: the model's configured device).
    copy
        Return an annotated copy instead of writing into ``adata``.

    Returns
    -------
    AnnData | None
        The annotated copy if ``copy``, else ``None``. Writes the same ``obs`` and ``obsm``
        fields as :func:`orca_sc.tl.annotate` and ``uns['{key_added}']`` with
        ``mode='predict'``, ``seen_classes``, ``novel_cluster_sizes`` (cells in each novel
        cluster here), ``novel_similarity``, ``input_scale``, ``n_genes_missing`` and
        ``version``.

    """
    check_anndata(adata, "adata")
    check_copy(adata, copy)
    if not isinstance(model, OrcaModel):
        model = OrcaModel.load(model)
    adata = adata.copy() if copy else adata
    labels, pred, info = model.predict(adata, layer=layer, batch_key=batch_key, device=device)
    novel = model.novel_names
    write_fields(
        adata,
        key_added,
        labels,
        model.confidence(pred),
        model.novelty(pred.embedding),
        pred.embedding,
        classes=model.classes,
        novel_names=novel,
    )
    adata.uns[key_added] = predict_record(model, labels, info).to_uns()
    return adata if copy else None
