"""ORCA's objective (paper Eq. 1-4) on one mini-batch: the supervised cross-entropy with a margin,
the pairwise loss on most-similar pairs (true pairs for labelled cells, the nearest neighbour
for unlabelled ones), the entropy regulariser of the mean prediction, and the adaptive margin;
and SimCLR's NT-Xent, which the vision submodule's pretraining and the cells' pretraining study
(:mod:`orca_sc._pretrain`) share.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._config import HEAD_SCALE

_EPS = 1e-7


# --------------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------------
def margin_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, margin: float, scale: float = HEAD_SCALE
) -> torch.Tensor:
    """Supervised term with the uncertainty-adaptive margin (paper Eq. 3).

    ``logits`` are ``s * cos`` from :class:`NormedLinear`. The target logit becomes
    ``s * (cos + margin)``: a positive ``margin`` makes the true class *easier*, which is the paper's
    "negative margin" that keeps seen classes from tightening faster than novel ones. ``margin = 0``
    is plain cross-entropy.
    """
    if target.numel() == 0:
        return logits.sum() * 0.0
    return F.cross_entropy(logits + scale * margin * _onehot(logits, target), target)


def _onehot(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``F.one_hot(target, K)`` in ``logits``' dtype, without its range check (which makes a GPU
    wait for the host).
    """
    return torch.zeros_like(logits).scatter_(1, target[:, None], 1.0)


def masked_margin_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, margin: float, scale: float = HEAD_SCALE
) -> torch.Tensor:
    """:func:`margin_cross_entropy` over the rows with ``target >= 0`` (the others are
    ignored; 0 when there are none), without selecting them: a boolean selection would make a
    GPU wait for the host on every step.
    """
    lab = target >= 0
    onehot = _onehot(logits, target.clamp_min(0))  # (B, K)
    total = F.cross_entropy(
        logits + scale * margin * onehot, target, ignore_index=-1, reduction="sum"
    )
    return total / lab.sum().clamp_min(1)


def pairwise_loss(prob: torch.Tensor, prob_pair: torch.Tensor) -> torch.Tensor:
    """Pairwise objective (paper Eq. 4): ``mean(-log <p_i, p'_j>)`` over the chosen positive pairs."""
    if prob.shape[0] == 0:
        return prob.sum() * 0.0
    sim = (prob * prob_pair).sum(dim=1)  # (B,)
    return -torch.log(sim.clamp_min(_EPS)).mean()


def entropy_regularizer(prob: torch.Tensor, prior: torch.Tensor | None = None) -> torch.Tensor:
    """Regulariser of the mean prediction (paper Eq. 5): ``KL(mean p || prior)``.

    With the uniform prior (``None``) this is ``log K - H(mean p)``, the paper's maximum-entropy
    regulariser; zero when the heads are used as the prior says.
    """
    mean = prob.mean(dim=0)  # (K,)
    if prior is None:
        entropy = -(mean * torch.log(mean.clamp_min(_EPS))).sum()
        return math.log(prob.shape[1]) - entropy
    return (mean * (torch.log(mean.clamp_min(_EPS)) - torch.log(prior.clamp_min(_EPS)))).sum()


def joint_cosine_features(*spaces: torch.Tensor) -> torch.Tensor:
    """Features whose cosine similarity is the mean of the cosine similarities in ``spaces``.

    Each ``(B, D_i)`` tensor is L2-normalised and they are concatenated (detached): for two
    rows, the dot product of the result is the sum of their cosines, and its norm is
    ``sqrt(len(spaces))``, so its cosine is their mean. :func:`select_pairs` on these features
    picks the partner that is closest on average over the spaces.
    """
    return torch.cat([F.normalize(s.detach(), dim=1) for s in spaces], dim=1)


def split_cosine_similarity(
    fixed: torch.Tensor, learned: torch.Tensor, fixed_only: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two ``(B, B)`` similarities for :func:`select_pairs` and the rows that read the first:
    the cosines in the ``fixed`` ``(B, P)`` space alone, and the mean of the cosines in it and
    in the ``learned`` ``(B, D)`` space (as :func:`joint_cosine_features`). A row of
    ``fixed_only`` finds its partner, and is checked among the partner's nearest cells, in the
    first; every other row in the second.
    """
    p = F.normalize(fixed.detach(), dim=1)
    joint = F.normalize(joint_cosine_features(fixed, learned), dim=1)
    return p @ p.T, joint @ joint.T, fixed_only


def select_pairs(
    features: torch.Tensor,
    labels: torch.Tensor,
    generator: torch.Generator | None = None,
    mutual: int = 0,
    similarity: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Index of each cell's positive partner within the mini-batch (paper §3.3).

    Labelled cells (``labels >= 0``) get a random *other* cell of the same class in the batch (itself
    when it is its class's only cell in the batch). Unlabelled cells get their nearest neighbour by
    cosine similarity among all other cells of the batch. With ``mutual = k > 0``, that neighbour
    is kept only when the cell is also among the neighbour's ``k`` nearest cells of the batch;
    otherwise the cell is its own partner (the pairwise term then asks its two dropout views to
    agree). ``similarity``: two ``(B, B)`` similarities and a ``(B,)`` mask to use instead of
    the cosines of ``features`` (:func:`split_cosine_similarity`): a masked row's neighbour, and
    the neighbour's nearest cells, are read in the first, every other row's in the second; both
    are used up (their diagonals overwritten).
    Fully vectorised: ``O(B^2)`` on the batch.
    """
    n = features.shape[0]
    device = features.device
    self_idx = torch.arange(n, device=device)
    # unlabelled: cosine nearest neighbour, self excluded
    if similarity is None:
        f = F.normalize(features.detach(), dim=1)
        nn_idx = _nearest(f @ f.T, mutual, self_idx)  # (B, B) cosines
    else:  # both read for every row (no wait on the device), each row keeps its own
        first, second, use_first = similarity
        nn_idx = torch.where(use_first, _nearest(first.detach(), mutual, self_idx),
                             _nearest(second.detach(), mutual, self_idx))  # fmt: skip
    lab = labels >= 0
    partner = _random_class_partner(labels, generator)
    return torch.where(lab, partner, nn_idx) if n > 1 else self_idx


def _nearest(sim: torch.Tensor, mutual: int, self_idx: torch.Tensor) -> torch.Tensor:
    """Each row's nearest other cell by ``sim`` (changed in place: its diagonal), or the cell
    itself where it is not among that cell's ``mutual`` nearest (:func:`select_pairs`).
    """
    n = sim.shape[0]
    sim.fill_diagonal_(-math.inf)
    if mutual > 0 and n > 2:
        # a cell that is not among its neighbour's k nearest cells sits outside the neighbour's
        # group (e.g. the batch holds no other cell of its type): pair it with itself
        topk = sim.topk(min(mutual, n - 1), dim=1).indices  # (B, k), nearest first
        nn_idx = topk[:, 0]
        is_mutual = (topk[nn_idx] == self_idx[:, None]).any(dim=1)
        return torch.where(is_mutual, nn_idx, self_idx)
    return sim.argmax(dim=1)


def _random_class_partner(labels: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """For each cell a uniformly random *other* cell of its label (itself when it is alone):
    the cells of each label are put in a random cyclic order and each is paired with the next.
    In a uniformly random cycle the next cell is uniform among the others, so each cell's
    partner has the distribution of an independent draw (the partners of different cells are
    no longer independent of each other; the loss's expectation is the same). It costs ``B``
    random numbers and two sorts of ``B`` keys (``B x B`` random numbers and a masked argmax
    before). Static shapes: no wait on the device.
    """
    n = labels.shape[0]
    device = labels.device
    # drawn where the generator lives (the training device: no copy from the host)
    gen_device = generator.device if generator is not None else torch.device("cpu")
    shuffled = torch.argsort(torch.rand(n, generator=generator, device=gen_device).to(device))
    order = shuffled[torch.argsort(labels[shuffled], stable=True)]  # by label, random within
    run = labels[order]
    pos = torch.arange(n, device=device)
    first = torch.ones(n, dtype=torch.bool, device=device)
    last = torch.ones(n, dtype=torch.bool, device=device)
    first[1:] = run[1:] != run[:-1]
    last[:-1] = first[1:]
    start = torch.cummax(torch.where(first, pos, 0), dim=0).values  # first position of the run
    nxt = torch.where(last, start, pos + 1)  # the next cell of the run, cyclically
    partner = torch.empty_like(order)
    partner[order] = order[nxt]
    return partner


# --------------------------------------------------------------------------------------------
# the whole objective: one implementation for single-cell and vision
# --------------------------------------------------------------------------------------------
def adaptive_margin(
    mode: str, uncertainty: float, lam: float = 1.0, max_margin: float = 0.5, fixed: float = 0.5
) -> float:
    """The margin of the supervised term for one epoch (paper Eq. 3-4).

    ``"adaptive"``: ``min(lam * uncertainty, max_margin)`` with ``uncertainty`` the mean
    ``1 - max softmax`` of the unlabelled examples (the reference code caps it at 0.5);
    ``"fixed"``: ``fixed`` (ORCA-FNM, 0.5 in the paper); ``"zero"``: 0 (ORCA-ZM).
    """
    if mode == "adaptive":
        return min(lam * uncertainty, max_margin)
    if mode == "fixed":
        return fixed
    if mode == "zero":
        return 0.0
    raise ValueError(f"margin mode must be 'adaptive', 'fixed' or 'zero', not {mode!r}")


class ObjectiveTerms(NamedTuple):
    """``loss = supervised + eta1 * pairwise + eta2 * regularizer`` and its terms (0-d tensors)."""

    loss: torch.Tensor
    supervised: torch.Tensor
    pairwise: torch.Tensor
    regularizer: torch.Tensor


def orca_objective(
    logits: torch.Tensor,
    logits_pair: torch.Tensor,
    pair_space: torch.Tensor,
    labels: torch.Tensor,
    margin: float,
    *,
    eta1: float = 1.0,
    eta2: float = 1.0,
    prior: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    mutual: int = 0,
    supervised: bool = True,
    regularizer: bool = True,
    scale: float = HEAD_SCALE,
    pair_similarity: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> ObjectiveTerms:
    """ORCA's objective on one mini-batch (paper Eq. 1): margin cross-entropy on the labelled
    examples, pairwise term on each example's positive partner, regulariser of the mean prediction.

    ``logits`` ``(B, K)`` from one forward pass; ``logits_pair`` ``(B, K)`` from a second one (another
    dropout mask for cells, another augmented view for images): each example's prediction is
    compared with its partner's prediction in the second pass. ``pair_space`` ``(B, P)``: where
    unlabelled examples look for their nearest neighbour (:func:`select_pairs`); ``labels`` ``(B,)``
    class index, ``-1`` for unlabelled; ``pair_similarity``: their similarities, where given
    (:func:`split_cosine_similarity`). Used unchanged by the single-cell trainer and by
    :mod:`orca_sc.vision`.
    """
    zero = logits.sum() * 0.0
    sup = masked_margin_cross_entropy(logits, labels, margin, scale) if supervised else zero
    prob = F.softmax(logits, dim=1)
    prob2 = F.softmax(logits_pair, dim=1)
    pair_idx = select_pairs(pair_space, labels, generator, mutual=mutual,
                            similarity=pair_similarity)  # fmt: skip
    # index_select, not prob2[pair_idx]: the indexed gather's backward accumulates the rows of
    # partners shared by several cells on several threads in a varying order (with hundreds of
    # heads), so the same seed gave other labels
    pair = pairwise_loss(prob, prob2.index_select(0, pair_idx))
    reg = entropy_regularizer(prob, prior) if regularizer else zero
    return ObjectiveTerms(sup + eta1 * pair + eta2 * reg, sup, pair, reg)


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float = 0.5) -> torch.Tensor:
    """SimCLR's NT-Xent loss: for each of the ``2B`` projections, cross-entropy of its cosine
    similarities / ``temperature`` to the other ``2B - 1``, with its other view as the positive.
    """
    z = F.normalize(torch.cat([z1, z2]), dim=1)  # (2B, P)
    n = z1.shape[0]
    sim = (z @ z.T) / temperature
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device), -math.inf)
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, target)
