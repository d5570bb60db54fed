"""Open-world splits of labelled data: the paper's protocol and cross-batch reference/query."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .._data import batch_column
from .._errors import OrcaInputError
from .._labels import _labels_column

TRUTH = "_truth"


@dataclass
class Task:
    """One open-world problem: a labelled reference and a query whose truth is known.

    ``reference.obs[labels_key]`` holds the known types; ``query.obs['_truth']`` the true type of
    every query cell (some of them types the reference lacks). ``single`` marks splits of one
    dataset (the paper's protocol), where ORCA sees reference and query as one AnnData.
    """

    name: str
    reference: Any
    query: Any
    labels_key: str
    seen: list[str]
    single: bool
    seed: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def truth(self) -> np.ndarray:
        return self.query.obs[TRUTH].astype(str).to_numpy()

    @property
    def novel(self) -> list[str]:
        return sorted(set(self.truth) - set(self.seen))

    @property
    def novel_fraction(self) -> float:
        return float(np.mean(~np.isin(self.truth, self.seen)))


def _labels(adata: Any, labels_key: str) -> pd.Series:
    col = _labels_column(adata, labels_key, "data")
    if col.isna().any():
        msg = f"obs[{labels_key!r}] has missing labels; benchmarks need every cell labelled."
        raise OrcaInputError(msg)
    return col.astype(str)


def protocol_split(
    adata: Any,
    labels_key: str,
    *,
    seen_fraction: float = 0.5,
    labeled_fraction: float = 0.5,
    seen_classes: Sequence[str] | None = None,
    seed: int = 0,
    name: str = "protocol",
) -> Task:
    """The paper's protocol (§4.1): a fraction of the classes is seen, a fraction of each seen
    class is labelled (the reference); every other cell is the query.

    ``seen_classes`` fixes the seen classes instead of drawing ``seen_fraction`` of them.
    """
    truth = _labels(adata, labels_key)
    classes = np.array(sorted(truth.unique()))
    rng = np.random.default_rng(seed)
    if seen_classes is None:
        if not 0 < seen_fraction < 1:
            raise OrcaInputError(f"seen_fraction must be in (0, 1), got {seen_fraction}.")
        n_seen = max(2, int(round(seen_fraction * len(classes))))
        seen = sorted(rng.choice(classes, min(n_seen, len(classes) - 1), replace=False).tolist())
    else:
        seen = sorted(map(str, seen_classes))
        unknown = sorted(set(seen) - set(classes))
        if unknown:
            raise OrcaInputError(f"seen classes {unknown} are not in obs[{labels_key!r}].")
    if not 0 < labeled_fraction < 1:
        raise OrcaInputError(f"labeled_fraction must be in (0, 1), got {labeled_fraction}.")
    lab = truth.isin(seen).to_numpy() & (rng.random(adata.n_obs) < labeled_fraction)
    ref = adata[lab].copy()
    ref.obs[labels_key] = pd.Categorical(truth[lab].to_numpy(), categories=seen)
    query = adata[~lab].copy()
    query.obs[TRUTH] = truth[~lab].to_numpy()
    query.obs[labels_key] = np.nan  # hidden
    return Task(name, ref, query, labels_key, seen, single=True, seed=seed)


def batch_split(
    adata: Any,
    labels_key: str,
    batch_key: str,
    reference_batches: Sequence[str],
    *,
    novel_classes: Sequence[str] = (),
    seed: int = 0,
    name: str = "cross-batch",
) -> Task:
    """Cross-tissue / cross-batch: the reference is the cells of ``reference_batches`` (minus
    ``novel_classes``, hidden on purpose), the query every cell of the other batches; classes
    absent from the reference are novel.
    """
    truth = _labels(adata, labels_key)
    batch = pd.Series(batch_column(adata, batch_key, "data"), index=adata.obs_names)
    refs = [str(b) for b in reference_batches]
    missing = sorted(set(refs) - set(batch.unique()))
    if missing:
        raise OrcaInputError(
            f"reference batches {missing} are not in obs[{batch_key!r}]; batches: "
            f"{sorted(batch.unique())}."
        )
    in_ref_batch = batch.isin(refs).to_numpy()
    if in_ref_batch.all():
        raise OrcaInputError(
            "every cell is in a reference batch; leave at least one for the query."
        )
    in_ref = in_ref_batch & ~truth.isin([str(c) for c in novel_classes]).to_numpy()
    ref = adata[in_ref].copy()
    seen = sorted(truth[in_ref].unique())
    ref.obs[labels_key] = pd.Categorical(truth[in_ref].to_numpy(), categories=seen)
    query = adata[~in_ref_batch].copy()
    query.obs[TRUTH] = truth[~in_ref_batch].to_numpy()
    query.obs[labels_key] = np.nan
    return Task(name, ref, query, labels_key, seen, single=False, seed=seed)


def grow_task(
    task: Task, n_cells: int, *, keep: float = 0.8, seed: int = 0, mode: str = "redraw"
) -> Task:
    """``task`` grown to about ``n_cells`` cells: every cell drawn ``round(n_cells / cells)``
    times (at least once). Reference and query grow by the same factor; labels, truth and
    batches are copied to every draw.

    ``mode="redraw"``: each draw is the cell's counts binomially thinned (each count kept with
    probability ``keep``), fresh sampling noise on the same cell. A cell drawn more often than a
    kNN graph has neighbours is then its own neighbourhood: its draws are closer to each other
    than to any other cell. ``mode="mix"``: each draw after the first pools the cell's counts
    with those of a random cell of the same type (and the same ``obs['batch']``, where there is
    one) and thins the sum with probability ``keep / 2``: new cells of the type at the same
    depth, not copies of one.

    Needs raw counts (non-negative integers): thinning log-normalised values means nothing.
    """
    if mode not in ("redraw", "mix"):
        raise OrcaInputError(f"grow_task mode must be 'redraw' or 'mix', got {mode!r}.")
    n0 = task.reference.n_obs + task.query.n_obs
    factor = max(1, int(round(n_cells / n0)))
    rng = np.random.default_rng([seed, 0x6A0])
    types = (task.reference.obs[task.labels_key], task.query.obs[TRUTH])
    ref, query = (
        _redraw(a, factor, keep, rng, t if mode == "mix" else None)
        for a, t in zip((task.reference, task.query), types, strict=True)
    )
    suffix = "" if mode == "redraw" else "_mix"
    info = {k: v for k, v in task.info.items() if not k.startswith("_")}  # not the caches
    return Task(
        f"{task.name}_x{factor}{suffix}", ref, query, task.labels_key, task.seen, task.single,
        task.seed, {**info, "grown": {"factor": factor, "keep": keep, "mode": mode}},
    )  # fmt: skip


#: ``obs`` column of a task grown with ``mode="mix"``: the cell each draw pooled with (its
#: name in the task before growing; ``""`` for the first draws, the cell alone)
PARTNER = "_partner"


def _partners(groups: pd.Series, rng: np.random.Generator) -> np.ndarray:
    """For every row, a random row of the same group (itself only where the group has one)."""
    codes = pd.factorize(groups.astype(str), sort=True)[0]
    out = np.empty(codes.size, dtype=np.int64)
    for g in np.unique(codes):  # loop over groups, not cells
        idx = np.flatnonzero(codes == g)
        out[idx] = idx[rng.integers(0, idx.size, idx.size)]
    return out


def _redraw(adata: Any, factor: int, keep: float, rng: np.random.Generator,
            types: pd.Series | None = None) -> Any:  # fmt: skip
    """``factor`` binomially thinned draws of every cell of ``adata`` (CSR, draw by draw); with
    ``types``, draws after the first pool each cell with a random cell of its type (and batch).
    """
    import anndata as ad
    import scipy.sparse as sp

    X = sp.csr_matrix(adata.X)
    data = X.data
    if data.size and (data.min() < 0 or not np.all(np.equal(np.mod(data, 1), 0))):
        raise OrcaInputError(
            "grow_task needs raw counts (non-negative integers); this task's X holds other "
            "values (log-normalised?)."
        )
    counts = data.astype(np.int64)
    groups = None
    if types is not None:
        groups = types.astype(str)
        if "batch" in adata.obs:
            groups = groups + "\x00" + adata.obs["batch"].astype(str)
    Xi = sp.csr_matrix((counts, X.indices, X.indptr), shape=X.shape)
    draws, partners = [], []
    names = np.asarray(adata.obs_names, dtype=object)
    for k in range(factor):  # loop over draws, not cells
        if groups is None or k == 0:
            d = sp.csr_matrix(
                (rng.binomial(counts, keep).astype(np.float32), X.indices.copy(),
                 X.indptr.copy()), shape=X.shape,
            )  # fmt: skip
            partners.append(np.full(names.size, "", dtype=object))
        else:
            mate = _partners(groups, rng)
            pooled = (Xi + Xi[mate]).tocsr()
            pooled.data = rng.binomial(pooled.data, keep / 2).astype(np.float32)
            d = pooled
            partners.append(names[mate])
        d.eliminate_zeros()  # in place: hence the copies of X's index arrays
        draws.append(d)
    obs = pd.concat([adata.obs] * factor)
    obs.index = [f"{c}-{k}" for k in range(factor) for c in adata.obs_names]
    if groups is not None:  # the cell each draw pooled with ("" for a first draw)
        obs[PARTNER] = np.concatenate(partners)
    for col in adata.obs.columns:  # keep categoricals with their categories
        if isinstance(adata.obs[col].dtype, pd.CategoricalDtype):
            obs[col] = pd.Categorical(obs[col].astype(object),
                                      categories=adata.obs[col].cat.categories)  # fmt: skip
    return ad.AnnData(sp.vstack(draws, format="csr"), obs=obs, var=adata.var.copy())
