"""What the labels say about unlabelled cells in a batch with labelled ones: unlabelled cells among
labelled ones are of known types (:func:`labelled_support`); improbably few labelled neighbours
mark a type nobody labelled (:func:`label_deserts`, a binomial test); batches where labelled and
unlabelled cells are two populations say nothing (:func:`segregated_batches`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .._config import DiscoveryConfig
from .compute import kneighbors

_DEFAULTS = DiscoveryConfig()


def labelled_neighbours(
    labeled: np.ndarray,
    domain: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    n_neighbors: int = _DEFAULTS.n_neighbors,
) -> tuple[np.ndarray, np.ndarray]:
    """Labelled fraction of every cell's ``n_neighbors`` nearest neighbours (itself excluded),
    found within each batch that has labelled cells, in the PCA of that batch's cells
    (``pca_of(idx)``). Returns ``(fraction, tested)``; cells of batches without labels are not
    tested (fraction 0).
    """
    frac = np.zeros(labeled.shape[0])
    tested = np.zeros(labeled.shape[0], dtype=bool)
    for d in np.unique(domain[labeled]):  # loop over batches, not cells
        idx = np.flatnonzero(domain == d)
        if idx.size <= n_neighbors:
            continue
        frac[idx] = labeled[idx][kneighbors(pca_of(idx), n_neighbors)].mean(axis=1)
        tested[idx] = True
    return frac, tested


def labelled_support(
    labeled: np.ndarray,
    domain: np.ndarray,
    frac: np.ndarray,
    tested: np.ndarray,
    *,
    n_neighbors: int = _DEFAULTS.n_neighbors,
    min_fraction: float = _DEFAULTS.support_fraction,
    min_count: int = _DEFAULTS.support_min,
) -> np.ndarray:
    """Unlabelled cells that sit among labelled cells, so are not of a novel type.

    In a batch where cells were labelled at random, a cell of a known type has about a fraction
    ``f`` of labelled cells among its nearest neighbours (``frac``, from
    :func:`labelled_neighbours`), while a cell of a type nobody labelled has few or none. ``f`` is
    measured around the batch's labelled cells (their neighbours are cells of their own type). An
    unlabelled cell with at least ``min_fraction`` of that fraction (and at least ``min_count``
    labelled neighbours of ``n_neighbors``) is
    supported by labels: the seen heads may score it poorly (a small class fitted to its few
    labelled cells) or a wrong seen head may have absorbed it, but it is no novel type. Untested
    cells (batches without labels) are never supported. Returns a boolean mask.
    """
    supported = np.zeros(labeled.shape[0], dtype=bool)
    for idx, expected in _tested_batches(labeled, domain, frac, tested):
        floor = max(min_count / n_neighbors, min_fraction * expected)
        supported[idx] = ~labeled[idx] & (frac[idx] >= floor)
    return supported


def _tested_batches(labeled, domain, frac, tested):
    """For each batch with tested cells (:func:`labelled_neighbours`): its tested cells and the
    labelled fraction ``f`` expected around a cell of a known type, measured around its labelled
    cells.
    """
    for d in np.unique(domain[tested]):  # loop over batches, not cells
        idx = np.flatnonzero((domain == d) & tested)
        yield idx, frac[idx][labeled[idx]].mean()


def label_deserts(
    labeled: np.ndarray,
    domain: np.ndarray,
    frac: np.ndarray,
    tested: np.ndarray,
    *,
    n_neighbors: int = _DEFAULTS.n_neighbors,
    alpha: float = _DEFAULTS.desert_alpha,
) -> np.ndarray:
    """Unlabelled cells whose neighbourhood lacks labels: improbably few labelled neighbours.

    The counterpart of :func:`labelled_support`. In a batch where cells were labelled at random,
    a cell of a known type has about a fraction ``f`` of labelled cells among its
    ``n_neighbors`` nearest neighbours (``frac``, from :func:`labelled_neighbours`; ``f`` is
    measured around the batch's labelled cells). A cell with so few that a binomial draw at ``f``
    gives as few with probability below ``alpha`` (0 or 1 of 15 at ``f`` = 0.4) sits among cells
    nobody labelled: a type without labels, even when a seen head scores it confidently. Untested
    cells (batches without labels) are never deserts. Returns a boolean mask.
    """
    from scipy.stats import binom

    desert = np.zeros(labeled.shape[0], dtype=bool)
    for idx, expected in _tested_batches(labeled, domain, frac, tested):
        count = np.rint(frac[idx] * n_neighbors)
        desert[idx] = ~labeled[idx] & (binom.cdf(count, n_neighbors, expected) < alpha)
    return desert


def query_batch_cells(labels: np.ndarray, domain: np.ndarray) -> np.ndarray:
    """``(n,)`` bool: the cells of batches without any labelled cell (``labels >= 0``), i.e. of
    a separate query.
    """
    return ~np.isin(domain, np.unique(domain[labels >= 0]))


def segregated_batches(
    labeled: np.ndarray,
    domain: np.ndarray,
    supported: np.ndarray,
    tested: np.ndarray,
    *,
    min_supported: float = _DEFAULTS.segregated_support,
) -> list[int]:
    """Batches whose labelled and unlabelled cells are two populations, not a random draw.

    :func:`labelled_support` and :func:`label_deserts` assume that a batch's labelled cells were
    drawn from its cells at random, so that unlabelled cells of known types sit among labelled
    ones. When under ``min_supported`` of a tested batch's unlabelled cells do, the labels were
    not given at random (typically a reference and a query concatenated into one batch): every
    unlabelled cell looks like a desert. Returns the codes of those batches.
    """
    out = []
    for d in np.unique(domain[tested]):  # loop over batches, not cells
        u = tested & (domain == d) & ~labeled
        if u.any() and supported[u].mean() < min_supported:
            out.append(int(d))
    return out


@dataclass(frozen=True)
class _LabelEvidence:
    """What the labels say about unlabelled cells that share a batch with labelled ones:
    ``supported`` (among labelled cells: of known types), ``desert`` (improbably few labelled
    neighbours: a type nobody labelled) and the ``segregated`` batches, where labelled and
    unlabelled cells are two populations and deserts say nothing.
    """

    supported: np.ndarray
    desert: np.ndarray
    segregated: list[int]


def _label_evidence(lab, domain, pca_cells, cfg: DiscoveryConfig, domain_names) -> _LabelEvidence:
    # unlabelled cells among labelled ones (same batch) are of known types, however poorly the
    # seen heads score them
    nb_frac, tested = labelled_neighbours(lab, domain, pca_cells, n_neighbors=cfg.n_neighbors)
    supported = labelled_support(
        lab, domain, nb_frac, tested, n_neighbors=cfg.n_neighbors,
        min_fraction=cfg.support_fraction, min_count=cfg.support_min,
    )  # fmt: skip
    # unlabelled cells among unlabelled ones, in batches labelled at random: a type nobody
    # labelled, even where a seen head scores it confidently
    desert = label_deserts(
        lab, domain, nb_frac, tested, n_neighbors=cfg.n_neighbors, alpha=cfg.desert_alpha
    )
    # ... but only where labels were given among the batch's cells at random: where almost no
    # unlabelled cell has labelled neighbours, labelled and unlabelled cells are two populations
    # (e.g. a reference and a query concatenated without batch_key) and a lack of labels says
    # nothing
    segregated = segregated_batches(
        lab, domain, supported, tested, min_supported=cfg.segregated_support
    )
    for d in segregated:
        desert[domain == d] = False
        where = f" of batch {domain_names[d]!r}" if domain_names and len(domain_names) > 1 else ""
        warnings.warn(
            f"The labelled and unlabelled cells{where} barely share neighbourhoods (under "
            f"{cfg.segregated_support:.0%} of the unlabelled cells have labelled neighbours). If "
            "they come from different samples or technologies, pass batch_key=... (or the "
            "reference as a separate AnnData) so that the unlabelled cells are aligned and "
            "treated as a query; as it is, known types may be reported as novel clusters.",
            stacklevel=4,
        )
    return _LabelEvidence(supported, desert, segregated)
