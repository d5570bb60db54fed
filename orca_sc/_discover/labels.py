"""What the labels say about unlabelled cells in a batch with labelled ones: unlabelled cells among
labelled ones are of known types (:func:`labelled_support`); improbably few labelled neighbours
mark a type nobody labelled (:func:`label_deserts`, a binomial test); batches where labelled and
unlabelled cells are two populations say nothing (:func:`segregated_batches`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .._ablation import DiscoveryRules
from .compute import kneighbors

_DEFAULTS = DiscoveryRules()


#: at most this many times the label tests' neighbourhood is widened (the labelled fraction
#: around labelled cells, measured at the wider neighbourhood, can ask for more)
_WIDEN_ROUNDS = 5


def neighbourhood_size(expected: float, alpha: float, n_neighbors: int, n_cells: int) -> int:
    """How many nearest neighbours the label tests of a batch read: the smallest number ``k`` at
    which a known-type cell without one labelled neighbour is improbable at ``alpha``
    (``(1 - f)^k < alpha`` for the batch's labelled fraction ``f`` around a known-type cell,
    ``expected``), at least ``n_neighbors`` and at most ``n_cells - 1``. At ``f`` = 0.4 and
    ``alpha`` = 0.01 that is 10, so ``n_neighbors`` (15) stands; at ``f`` = 0.05 it is 90: with 15
    neighbours a known-type cell has no labelled one with probability 0.46, so neither the label
    deserts nor the labelled support could tell it from a type nobody labelled.
    """
    if not (0 < expected < 1 and 0 < alpha < 1):  # nothing to widen for (alpha 0: no test)
        return int(n_neighbors)
    k = math.floor(math.log(alpha) / math.log1p(-expected)) + 1
    return int(min(max(n_neighbors, k), n_cells - 1))


def labelled_neighbours(
    labeled: np.ndarray,
    domain: np.ndarray,
    pca_of: Callable[[np.ndarray], np.ndarray],
    *,
    n_neighbors: int = _DEFAULTS.n_neighbors,
    alpha: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Labelled fraction of every cell's nearest neighbours (itself excluded), found within
    each batch that has labelled cells, in the PCA of that batch's cells (``pca_of(idx)``).
    ``n_neighbors`` of them; with ``alpha``, as many as :func:`neighbourhood_size` says for the
    batch's labelled fraction around its labelled cells (more where labels are sparse). Returns
    ``(fraction, tested, size)``: cells of batches without labels are not tested (fraction 0),
    ``size`` is the number of neighbours each tested cell's fraction reads.
    """
    frac = np.zeros(labeled.shape[0])
    tested = np.zeros(labeled.shape[0], dtype=bool)
    size = np.full(labeled.shape[0], n_neighbors, dtype=np.int64)
    for d in np.unique(domain[labeled]):  # loop over batches, not cells
        idx = np.flatnonzero(domain == d)
        if idx.size <= n_neighbors:
            continue
        emb = pca_of(idx)
        lab = labeled[idx]
        frac[idx] = lab[kneighbors(emb, n_neighbors)].mean(axis=1)
        k = n_neighbors
        for _ in range(_WIDEN_ROUNDS if alpha is not None else 0):  # f is measured at k: again
            wider = neighbourhood_size(float(frac[idx][lab].mean()), alpha, n_neighbors, idx.size)
            if wider <= k:
                break
            k = wider
            frac[idx] = lab[kneighbors(emb, k)].mean(axis=1)
        size[idx] = k
        tested[idx] = True
    return frac, tested, size


def labelled_support(
    labeled: np.ndarray,
    domain: np.ndarray,
    frac: np.ndarray,
    tested: np.ndarray,
    *,
    n_neighbors: int | np.ndarray = _DEFAULTS.n_neighbors,
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
        k = _size(n_neighbors, idx)
        floor = max(min_count / k, min_fraction * expected)
        supported[idx] = ~labeled[idx] & (frac[idx] >= floor)
    return supported


def _size(n_neighbors: int | np.ndarray, idx: np.ndarray) -> int:
    """The neighbourhood size of the batch of cells ``idx``: ``n_neighbors``, or its value
    there where it is the per-cell ``size`` of :func:`labelled_neighbours`.
    """
    return int(n_neighbors) if np.ndim(n_neighbors) == 0 else int(n_neighbors[idx[0]])


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
    n_neighbors: int | np.ndarray = _DEFAULTS.n_neighbors,
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
        k = _size(n_neighbors, idx)
        count = np.rint(frac[idx] * k)
        desert[idx] = ~labeled[idx] & (binom.cdf(count, k, expected) < alpha)
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
    #: supported as fully as a labelled cell's neighbourhood is labelled: held on a seen head
    anchored: np.ndarray
    #: the neighbours the tests read in each batch with labelled cells
    neighbours: dict[int, int]


def no_label_evidence(n_cells: int) -> _LabelEvidence:
    """Label evidence that says nothing (the ablation ``drop="label_support"``)."""
    none = np.zeros(n_cells, dtype=bool)
    return _LabelEvidence(none, none.copy(), [], none.copy(), {})


def _label_evidence(lab, domain, pca_cells, cfg: DiscoveryRules, domain_names) -> _LabelEvidence:
    # unlabelled cells among labelled ones (same batch) are of known types, however poorly the
    # seen heads score them
    # (as many neighbours as a test at desert_alpha needs where labels are sparse)
    nb_frac, tested, size = labelled_neighbours(
        lab, domain, pca_cells, n_neighbors=cfg.n_neighbors,
        alpha=cfg.desert_alpha,
    )  # fmt: skip
    supported = labelled_support(
        lab, domain, nb_frac, tested, n_neighbors=size,
        min_fraction=cfg.support_fraction, min_count=cfg.support_min,
    )  # fmt: skip
    # unlabelled cells among unlabelled ones, in batches labelled at random: a type nobody
    # labelled, even where a seen head scores it confidently
    desert = label_deserts(lab, domain, nb_frac, tested, n_neighbors=size, alpha=cfg.desert_alpha)
    # ... but only where labels were given among the batch's cells at random: where almost no
    # unlabelled cell has labelled neighbours, labelled and unlabelled cells are two populations
    # (e.g. a reference and a query concatenated without batch_key) and a lack of labels says
    # nothing
    segregated = segregated_batches(
        lab, domain, supported, tested, min_supported=cfg.segregated_support
    )
    # held on the seen head that claims it: as labelled around as a known-type cell typically
    # is (support_fraction 1), outside the batches whose labels say nothing
    anchored = labelled_support(
        lab, domain, nb_frac, tested, n_neighbors=size, min_fraction=1.0,
        min_count=cfg.support_min,
    )  # fmt: skip
    for d in segregated:
        desert[domain == d] = False
        anchored[domain == d] = False
        where = f" of batch {domain_names[d]!r}" if domain_names and len(domain_names) > 1 else ""
        warnings.warn(
            f"The labelled and unlabelled cells{where} barely share neighbourhoods (under "
            f"{cfg.segregated_support:.0%} of the unlabelled cells have labelled neighbours). If "
            "they come from different samples or technologies, pass batch_key=... (or the "
            "reference as a separate AnnData) so that the unlabelled cells are aligned and "
            "treated as a query; as it is, known types may be reported as novel clusters.",
            stacklevel=4,
        )
    neighbours = {int(d): int(size[tested & (domain == d)][0]) for d in np.unique(domain[tested])}
    return _LabelEvidence(supported, desert, segregated, anchored, neighbours)
