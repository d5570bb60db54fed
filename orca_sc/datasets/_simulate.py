"""Realistic synthetic single-cell counts for tests and scaling benchmarks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import scipy.sparse as sp

from .._errors import OrcaInputError

_CHUNK = 10_000


def simulate(
    n_cells: int = 2000,
    n_genes: int = 2000,
    n_types: int = 8,
    *,
    n_batches: int = 1,
    markers_per_type: int = 40,
    marker_fold: float = 3.0,
    imbalance: float = 5.0,
    batch_strength: float = 0.3,
    library_size: float = 3000.0,
    library_sd: float = 0.4,
    dispersion: float = 5.0,
    batch_weights: Sequence[float] | None = None,
    subtype_of: Mapping[int, int] | None = None,
    subtype_markers: int | None = None,
    type_batch_strength: float = 0.0,
    condition: Mapping[int, Sequence[int]] | None = None,
    condition_genes: int | None = None,
    seed: int = 0,
):
    """Simulate a UMI count matrix of ``n_types`` cell types with negative-binomial noise.

    * a gene's baseline expression follows a heavy-tailed Gamma distribution (most genes low, a few
      high), as in real data;
    * each cell type up-regulates its own program of ``markers_per_type`` genes by a log-normal fold
      around ``marker_fold`` (and down-regulates a few);
    * a type ``t`` in ``subtype_of`` is a subtype of type ``subtype_of[t]``: its parent's whole
      profile plus a program of its own of ``subtype_markers`` genes (default: half a type's),
      e.g. a novel subtype nested in a known type;
    * type proportions fall geometrically: the largest type is ``imbalance`` times the smallest;
    * every batch multiplies each gene by ``exp(N(0, batch_strength))`` and shifts library sizes;
      cells fall into batches evenly, or with probabilities ``batch_weights``;
    * ``type_batch_strength``: a batch effect that differs by cell type, as across technologies
      or animals: every batch but the first also multiplies each gene of each type by
      ``exp(N(0, type_batch_strength))`` (one shift for all types cannot remove it);
    * ``condition``: a gene program the first batch lacks, switched on in some types of some
      batches, as a stimulation does: ``{batch: [types]}``; the program's ``condition_genes``
      genes (default ``markers_per_type``) are up-regulated by a log-normal fold around
      ``marker_fold`` in the cells of those types in that batch;
    * library sizes are log-normal around ``library_size``;
    * counts are Gamma-Poisson (negative binomial) with inverse dispersion ``dispersion``.

    Cells are generated in chunks and stored as CSR float32; the dense matrix is never built.
    Returns an AnnData with ``obs['cell_type']`` (``type_0`` largest), ``obs['batch']``,
    ``obs['condition']`` (whether the cell carries the condition's program) and the true per-type
    mean profile in ``varm['type_means']``. The last two options draw from random streams of
    their own: without them the counts are those of the same seed before they existed.
    """
    _check(n_cells, n_genes, n_types, markers_per_type, subtype_of)
    _check_shift(n_types, n_batches, n_genes, type_batch_strength, condition, condition_genes)
    subtype_of = dict(subtype_of or {})
    n_sub = markers_per_type // 2 if subtype_markers is None else subtype_markers
    rng = np.random.default_rng(seed)
    profiles = _profiles(rng, n_genes, n_types, markers_per_type, marker_fold)
    if subtype_of:  # drawn after the other programs, which stay those of the same seed without
        sub_rng = np.random.default_rng([seed, 1])
        for t, p in sorted(subtype_of.items()):
            profiles[t] = profiles[p]
            up = sub_rng.choice(n_genes, n_sub, replace=False)
            profiles[t, up] += np.log(marker_fold) * sub_rng.lognormal(0.0, 0.3, n_sub)
    profiles = np.exp(profiles)
    profiles /= profiles.sum(axis=1, keepdims=True)  # (T, G) expression fractions
    weights = imbalance ** (-np.arange(n_types) / max(n_types - 1, 1))
    props = weights / weights.sum()
    types = np.repeat(np.arange(n_types), rng.multinomial(n_cells - n_types, props) + 1)
    types = rng.permutation(types)
    batches = _batches(rng, n_cells, n_batches, batch_weights)
    batch_gene = np.exp(rng.normal(0.0, batch_strength, (n_batches, n_genes)))  # (NB, G)
    batch_gene[0] = 1.0 if n_batches == 1 else batch_gene[0]
    batch_lib = np.exp(rng.normal(0.0, batch_strength, n_batches))
    lib = library_size * rng.lognormal(0.0, library_sd, n_cells) * batch_lib[batches]
    shift, stimulated = _type_batch_shift(
        seed, n_types, n_batches, n_genes, types, batches, type_batch_strength, condition,
        markers_per_type if condition_genes is None else condition_genes, marker_fold,
    )  # fmt: skip
    blocks = []
    for start in range(0, n_cells, _CHUNK):
        sl = slice(start, start + _CHUNK)
        p = profiles[types[sl]] * batch_gene[batches[sl]]
        if shift is not None:
            p *= shift[batches[sl], types[sl]]
        p /= p.sum(axis=1, keepdims=True)
        lam = rng.gamma(dispersion, p * lib[sl, None] / dispersion)
        blocks.append(sp.csr_matrix(rng.poisson(lam).astype(np.float32)))
    adata = _as_anndata(sp.vstack(blocks, format="csr"), types, batches, n_types, n_genes)
    adata.obs["condition"] = stimulated
    adata.varm["type_means"] = profiles.T.astype(np.float32)
    adata.uns["simulation"] = {
        "n_types": n_types,
        "n_batches": n_batches,
        "markers_per_type": markers_per_type,
        "marker_fold": marker_fold,
        "imbalance": imbalance,
        "batch_strength": batch_strength,
        "subtype_of": {f"type_{t}": f"type_{p}" for t, p in sorted(subtype_of.items())},
        "type_batch_strength": type_batch_strength,
        "condition": {
            f"batch_{b}": [f"type_{t}" for t in ts] for b, ts in sorted((condition or {}).items())
        },  # fmt: skip
        "seed": seed,
    }
    return adata


def _check(n_cells, n_genes, n_types, markers_per_type, subtype_of) -> None:
    if n_types < 1 or n_cells < n_types or n_genes < markers_per_type:
        msg = "simulate needs n_types >= 1, n_cells >= n_types and n_genes >= markers_per_type."
        raise OrcaInputError(msg)
    for t, p in dict(subtype_of or {}).items():
        if not (0 <= t < n_types and 0 <= p < n_types) or t == p or p in subtype_of:
            msg = (
                f"subtype_of maps type codes in [0, {n_types}) to a different parent that is "
                f"not itself a subtype; got {t} -> {p}."
            )
            raise OrcaInputError(msg)


def _check_shift(n_types, n_batches, n_genes, strength, condition, genes) -> None:
    if strength < 0:
        msg = f"type_batch_strength must be >= 0, got {strength}."
        raise OrcaInputError(msg)
    for b, ts in dict(condition or {}).items():
        if not 0 <= b < n_batches or any(not 0 <= t < n_types for t in ts):
            msg = (
                f"condition maps batches in [0, {n_batches}) to lists of types in [0, {n_types}); "
                f"got {b} -> {list(ts)}."
            )
            raise OrcaInputError(msg)
    if genes is not None and not 0 < genes <= n_genes:
        msg = f"condition_genes must be in [1, {n_genes}], got {genes}."
        raise OrcaInputError(msg)


def _type_batch_shift(seed, n_types, n_batches, n_genes, types, batches, strength, condition,
                      n_program, fold) -> tuple[np.ndarray | None, np.ndarray]:  # fmt: skip
    """Per (batch, type) gene factors ``(NB, T, G)`` of the type-specific batch effect and the
    condition's program (``None``: neither), and which cells carry the program.
    """
    stimulated = np.zeros(types.size, dtype=bool)
    if strength == 0 and not condition:
        return None, stimulated
    rng = np.random.default_rng([seed, 2])
    log_shift = np.zeros((n_batches, n_types, n_genes))
    if strength > 0:
        log_shift[1:] = rng.normal(0.0, strength, (n_batches - 1, n_types, n_genes))
    if condition:
        program = rng.choice(n_genes, n_program, replace=False)
        up = np.log(fold) * rng.lognormal(0.0, 0.3, n_program)
        for b, ts in sorted(condition.items()):
            for t in ts:
                log_shift[b, t, program] += up
            stimulated |= (batches == b) & np.isin(types, list(ts))
    return np.exp(log_shift), stimulated


def _profiles(rng, n_genes: int, n_types: int, markers: int, fold: float) -> np.ndarray:
    """Log mean expression ``(T, G)``: a Gamma baseline, each type's up- and down-regulated
    program.
    """
    base = rng.gamma(0.4, 1.0, n_genes) + 1e-3  # (G,)
    log_means = np.tile(np.log(base), (n_types, 1))  # (T, G)
    for t in range(n_types):
        up = rng.choice(n_genes, markers, replace=False)
        log_means[t, up] += np.log(fold) * rng.lognormal(0.0, 0.3, markers)
        down = rng.choice(n_genes, markers // 4, replace=False)
        log_means[t, down] -= np.log(fold)
    return log_means


def _batches(rng, n_cells: int, n_batches: int, batch_weights) -> np.ndarray:
    if batch_weights is None:
        return rng.integers(0, n_batches, n_cells)
    w = np.asarray(batch_weights, dtype=float)
    if w.shape != (n_batches,) or (w < 0).any() or w.sum() <= 0:
        msg = f"batch_weights needs {n_batches} non-negative numbers, got {batch_weights}."
        raise OrcaInputError(msg)
    return rng.choice(n_batches, n_cells, p=w / w.sum())


def _as_anndata(X, types, batches, n_types: int, n_genes: int):
    import anndata as ad

    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(
                [f"type_{t}" for t in types], categories=[f"type_{t}" for t in range(n_types)]
            ),
            "batch": pd.Categorical([f"batch_{b}" for b in batches]),
        },
        index=[f"cell_{i}" for i in range(len(types))],
    )
    var = pd.DataFrame(index=[f"gene_{g}" for g in range(n_genes)])
    return ad.AnnData(X=X, obs=obs, var=var)
