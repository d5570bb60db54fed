"""Methods compared by the benchmark: ORCA, its ablations, and baselines from the paper's families.

Every method takes a :class:`~orca_sc.benchmark.Task` and a seed and returns one label per query
cell: a reference type, or any other string for a novel cluster. Methods that cannot name the
types they find (plain clustering) set ``names_types=False``; the runner then names their clusters
with the Hungarian matching over all classes (an oracle advantage, stated in the report).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pandas as pd

from .._config import OrcaConfig
from ._splits import PARTNER, Task


@dataclass(frozen=True)
class Method:
    name: str
    family: str
    description: str
    run: Callable[[Task, int], np.ndarray]
    names_types: bool = True


# ------------------------------------------------------------------------------------------ ORCA
def annotate_task(task: Task, seed: int, **config) -> tuple[Any, slice]:
    """Run :func:`orca_sc.tl.annotate` on a task; returns the annotated AnnData and the slice of
    its rows that are the query. ``obs['truth']`` holds the true type of every row.

    Protocol splits (``task.single``) are annotated as one AnnData with the query cells
    unlabelled, as in the paper; cross-batch splits as query + reference.
    """
    import anndata as ad

    from .._ablation import split_options
    from ..tl import annotate

    config, ablation = split_options(config)
    config["ablation"] = ablation
    key = task.labels_key
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if task.single:
            adata = ad.concat([task.reference, task.query], join="inner", merge="same")
            adata.obs_names_make_unique()
            ref_labels = list(task.reference.obs[key].astype(str))
            labels = ref_labels + [None] * task.query.n_obs
            adata.obs[key] = pd.Series(labels, index=adata.obs_names, dtype=object)
            adata.obs["truth"] = ref_labels + list(task.truth)
            annotate(adata, labels_key=key, seed=seed, progress=False, **config)
            return adata, slice(task.reference.n_obs, None)
        adata = task.query.copy()
        adata.obs["truth"] = task.truth
        query_key = task.info.get("query_key")
        if query_key is None:
            annotate(adata, task.reference, labels_key=key, seed=seed, progress=False, **config)
            return adata, slice(None)
        # several queries annotated together; their rows put back in the query's order
        group = adata.obs[query_key].astype(str).to_numpy()
        parts = [adata[group == g].copy() for g in pd.unique(group)]
        annotate(parts, task.reference, labels_key=key, seed=seed, progress=False, **config)
        whole = ad.concat(parts, merge="same", uns_merge="first")
        return whole[adata.obs_names].copy(), slice(None)


def _orca(task: Task, seed: int, heads_factor: int | None = None, **config) -> np.ndarray:
    if heads_factor is not None:
        config["n_novel"] = max(1, heads_factor * len(task.novel))
    adata, rows = annotate_task(task, seed, **config)
    est = adata.uns["orca"]["n_novel"]["estimated"]
    return adata.obs["orca_label"].astype(str).to_numpy()[rows], {
        "novel_est": est,
        **novelty_test_shares(adata, rows, task),
    }


def novelty_test_shares(adata, rows, task: Task) -> dict[str, float]:
    """The shares of known-type (the test's level) and of novel-type query cells (its power)
    with a novelty p-value at most alpha; the shares called novel by two rules measured against
    the annotation (``bh``: q-value at most alpha; ``vote``: the novel clusters less those the
    test finds not unlike the reference); the batches where the test's premise fails
    (``premise_fails``) and the largest share of cells labelled a known type with p at most alpha
    in a batch (``premise_share``). Empty without p-values.
    """
    if "orca_novelty_pvalue" not in adata.obs:
        return {}
    test = adata.uns["orca"]["novelty_test"]
    alpha, table = test["alpha"], test["clusters"]
    p = adata.obs["orca_novelty_pvalue"].to_numpy()[rows]
    q = adata.obs["orca_novelty_qvalue"].to_numpy()[rows]
    label = adata.obs["orca_label"].astype(str).to_numpy()[rows]
    rejected = [
        c
        for c, v in zip(table["cluster"], table["supported"], strict=True)
        if v == "not significant"
    ]
    called = adata.obs["orca_novel"].notna().to_numpy()[rows]
    rules = {"p_below_alpha": p <= alpha, "bh_called": q <= alpha,
             "vote_called": called & ~np.isin(label, rejected)}  # fmt: skip
    novel = ~np.isin(task.truth, task.seen)
    out = {}
    for name, call in rules.items():
        out[f"known_{name}"] = float(call[~novel].mean()) if (~novel).any() else np.nan
        out[f"novel_{name}"] = float(call[novel].mean()) if novel.any() else np.nan
    premise = test.get("premise", {})
    out["premise_fails"] = int(sum(h == "fails" for h in premise.get("holds", [])))
    out["premise_share"] = float(max(premise.get("share_p_below_alpha", []), default=np.nan))
    return out


def confidence_figures(adata, rows, task: Task) -> dict[str, float]:
    """How well ``obs['orca_confidence']`` says that a label is right, over the query cells
    labelled a known type: the expected calibration error over those of known types
    (``ece_known``) and over all of them (``ece_labelled_known``: novel-type cells absorbed by a
    known type are wrong labels too), their mean confidence and accuracy.
    """
    from .._calibration import expected_calibration_error

    label = adata.obs["orca_label"].astype(str).to_numpy()[rows]
    conf = adata.obs["orca_confidence"].to_numpy()[rows]
    truth = np.asarray(task.truth, dtype=str)
    as_known = np.isin(label, task.seen)
    of_known = np.isin(truth, task.seen)
    right = label == truth
    m = as_known & of_known
    return {
        "ece_known": expected_calibration_error(conf[m], right[m]),
        "ece_labelled_known": expected_calibration_error(conf[as_known], right[as_known]),
        "confidence_labelled_known": float(conf[as_known].mean()) if as_known.any() else np.nan,
        "accuracy_labelled_known": float(right[as_known].mean()) if as_known.any() else np.nan,
    }


# ------------------------------------------------------------------------------------- baselines
@dataclass
class _Features:
    """Shared preprocessing for the baselines (as for ORCA): log-normalised, 2,000 HVGs chosen
    on reference and query together, genes matched by name.
    """

    X_ref: object
    X_query: object
    y_ref: np.ndarray  # class names


def _features(task: Task, n_genes: int | None = 2000) -> _Features:
    """Computed once per task and gene count; every baseline on the task reuses it."""
    from .._data import prepare

    cache = task.info.setdefault("_features", {})
    if n_genes not in cache:
        data = prepare(task.query, task.reference, task.labels_key, OrcaConfig(n_genes=n_genes))
        lab = data.labels >= 0
        classes = np.asarray(data.classes, dtype=object)
        cache[n_genes] = _Features(data.X[lab], data.X[data.output_rows], classes[data.labels[lab]])
    return cache[n_genes]


def _pca(X_fit, X_apply: list, n_comps: int, seed: int) -> list[np.ndarray]:
    """Scanpy's usual recipe (scale genes to unit variance, clip at 10, PCA) fitted on ``X_fit``
    (at most 10,000 cells) and applied to each matrix of ``X_apply`` in dense chunks.
    """
    from sklearn.decomposition import PCA

    rng = np.random.default_rng(seed)
    n = X_fit.shape[0]
    rows = np.arange(n) if n <= 10_000 else np.sort(rng.choice(n, 10_000, replace=False))
    D = X_fit[rows].toarray()
    mu, sd = D.mean(axis=0), D.std(axis=0)
    sd[sd == 0] = 1.0

    def z(A):
        return np.clip((A - mu) / sd, -10, 10)

    k = int(min(n_comps, D.shape[0] - 1, D.shape[1] - 1))
    pca = PCA(n_components=k, random_state=seed).fit(z(D))
    out = []
    for X in X_apply:
        parts = [pca.transform(z(X[i : i + 8192].toarray())) for i in range(0, X.shape[0], 8192)]
        out.append(np.vstack(parts).astype(np.float32))
    return out


def _leiden(emb: np.ndarray, seed: int, resolution: float = 1.0) -> np.ndarray:
    from .._discover import leiden

    return leiden(emb, resolution, seed)


def _kmeans(emb: np.ndarray, k: int, seed: int) -> np.ndarray:
    from sklearn.cluster import KMeans

    k = int(min(k, emb.shape[0]))
    return KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(emb)


def _reject_and_cluster(pred, reject, emb, cluster) -> np.ndarray:
    out = np.asarray(pred, dtype=object).copy()
    idx = np.flatnonzero(reject)
    if idx.size:
        codes = cluster(emb[idx]) if idx.size > 2 else np.zeros(idx.size, dtype=np.int64)
        out[idx] = np.array([f"novel_{c + 1}" for c in codes], dtype=object)
    return out


def lr_oracle_kmeans(task: Task, seed: int) -> np.ndarray:
    """Logistic regression on the reference; the least confident query cells are rejected with
    the paper's oracle threshold (rejected fraction = true novel fraction) and clustered with
    KMeans into the true number of novel types.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    f = _features(task)
    scaler = StandardScaler(with_mean=False).fit(f.X_ref)
    clf = LogisticRegression(max_iter=1000, C=0.1, random_state=seed)
    clf.fit(scaler.transform(f.X_ref), f.y_ref)
    prob = clf.predict_proba(scaler.transform(f.X_query))
    pred = clf.classes_[prob.argmax(axis=1)]
    n_reject = int(round(task.novel_fraction * f.X_query.shape[0]))
    reject = np.zeros(len(pred), dtype=bool)
    if n_reject and task.novel:
        reject[np.argsort(prob.max(axis=1), kind="stable")[:n_reject]] = True
    (emb,) = _pca(f.X_query, [f.X_query], 30, seed)
    return _reject_and_cluster(pred, reject, emb, lambda e: _kmeans(e, len(task.novel), seed))


#: the classifiers of :func:`supervised_reference`, the best of which is the task's ceiling
CEILING_CLASSIFIERS = ("logistic (genes)", "logistic (PCs)", "kNN (PCs)")
#: the inverse regularisations the PCs' logistic regression chooses among (inner CV)
CEILING_CS = (0.01, 0.1, 1.0, 10.0)


def supervised_reference(task: Task, seed: int, folds: int = 5):
    """The ceiling of :func:`ceiling_predictions`: the classifier with the best all-class
    accuracy on this task, its labels (a novel type as ``novel:<type>``) and its name
    (``reference``).
    """
    truth = np.asarray(task.truth, dtype=object)
    preds = ceiling_predictions(task, seed, folds)
    best = max(CEILING_CLASSIFIERS, key=lambda n: float(np.mean(preds[n] == truth)))
    seen = set(task.seen)
    labels = np.array([p if p in seen else f"novel:{p}" for p in preds[best]], dtype=object)
    return labels, {"reference": best}


def ceiling_predictions(task: Task, seed: int, folds: int = 5) -> dict[str, np.ndarray]:
    """What the query's expression supports with its true labels known, a ceiling for the open
    world: classifiers trained on the query's own cells and truth, novel types included, each
    cell predicted by the one of a fold that did not see it (``folds``-fold cross-validation,
    shuffled with ``seed``), and the best of them on this task (all-class accuracy):

    * a class-balanced logistic regression on the 2,000 selected genes (scaled, C = 0.1);
    * a class-balanced logistic regression on the query's own 50-component PCA (no label read),
      its C chosen among :data:`CEILING_CS` by a 3-fold cross-validation inside the fold;
    * a kNN (15 neighbours, weighted by distance) on the same PCA.

    A task is feasible for a goal where the best of them meets it. The draws of one cell in a
    task grown by :func:`~._splits.grow_task` share a fold. Returns each classifier's predicted
    type of every query cell, by name.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.preprocessing import StandardScaler

    f = _features(task)
    truth = np.asarray(task.truth, dtype=object)
    (pcs,) = _pca(f.X_query, [f.X_query], min(50, min(f.X_query.shape) - 1), seed)
    # the logistic regression reads the components at unit variance (its fits then converge in
    # a few dozen steps), the kNN their distances as they are
    unit = StandardScaler().fit_transform(pcs)
    preds = {name: np.empty(truth.size, dtype=object) for name in CEILING_CLASSIFIERS}
    source, partner = _grown_sources(task)
    first = np.full(int(source.max()) + 1, -1)
    first[source[::-1]] = np.arange(source.size)[::-1]  # each cell's first draw
    straddle = np.zeros(truth.size, dtype=bool)  # test draws pooled with a training cell
    for train, test, pooled in ceiling_folds(source, partner, folds, seed):
        straddle |= pooled
        y = truth[train]
        if np.unique(y).size < 2:  # one class in the fold: nothing to fit
            for p in preds.values():
                p[test] = y[0]
            continue
        with warnings.catch_warnings():  # small classes, short fits: said by the figures
            warnings.simplefilter("ignore")
            scaler = StandardScaler(with_mean=False).fit(f.X_query[train])
            genes = LogisticRegression(max_iter=1000, C=0.1, class_weight="balanced",
                                       random_state=seed)  # fmt: skip
            genes.fit(scaler.transform(f.X_query[train]), y)
            preds["logistic (genes)"][test] = genes.predict(scaler.transform(f.X_query[test]))
            c = _inner_cv_c(unit[train], y, source[train], seed)
            lr = LogisticRegression(max_iter=1000, C=c, class_weight="balanced",
                                    random_state=seed).fit(unit[train], y)  # fmt: skip
            preds["logistic (PCs)"][test] = lr.predict(unit[test])
            knn = KNeighborsClassifier(n_neighbors=int(min(15, train.sum())), weights="distance")
            preds["kNN (PCs)"][test] = knn.fit(pcs[train], y).predict(pcs[test])
    # a test draw pooled with a training cell holds counts the classifiers trained on: it
    # takes the prediction of its own cell's first draw (that cell alone)
    for p in preds.values():
        p[straddle] = p[first[source[straddle]]]
    return preds


def ceiling_folds(source: np.ndarray, partner: np.ndarray, folds: int, seed: int):
    """The ceiling's folds over the cells a task was grown from (``source``; ``partner``: the
    cell a draw pooled with, ``-1`` for none; :func:`_grown_sources`): per fold the rows that
    train (no draw that holds a test cell's counts, not even pooled into a training cell's),
    the rows it predicts (every draw of its cells), and of those the draws pooled with a
    training cell (which take their cell's first draw's prediction).
    """
    from sklearn.model_selection import KFold

    n_source = int(source.max()) + 1
    k = int(min(folds, n_source))
    for train_s, test_s in KFold(k, shuffle=True, random_state=seed).split(np.arange(n_source)):
        in_train = np.isin(source, train_s)  # folds, not cells
        mate_train = (partner >= 0) & np.isin(partner, train_s)
        test = np.isin(source, test_s)
        yield in_train & ((partner < 0) | mate_train), test, test & mate_train


def _grown_sources(task: Task) -> tuple[np.ndarray, np.ndarray]:
    """Per query cell, the cell of the task before growing it was drawn from (its own index in
    a task not grown) and the cell a ``mode="mix"`` draw pooled it with (``-1``: none), as
    codes of the same cells: a grown task's draws of one cell go to one fold, and no draw that
    pools a test cell trains.
    """
    n = task.query.n_obs
    if "grown" not in task.info:
        return np.arange(n), np.full(n, -1)
    names = pd.Index(task.query.obs_names).str.rsplit("-", n=1).str[0]
    source, cells = pd.factorize(names)
    partner = np.full(n, -1)
    if PARTNER in task.query.obs:
        partner = pd.Index(cells).get_indexer(task.query.obs[PARTNER].astype(str))
    return np.asarray(source), np.asarray(partner)


def _inner_cv_c(x: np.ndarray, y: np.ndarray, source: np.ndarray, seed: int) -> float:
    """The C of :data:`CEILING_CS` whose class-balanced logistic regression predicts ``y`` from
    ``x`` best in a 3-fold cross-validation (folds by ``source``), the largest on a tie.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import KFold

    groups = np.unique(source)
    if groups.size < 3:
        return 0.1
    right = np.zeros(len(CEILING_CS))
    for tr_g, te_g in KFold(3, shuffle=True, random_state=seed).split(groups):
        tr, te = np.isin(source, groups[tr_g]), np.isin(source, groups[te_g])
        if np.unique(y[tr]).size < 2:
            continue
        for i, c in enumerate(CEILING_CS):
            clf = LogisticRegression(max_iter=1000, C=c, class_weight="balanced",
                                     random_state=seed).fit(x[tr], y[tr])  # fmt: skip
            right[i] += float(np.sum(clf.predict(x[te]) == y[te]))
    return float(CEILING_CS[int(np.flatnonzero(right == right.max())[-1])])


def knn_transfer(task: Task, seed: int, n_neighbors: int = 15, min_vote: float = 0.5):
    """Label transfer as ``sc.tl.ingest`` does it: the query is projected on the reference's PCA
    and takes the majority label of its nearest reference cells; cells whose majority is below
    ``min_vote`` of the neighbours are rejected and clustered with Leiden.

    Built on scikit-learn because ``sc.tl.ingest`` (scanpy 1.11.5) crashes with pynndescent 0.7.0.
    """
    from sklearn.neighbors import NearestNeighbors

    f = _features(task)
    emb_ref, emb_q = _pca(f.X_ref, [f.X_ref, f.X_query], 50, seed)
    k = min(n_neighbors, emb_ref.shape[0])
    idx = NearestNeighbors(n_neighbors=k).fit(emb_ref).kneighbors(emb_q, return_distance=False)
    classes, codes = np.unique(f.y_ref, return_inverse=True)
    votes = np.zeros((emb_q.shape[0], classes.size))
    np.add.at(votes, (np.repeat(np.arange(emb_q.shape[0]), k), codes[idx].ravel()), 1.0)
    frac = votes.max(axis=1) / k
    pred = classes[votes.argmax(axis=1)]
    return _reject_and_cluster(pred, frac < min_vote, emb_q, lambda e: _leiden(e, seed))


def cluster_query(task: Task, seed: int, algorithm: str = "leiden") -> np.ndarray:
    """Novel-class-discovery stand-in: cluster the query alone (Leiden, or KMeans with the true
    number of classes); clusters are named by the runner's Hungarian matching.
    """
    f = _features(task)
    (emb,) = _pca(f.X_query, [f.X_query], 30, seed)
    if algorithm == "leiden":
        codes = _leiden(emb, seed)
    else:
        k = len(set(task.truth))
        codes = _kmeans(emb, k, seed)
    return np.array([f"cluster_{c}" for c in codes], dtype=object)


def celltypist_rejection(task: Task, seed: int) -> np.ndarray:
    """CellTypist trained on the reference (its SGD mode: one-vs-rest logistic regression, all
    shared genes); cells without any type above 0.5 in ``prob match`` mode are rejected and
    clustered with Leiden.
    """
    try:
        import celltypist  # noqa: F401
    except ImportError as e:
        msg = "celltypist is not installed (pip install celltypist)"
        raise MethodUnavailable(msg) from e
    return _celltypist(task, seed)


class MethodUnavailable(RuntimeError):
    """A baseline cannot run in this environment (the report says why)."""


def _celltypist(task: Task, seed: int) -> np.ndarray:
    import logging

    import anndata as ad
    import celltypist

    # its per-step chatter, and its warning that the input is not "ALL genes" (it gets the genes
    # shared by reference and query, as every method here)
    logging.getLogger("celltypist").setLevel(logging.ERROR)
    f = _features(task, n_genes=None)
    genes = [f"g{i}" for i in range(f.X_ref.shape[1])]
    ref = ad.AnnData(X=f.X_ref.copy(), var=pd.DataFrame(index=genes))  # shared features
    ref.obs["label"] = f.y_ref
    query = ad.AnnData(X=f.X_query.copy(), var=pd.DataFrame(index=genes))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # CellTypist's default solver passes LogisticRegression(multi_class="ovr"), which
        # scikit-learn 1.8 removed; its SGD mode (one-vs-rest logistic loss) works unchanged
        model = celltypist.train(
            ref, labels="label", check_expression=False, use_SGD=True, n_jobs=1,
            feature_selection=False, max_iter=1000, random_state=seed,
        )  # fmt: skip
        res = celltypist.annotate(query, model, mode="prob match", p_thres=0.5)
    labels = res.predicted_labels["predicted_labels"].astype(str).to_numpy()
    reject = np.isin(labels, ["Unassigned"]) | pd.Series(labels).str.contains("\\|").to_numpy()
    (emb,) = _pca(f.X_query, [f.X_query], 30, seed)
    return _reject_and_cluster(labels, reject, emb, lambda e: _leiden(e, seed))


# --------------------------------------------------------------------------------------- registry
def _m(name, family, description, run, names_types=True) -> Method:
    return Method(name, family, description, run, names_types)


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        _m("ORCA", "ORCA", "orca_sc defaults, n_novel='auto'", _orca),
        _m("ORCA-ZM", "ablation", "zero margin", partial(_orca, margin="zero")),
        _m("ORCA-FNM", "ablation", "fixed margin 0.5", partial(_orca, margin="fixed")),
        _m("ORCA w/o sup", "ablation", "no supervised term", partial(_orca, supervised=False)),
        _m("ORCA w/o reg", "ablation", "no regulariser", partial(_orca, regularizer=False)),
        _m("ORCA heads x1", "heads", "n_novel = true number", partial(_orca, heads_factor=1)),
        _m("ORCA heads x2", "heads", "n_novel = 2 x true number", partial(_orca, heads_factor=2)),
        _m("ORCA heads x4", "heads", "n_novel = 4 x true number", partial(_orca, heads_factor=4)),
        _m(
            "LR + oracle reject + KMeans",
            "baseline",
            "logistic regression, oracle rejection threshold, KMeans (true k) on rejected",
            lr_oracle_kmeans,
        ),
        _m(
            "Supervised reference (query labels, CV)",
            "baseline",
            "logistic regression on the query's true labels, novel types included, 5-fold CV: "
            "what the expression supports",
            supervised_reference,
        ),
        _m(
            "kNN transfer (ingest-like) + Leiden",
            "baseline",
            "PCA-projected 15-NN majority vote (< 0.5 rejected), Leiden on rejected",
            knn_transfer,
        ),
        _m(
            "CellTypist + Leiden",
            "baseline",
            "CellTypist, prob match p>0.5, Leiden on unassigned",
            celltypist_rejection,
        ),
        _m(
            "Leiden on query (NCD stand-in)",
            "baseline",
            "Leiden clusters of the query, named by oracle Hungarian matching",
            cluster_query,
            names_types=False,
        ),
        _m(
            "KMeans on query (NCD stand-in)",
            "baseline",
            "KMeans (true number of classes), named by oracle Hungarian matching",
            partial(cluster_query, algorithm="kmeans"),
            names_types=False,
        ),
    ]
}

DEFAULT_METHODS = list(METHODS)
QUICK_METHODS = ["ORCA", "LR + oracle reject + KMeans", "Leiden on query (NCD stand-in)"]
#: the development suite compares ORCA with the peers that name known types, and with the
#: supervised reference (what the query's expression supports with its true labels)
SUITE_METHODS = [
    "ORCA",
    "LR + oracle reject + KMeans",
    "kNN transfer (ingest-like) + Leiden",
    "CellTypist + Leiden",
    "Supervised reference (query labels, CV)",
]
