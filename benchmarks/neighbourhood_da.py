"""A Milo-style differential-abundance test of query against reference cells, measured as a
source of novel calls on the development suite's cross-batch tasks (issue 34, item 3).

For every task with a separate query, after the supervised warm-up (defaults, the seed of the
run):

* the kNN graph (k = 30, Euclidean) of the aligned PCA (30 components) of reference and query
  cells together, as discovery builds it;
* one neighbourhood per query cell (the cell and its 29 nearest cells), typed by the warm-up's
  best seen head of its index cell;
* a count model of the neighbourhood's query cells: under the null, its query share is that of
  the neighbourhoods of its type as a whole (the median), with the spread of those neighbourhoods
  (1.4826 MAD) added to the binomial variance, so that a technical shift of a whole type moves
  the null with it; a one-sided z-test;
* Milo's spatial FDR (weighted Benjamini-Hochberg, each neighbourhood weighted by the reciprocal
  of its index cell's distance to its k-th neighbour) at 0.05; the query cells of significant
  neighbourhoods are called novel and connected significant neighbourhoods (sharing a cell) are
  the candidate clusters.

Per task (mean ± sd over seeds) it prints the share of novel-type and of known-type query cells
so called, the candidates against the true number of novel types, and the AUROC of the raw
neighbourhood query share for novel- against known-type cells: the ceiling of any rule that
thresholds it.

Usage: ``python benchmarks/neighbourhood_da.py [--data DIR] [--seeds 0 1 2] [--only NAME ...]
[--out reports/neighbourhood_da.md]``
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components
from scipy.stats import norm
from sklearn.metrics import roc_auc_score
from sklearn.neighbors import NearestNeighbors

from orca_sc import OrcaConfig
from orca_sc._pipeline import run_context, seen_similarity, warm_up
from orca_sc.benchmark import dev_suite
from orca_sc.benchmark._suite import mean_sd

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
K = 30
ALPHA = 0.05
MIN_TYPE = 10  # neighbourhoods of a type below this: no null to compare with, not tested


def spatial_fdr(p: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Milo's spatial FDR: weighted Benjamini-Hochberg adjusted p-values."""
    order = np.argsort(p, kind="stable")
    w = weights[order]
    adj = p[order] * w.sum() / np.cumsum(w)
    adj = np.minimum.accumulate(adj[::-1])[::-1].clip(max=1.0)
    out = np.empty_like(adj)
    out[order] = adj
    return out


def da_calls(pca: np.ndarray, is_query: np.ndarray, query_rows: np.ndarray, types: np.ndarray):
    """Query cells (indices into ``query_rows``) in significantly query-enriched
    neighbourhoods, the number of connected candidate clusters, and each query cell's raw
    neighbourhood query share.
    """
    nn = NearestNeighbors(n_neighbors=K).fit(pca)
    dist, idx = nn.kneighbors(pca[query_rows])  # the index cell is its own first neighbour
    share = is_query[idx].mean(axis=1)
    z = np.zeros(query_rows.size)
    for t in np.unique(types):
        m = types == t
        if m.sum() < MIN_TYPE:
            continue
        s = share[m]
        med = np.median(s)
        mad = 1.4826 * np.median(np.abs(s - med))
        z[m] = (s - med) / np.sqrt(mad**2 + med * (1 - med) / K + 1e-12)
    q = spatial_fdr(norm.sf(z), 1.0 / np.maximum(dist[:, -1], 1e-12))
    sig = np.flatnonzero(q <= ALPHA)
    pos = np.full(pca.shape[0], -1)
    pos[query_rows] = np.arange(query_rows.size)
    members = pos[idx[sig]]  # (n_sig, K) query positions, -1 for reference cells
    called = np.zeros(query_rows.size, dtype=bool)
    called[members[members >= 0]] = True
    n_clusters = 0
    if sig.size:
        r, c = np.nonzero(members >= 0)
        inc = sp.csr_matrix(
            (np.ones(r.size), (r, members[r, c])), shape=(sig.size, query_rows.size)
        )
        n_clusters = connected_components(inc @ inc.T, directed=False)[0]
    return called, n_clusters, share


def run_task(task, seed: int) -> dict:
    cfg = OrcaConfig(seed=seed, progress=False)
    query = task.query.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = run_context(query, task.reference, task.labels_key, cfg)
        warm = warm_up(run)
    data = run.data
    rows = np.asarray(data.output_rows)
    is_query = ~np.isin(data.domain, np.unique(data.domain[data.labeled]))
    types = seen_similarity(warm.net, run.cells, rows, run.comm)[1].argmax(axis=1)
    called, n_clusters, share = da_calls(run.pca(30), is_query, rows, types)
    novel = ~np.isin(np.asarray(task.truth, dtype=str), list(task.seen))
    both = 0 < novel.sum() < novel.size
    return {
        "novel->novel": called[novel].mean() if novel.any() else np.nan,
        "known->novel": called[~novel].mean(),
        "candidates": n_clusters,
        "true": len(task.novel),
        "auroc_share": roc_auc_score(novel, share) if both else np.nan,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--out", type=Path, default=Path("reports/neighbourhood_da.md"))
    args = ap.parse_args()
    specs = dev_suite(args.data if args.data.is_dir() else None, large=False, only=args.only)
    rows = []
    for spec in specs:
        for seed in args.seeds:
            task = spec.make(seed)
            if task.single:  # one batch: the label-desert test is this test's counterpart
                break
            rows.append({"task": spec.name, "seed": seed, **run_task(task, seed)})
            print(rows[-1], flush=True)
    runs = pd.DataFrame(rows)
    g = runs.groupby("task", sort=False)
    mean, sd = g.mean(numeric_only=True), g.std(ddof=0, numeric_only=True)
    cols = ["novel->novel", "known->novel", "candidates", "true", "auroc_share"]
    lines = ["| task | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for task, m in mean.iterrows():
        lines.append(
            f"| {task} | " + " | ".join(mean_sd(m[c], sd.loc[task, c]) for c in cols) + " |"
        )
    nn, kn = mean["novel->novel"], mean["known->novel"]
    lines += [
        "",
        f"novel->novel >= 0.9 on {int((nn >= 0.9).sum())} of {int(nn.notna().sum())} tasks; "
        f"known->novel <= 0.05 on {int((kn <= 0.05).sum())} of {kn.size}; "
        f"median AUROC of the neighbourhood query share {np.nanmedian(mean['auroc_share']):.3f}",
    ]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
