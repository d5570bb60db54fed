"""What an annotation hands back to AnnData: the per-cell arrays and the run's record
(``uns``), laid out here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from . import __version__
from ._discover.evidence import evidence_note, novel_evidence
from ._notes import Note, note_fields, stored_notes

#: sections of a prediction's record that an annotation never has, and the reverse
_PREDICT_ONLY = frozenset({"n_genes_missing", "model_version"})
_ANNOTATE_ONLY = frozenset({"queries"})


@dataclass(frozen=True)
class RunRecord:
    """The record of a run, ``uns['{key_added}']``, as a typed object. It is made in one place
    (:func:`annotate_record`, :func:`predict_record`) and turned into ``uns`` in one place
    (:meth:`to_uns`); readers take it back with :meth:`from_uns`.

    A section that is ``None`` was not made by the run: the self-check, the novelty test and
    the majority vote are options, and a prediction trains nothing. In ``uns`` such a section is
    absent and its name is listed in ``not_made`` (an h5ad file that holds a ``None`` cannot be
    read by anndata before 0.12); :meth:`from_uns` gives ``None`` for it, as for a section an
    older version did not write.
    """

    mode: str  # "single", "reference" or "predict"
    params: dict[str, Any]
    seen_classes: list[str]
    novel_cluster_sizes: dict[str, int]
    novel_similarity: dict[str, Any]
    version: str
    merged_into_known: dict[str, list] | None = None
    same_novel_type: dict[str, list] | None = None
    n_novel: dict[str, Any] | None = None
    estimate: dict[str, Any] | None = None
    self_check: dict[str, Any] | None = None
    novelty_test: dict[str, Any] | None = None
    novel_evidence: dict[str, list] | None = None
    confidence: dict[str, Any] | None = None
    majority_vote: dict[str, Any] | None = None
    input_scale: Any = None
    alignment: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    history: dict[str, Any] | None = None
    training: dict[str, Any] | None = None
    seed: int | None = None
    n_genes_missing: int | None = None  # predict: genes of the model absent from the data
    model_version: str | None = None  # predict: the version that trained the model
    queries: dict[str, Any] | None = None  # several queries: this one's name, labels x queries

    def to_uns(self) -> dict[str, Any]:
        """The record as ``uns`` stores it (JSON-able values; ``not_made`` names the sections
        that are ``None``).
        """
        out: dict[str, Any] = {}
        not_made = []
        other_mode = _ANNOTATE_ONLY if self.mode == "predict" else _PREDICT_ONLY
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = jsonable(value)
            elif f.name not in other_mode:
                not_made.append(f.name)
        out["not_made"] = not_made
        return out

    @classmethod
    def from_uns(cls, uns: Any) -> RunRecord:
        """The record in ``uns['{key_added}']`` (``{}`` or an older version's record: the
        sections it lacks are ``None``, the required ones empty).
        """
        uns = dict(uns or {})
        names = {f.name for f in fields(cls)}
        given = {k: v for k, v in uns.items() if k in names}
        empty = {"mode": "", "params": {}, "seen_classes": [], "novel_cluster_sizes": {},
                 "novel_similarity": {}, "version": "?"}  # fmt: skip
        return cls(**{**empty, **given})

    @property
    def notes(self) -> list[Note]:
        """Where the data cannot support a call: discovery's notes, naming's (heads pruned,
        clusters kept known), the novelty test's, the self-check's, then the novel clusters
        the data are too thin to call. Each is its paragraph with its one line
        (:class:`orca_sc._notes.Note`).
        """
        notes = [
            n
            for section in (self.estimate, self.n_novel, self.novelty_test, self.self_check)
            for n in stored_notes(section)
        ]
        thin = evidence_note(self.novel_evidence) if self.novel_evidence else None
        return notes if thin is None else [*notes, thin]


@dataclass(frozen=True)
class Annotation:
    """Per-cell results for the rows of the AnnData being annotated, plus the run's record."""

    labels: np.ndarray  # (n,) known type or novel cluster name
    confidence: np.ndarray  # (n,) see orca_sc._model._confidence
    novelty: np.ndarray  # (n,) see OrcaModel.novelty
    embedding: np.ndarray  # (n, D)
    novel_names: list[str]
    record: RunRecord
    pvalue: np.ndarray | None = None  # (n,) conformal novelty p-value (NaN: labelled cell)
    qvalue: np.ndarray | None = None  # (n,) its Benjamini-Hochberg q-value over the query
    per_cell_labels: np.ndarray | None = None  # (n,) before majority voting (None: no vote)
    vote_cluster: np.ndarray | None = None  # (n,) over-cluster of the vote (-1: not voted)
    vote_mixed: np.ndarray | None = None  # (n,) the cell's over-cluster is mixed (label kept)


@dataclass(frozen=True)
class Naming:
    """How the novel heads were named: novel clusters merged into a known type of another batch
    (column-wise: ``cluster``, ``type``, ``n_cells``, ``correlation``, and ``n_type_cells``,
    ``p_beside``, ``beside`` of the check against the type's own query cells,
    ``raw_correlation`` and ``n_type_labelled``, so that it can be stored in an h5ad file), the
    novel heads in name order, and novel heads of different batches that are one type and
    share a name (``cluster``, ``same_as``, ``name``, ``correlation``).
    """

    merged: dict[str, list]
    order: list[int]
    same: dict[str, list]  # novel heads of several batches that are one type (column-wise)
    pruned: list[int] = field(default_factory=list)  # cells of each head too small for a cluster
    notes: list = field(default_factory=list)  # heads pruned, clusters kept known though apart


@dataclass(frozen=True)
class NoveltyTest:
    """The conformal novelty test of a run (:mod:`orca_sc._conformal`): every cell's p- and
    q-value (NaN for labelled cells), its record for ``uns`` and notes for the user.
    """

    pvalue: np.ndarray
    qvalue: np.ndarray
    record: dict[str, Any]
    notes: list[str]


def novelty_test(pvalues: np.ndarray | None, labels: np.ndarray, labeled: np.ndarray,
                 novel_names: list[str], cfg: Any,
                 batches: tuple[np.ndarray, list[str]] | None = None) -> NoveltyTest | None:  # fmt: skip
    """``uns['orca']['novelty_test']`` and the q-values from the cross-fitted p-values of the
    run's cells (``None``: not computed); ``labels``: every cell's output label; ``cfg``: the
    :class:`orca_sc.DiscoveryConfig`; ``batches``: every cell's batch code and the batches'
    names, for the check of the test's premise per batch (:func:`orca_sc._conformal.premise_check`;
    ``None``: one batch).
    """
    import pandas as pd

    from ._conformal import benjamini_hochberg, cell_calls, cluster_support, premise_check

    if pvalues is None:
        return None
    unl = ~labeled
    qvalues = np.full(pvalues.shape, np.nan)
    qvalues[unl] = benjamini_hochberg(pvalues[unl])
    n_cal = int(labeled.sum())
    clusters = pd.Index(novel_names, dtype=object).get_indexer(labels[unl]).astype(np.int64)
    alpha = cfg.novelty_alpha
    batch, names = batches if batches is not None else (np.zeros(labels.size, np.int64), ["all"])
    p_unl, b_unl = pvalues[unl], batch[unl]
    premise, said, failing = premise_check(p_unl, clusters < 0, b_unl, names, alpha, n_cal)
    # a cluster whose (main) batch fails the premise is compared with that batch's known cells
    baseline = [failing.get(int(np.bincount(b_unl[clusters == j]).argmax()))
                if (clusters == j).any() else None for j in range(len(novel_names))]  # fmt: skip
    table, notes = cluster_support(p_unl, clusters, novel_names, alpha, n_cal, baseline)
    calls, cell_notes = cell_calls(p_unl, qvalues[unl], alpha, n_cal)
    # where the premise fails its note already says to read the p-values as a ranking
    notes = said + notes + ([] if failing else cell_notes)
    record = {
        "alpha": alpha,
        "folds": cfg.novelty_folds,
        "n_calibration": n_cal,
        "smallest_pvalue": 1.0 / (n_cal + 1),
        "share_p_below_alpha": float(np.mean(p_unl <= alpha)) if p_unl.size else 0.0,
        "share_q_below_alpha": float(np.mean(qvalues[unl] <= alpha)) if unl.any() else 0.0,
        **calls,
        "clusters": table,
        "premise": premise,
        **note_fields(notes),
    }
    return NoveltyTest(pvalues, qvalues, record, notes)


def annotate_record(fit: Any, model: Any, head: np.ndarray, naming: Naming, labels_key: str,
                    mode: str, test: NoveltyTest | None, confidence: dict[str, Any],
                    majority_vote: dict[str, Any] | None = None) -> RunRecord:  # fmt: skip
    """The record (``uns['orca']``) of :func:`orca_sc.tl.annotate` (every field is listed in its
    docstring).

    ``fit``: the :class:`orca_sc._pipeline.Fit`; ``model``: its named
    :class:`orca_sc.OrcaModel`; ``head``: every cell's head; ``mode``: ``"single"`` or
    ``"reference"``.
    """
    data, cfg, found, t = fit.data, fit.config, fit.found, fit.timings
    names = model.head_names
    counts = np.bincount(head[~data.labeled], minlength=len(names))
    sizes = {n: int(counts[names.index(n)]) for n in model.novel_names}
    n_labelled = np.bincount(data.labels[data.labeled], minlength=len(data.classes))
    similarity = model.novel_similarity()
    evidence = novel_evidence(model.novel_names, sizes, similarity, n_labelled,
                              test.record if test is not None else None,
                              cfg.discovery.n_neighbors)  # fmt: skip
    lab = fit.lab.changes()  # the method's settings where a study changed them
    return RunRecord(
        params={"labels_key": labels_key, **cfg.to_dict(), **({"ablation": lab} if lab else {})},
        mode=mode,
        seen_classes=list(data.classes),
        novel_cluster_sizes=sizes,
        novel_similarity=similarity,
        merged_into_known=naming.merged,
        same_novel_type=naming.same,
        n_novel={
            "requested": str(cfg.n_novel),
            "estimated": found.n_novel,
            "heads": found.n_heads,
            "found": len(naming.order),
            # the unlabelled cells of each head that won fewer than min_novel_cells (no cluster)
            "pruned": list(naming.pruned),
            **note_fields(naming.notes),
        },
        estimate=model.estimate,
        self_check=fit.self_check,
        novelty_test=test.record if test is not None else None,
        novel_evidence=evidence,
        confidence=confidence,
        majority_vote=majority_vote,
        input_scale=data.input_scale,
        alignment={**fit.transform.info, "batches": data.domain_names},
        data=data.info,
        history={k: np.array([h[k] for h in fit.history]) for k in fit.history[0]},
        training={
            "epochs": fit.plan.n_epochs,
            "steps": int(sum(h["steps"] for h in fit.history)),
            "phases": training_phases(fit.history, fit.plan, fit.lab),
            "seconds": t.training,
            "discovery_seconds": t.discovery,
            "novelty_test_seconds": t.novelty,
            **fit.training,
        },
        seed=cfg.seed,
        version=__version__,
    )


def training_phases(history: list[dict], plan: Any, lab: Any) -> dict[str, dict[str, Any]]:
    """Per phase of training (``warm-up``, ``open-world``): the steps it ran and its schedule's,
    why it stopped (``converged`` by the stopping rule, or ``schedule``: every epoch ran), and
    the last check's figures: share of the sampled cells whose head changed, the loss's fall
    over the last window and two standard errors of it.
    """
    out = {}
    for name, warm in (("warm-up", True), ("open-world", False)):
        recs = [h for h in history if bool(h["warmup"]) == warm]
        if not recs:
            continue
        epochs = plan.warmup if warm else plan.n_epochs - plan.warmup
        last = recs[-1]
        out[name] = {
            "steps": int(sum(h["steps"] for h in recs)),
            "max_steps": int(epochs * plan.steps_per_epoch),
            "epochs": len(recs),
            "stopped": str(last.get("stopped", "schedule")),
            "changed": float(last.get("changed", np.nan)),
            "loss_fall": float(last.get("loss_fall", np.nan)),
            "loss_noise": float(last.get("loss_noise", np.nan)),
            "stop_tolerance": float(lab.stop_tolerance),
            "check_steps": int(lab.stop_check_steps),
        }
    return out


def predict_record(model: Any, labels: np.ndarray, info: dict[str, Any]) -> RunRecord:
    """The record (``uns['orca']``) of :func:`orca_sc.tl.predict`."""
    sizes = {n: int(np.sum(labels == n)) for n in model.novel_names}
    return RunRecord(
        mode="predict",
        params=model.config.to_dict(),
        seen_classes=list(model.classes),
        novel_cluster_sizes={n: c for n, c in sizes.items() if c > 0},
        novel_similarity=model.novel_similarity(),
        input_scale={"AnnData": info["input_scale"]},
        n_genes_missing=info["n_genes_missing"],
        model_version=model.trained_with,
        version=__version__,
    )


def jsonable(obj: Any) -> Any:
    """``obj`` storable in ``uns`` and JSON: no None, tuples as lists, numpy scalars as Python."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj if v is not None]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj
