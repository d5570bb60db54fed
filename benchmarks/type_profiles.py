"""Whether each type of one batch looks like the type of the same name in another: the
correlation of mean-centred type profiles across two batches of one AnnData.

A reference type whose profile matches a query type of another name (a sorted population that
is not what its name says, a type the query annotates more finely) decides a novelty call before
any method does: a query type closer to a reference type than that type's namesake is cannot be
told novel from the reference. Prints, per type of batch A, its correlation with every type of
batch B; then, for each type of either batch, its best match in the other and its namesake's;
writes the table with ``--out``.

Example (the sorted-PBMC family of the development suite)::

    python benchmarks/type_profiles.py ../shared/data/pbmc_sorted_vs_3k.h5ad \\
        --labels-key cell_type_common --batch-key batch \\
        --a Zheng2017_sorted_10xv1 --b pbmc3k_10xv1

Profiles: counts normalised to 10^4 per cell and log1p-transformed (values already
log-normalised are used as they are), the 2,000 most variable genes of the two batches
together, each (batch, type)'s mean minus the mean of all cells of the two batches; types with
fewer than ``--min-cells`` cells in a batch are left out.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd


def type_profiles(adata, labels_key: str, batch_key: str, a: str, b: str, min_cells: int = 10,
                  n_genes: int = 2000) -> pd.DataFrame:  # fmt: skip
    """Correlations ``(types of a, types of b)`` of the mean-centred log profiles."""
    import scanpy as sc
    import scipy.sparse as sp

    from orca_sc._read import to_log_normalized

    ad = adata[adata.obs[batch_key].astype(str).isin([a, b])].copy()
    ad.X, _ = to_log_normalized(sp.csr_matrix(ad.X, dtype=np.float32), 1e4)  # as orca_sc reads it
    sc.pp.highly_variable_genes(ad, n_top_genes=min(n_genes, ad.n_vars))
    ad = ad[:, ad.var["highly_variable"]]
    X = ad.X
    mean_all = np.asarray(X.mean(axis=0)).ravel()
    batch = ad.obs[batch_key].astype(str).to_numpy()
    label = ad.obs[labels_key].astype(str).to_numpy()

    def profiles(which: str) -> dict[str, np.ndarray]:
        out = {}
        for t in sorted(set(label[batch == which])):  # loop over types, not cells
            rows = (batch == which) & (label == t)
            if rows.sum() >= min_cells:
                out[t] = np.asarray(X[rows].mean(axis=0)).ravel() - mean_all
        return out

    pa, pb = profiles(a), profiles(b)
    corr = [[float(np.corrcoef(pa[s], pb[t])[0, 1]) for t in pb] for s in pa]
    return pd.DataFrame(corr, index=list(pa), columns=list(pb))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("h5ad")
    parser.add_argument("--labels-key", required=True)
    parser.add_argument("--batch-key", required=True)
    parser.add_argument("--a", required=True, help="the batch whose types are the rows")
    parser.add_argument("--b", required=True, help="the batch whose types are the columns")
    parser.add_argument("--min-cells", type=int, default=10)
    parser.add_argument("--out", help="also write the table to this CSV file")
    args = parser.parse_args(argv)
    import anndata

    adata = anndata.read_h5ad(args.h5ad)
    for key in (args.labels_key, args.batch_key):
        if key not in adata.obs:
            print(f"error: obs has no column {key!r}; it has {list(adata.obs.columns)}",
                  file=sys.stderr)  # fmt: skip
            return 2
    batches = set(adata.obs[args.batch_key].astype(str))
    for name in (args.a, args.b):
        if name not in batches:
            print(f"error: no batch {name!r} in obs[{args.batch_key!r}]; there are "
                  f"{sorted(batches)}", file=sys.stderr)  # fmt: skip
            return 2
    table = type_profiles(adata, args.labels_key, args.batch_key, args.a, args.b, args.min_cells)
    with pd.option_context("display.width", 200, "display.max_columns", 50):
        print(table.round(2).to_string())
    print()
    for t, row in table.iterrows():  # loop over types of a
        best = row.idxmax()
        same = f"{row[t]:.2f}" if t in row.index else "absent"
        print(f"{args.a} {t}: best match {best} ({row[best]:.2f}); its namesake {same}")
    for t, col in table.items():  # loop over types of b
        best = col.idxmax()
        same = f"{col[t]:.2f}" if t in col.index else "absent"
        print(f"{args.b} {t}: best match {best} ({col[best]:.2f}); its namesake {same}")
    if args.out:
        table.to_csv(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
