"""A split test for the number of novel clusters, measured on the development suite (issue 34,
item 4): would an sc-SHC-like test, whose null is how far apart the two halves of a labelled type
lie, merge the right novel clusters?

For every task and seed, after a default run, on the log-normalised expression (2,000 highly
variable genes of reference and query together):

* the statistic between two groups of cells: the squared Mahalanobis distance between their
  means (pooled within-group covariance) in the top 10 principal components of the two groups
  together, corrected for its small-sample bias (``(n - p - 3) / (n - 2) D^2 - p (1/n_a +
  1/n_b)``); for a Gaussian blob cut by any hyperplane it is about 7, whatever the share cut off;
* the null: the statistic between the 2-means halves of each labelled type of at least 40
  labelled cells (80% subsamples, 60 halves in all); a pair is "separable" when its statistic
  is above the null's 95% quantile (p <= 0.05);
* the groups: each novel cluster of the run (its query cells) and each known type (its labelled
  cells and the query cells labelled with it).

Per task it prints the null's median and 95% quantile; the share of known types whose nearest
other known type is *not* separable from it (the test would merge two types the annotator
split); and, for the novel clusters, how many the test would merge with their least separable
partner, and how many of those merges are right (the partner's majority true type is the
cluster's own) or wrong.

Usage: ``python benchmarks/split_test.py [--data DIR] [--seeds 0] [--only NAME ...]
[--out reports/split_test.md]``
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
from sklearn.cluster import KMeans

from orca_sc.benchmark import annotate_task, dev_suite

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
N_COMPS, MAX_GROUP, N_NULL, MIN_TYPE, ALPHA = 10, 500, 60, 40, 0.05


def split_distance(xa: np.ndarray, xb: np.ndarray, p: int = N_COMPS) -> float:
    na, nb = len(xa), len(xb)
    n = na + nb
    p = min(p, n - 4)
    x = np.vstack([xa, xb]).astype(np.float64)
    x -= x.mean(axis=0)
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    z = x @ vt[:p].T
    za, zb = z[:na], z[na:]
    diff = za.mean(axis=0) - zb.mean(axis=0)
    ca, cb = za - za.mean(axis=0), zb - zb.mean(axis=0)
    w = (ca.T @ ca + cb.T @ cb) / (n - 2)
    w += np.eye(p) * 1e-6 * np.trace(w) / p
    d2 = float(diff @ np.linalg.solve(w, diff))
    return (n - p - 3) / (n - 2) * d2 - p * (1 / na + 1 / nb)


def expression(task, q) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Log-normalised HVG expression of reference + query cells, their labels (reference: the
    label; query: ``None``), predictions (query) and true types.
    """
    key = task.labels_key
    ref, qry = task.reference.copy(), task.query.copy()
    both = ad.concat([ref, qry], join="inner")
    both.obs_names_make_unique()
    x = both.X
    vals = x.data if hasattr(x, "data") else np.asarray(x).ravel()
    if np.allclose(vals[:1000], np.round(vals[:1000])):  # counts
        sc.pp.normalize_total(both, target_sum=1e4)
        sc.pp.log1p(both)
    sc.pp.highly_variable_genes(both, n_top_genes=2000)
    X = both[:, both.var["highly_variable"]].X
    X = X.toarray() if hasattr(X, "toarray") else np.asarray(X)
    n_ref = ref.n_obs
    labels = np.array(list(ref.obs[key].astype(str)) + [None] * qry.n_obs, dtype=object)
    pred_q = q.obs["orca_label"].astype(str).to_numpy()[-qry.n_obs :]
    pred = np.array([None] * n_ref + list(pred_q), dtype=object)
    truth = np.array(list(ref.obs[key].astype(str)) + list(np.asarray(task.truth, dtype=str)))
    return X, labels, pred, truth


def analyse(task, q, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    X, labels, pred, truth = expression(task, q)

    def sample(idx):
        return idx if idx.size <= MAX_GROUP else rng.choice(idx, MAX_GROUP, replace=False)

    seen = list(pd.unique(labels[labels != None]))  # noqa: E711
    big = [t for t in seen if (labels == t).sum() >= MIN_TYPE]
    null = []
    for t in big:
        idx = np.flatnonzero(labels == t)
        for _ in range(int(np.ceil(N_NULL / len(big)))):
            s = rng.choice(idx, min(MAX_GROUP, int(0.8 * idx.size)), replace=False)
            x = X[s] - X[s].mean(axis=0)
            _, _, vt = np.linalg.svd(x, full_matrices=False)
            cut = KMeans(2, n_init=3, random_state=0).fit_predict(x @ vt[:N_COMPS].T)
            null.append(split_distance(X[s][cut == 0], X[s][cut == 1]))
    null = np.asarray(null)
    if null.size < 1 / ALPHA:
        return {"n_null": int(null.size)}
    q95 = float(np.quantile(null, 1 - ALPHA))
    groups = {("K", t): np.flatnonzero((labels == t) | (pred == t)) for t in seen}
    for c in sorted({p for p in pred if p is not None} - set(seen)):
        groups[("N", c)] = np.flatnonzero(pred == c)
    groups = {g: i for g, i in groups.items() if i.size >= 5}
    major = {g: pd.Series(truth[i]).value_counts().index[0] for g, i in groups.items()}
    dist = {}
    for g in groups:
        for h in groups:
            if g < h:  # every pair: known-known too, for the annotated types' own separation
                dist[g, h] = dist[h, g] = split_distance(X[sample(groups[g])], X[sample(groups[h])])
    known = [g for g in groups if g[0] == "K"]
    kk_merge = [min(dist[g, h] for h in known if h != g) <= q95 for g in known if len(known) > 1]
    novel = [g for g in groups if g[0] == "N"]
    right = wrong = 0
    for g in novel:
        partner = min((h for h in groups if h != g), key=lambda h: dist[g, h])
        if dist[g, partner] <= q95:
            right += major[partner] == major[g]
            wrong += major[partner] != major[g]
    return {
        "n_null": int(null.size),
        "null_median": float(np.median(null)),
        "null_q95": q95,
        "known_merged": float(np.mean(kk_merge)) if kk_merge else np.nan,
        "novel_clusters": len(novel),
        "merges_right": right,
        "merges_wrong": wrong,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--out", type=Path, default=Path("reports/split_test.md"))
    args = ap.parse_args()
    rows = []
    for spec in dev_suite(args.data if args.data.is_dir() else None, large=False, only=args.only):
        for seed in args.seeds:
            task = spec.make(seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q, _ = annotate_task(task, seed)
                row = {"task": spec.name, "seed": seed, **analyse(task, q, seed)}
            rows.append(row)
            print(row, flush=True)
    df = pd.DataFrame(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out.with_suffix(".csv"), index=False)
    cells = df.map(lambda v: f"{v:.3f}" if isinstance(v, float) else str(v))
    md = "| " + " | ".join(df.columns) + " |\n|" + "---|" * len(df.columns) + "\n"
    md += "\n".join("| " + " | ".join(r) + " |" for r in cells.to_numpy().tolist())
    tot = df[["novel_clusters", "merges_right", "merges_wrong"]].sum()
    md += (
        f"\n\nknown types not separable from their nearest known type: median share "
        f"{df['known_merged'].median():.2f} over tasks; novel clusters {int(tot.novel_clusters)}, "
        f"merges right {int(tot.merges_right)}, wrong {int(tot.merges_wrong)}\n"
    )
    args.out.write_text(md)
    print(md)


if __name__ == "__main__":
    main()
