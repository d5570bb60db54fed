import math

import numpy as np
import torch
import torch.nn.functional as F

from orca_sc import HEAD_SCALE
from orca_sc.losses import (
    entropy_regularizer,
    joint_cosine_features,
    margin_cross_entropy,
    orca_objective,
    pairwise_loss,
    select_pairs,
    split_cosine_similarity,
)
from orca_sc.module import NormedLinear, OrcaNet, dropout


def test_margin_ce_equals_plain_ce_at_zero_margin():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 5, generator=g) * 3
    target = torch.tensor([0, 1, 2, 3, 4, 0, 1])
    assert torch.allclose(
        margin_cross_entropy(logits, target, 0.0), F.cross_entropy(logits, target)
    )


def test_margin_ce_hand_computed():
    # two classes, cosines (0.2, 0.5), target 0, margin 0.3, s = 10:
    # loss = -log(e^{10*(0.2+0.3)} / (e^{10*(0.2+0.3)} + e^{10*0.5})) = log 2
    logits = HEAD_SCALE * torch.tensor([[0.2, 0.5]])
    loss = margin_cross_entropy(logits, torch.tensor([0]), 0.3)
    assert math.isclose(float(loss), math.log(2), rel_tol=1e-5)
    # a positive margin makes the true class easier: loss decreases
    assert float(margin_cross_entropy(logits, torch.tensor([0]), 0.5)) < float(loss)


def test_margin_ce_empty_batch_is_zero_and_differentiable():
    logits = torch.randn(0, 3, requires_grad=True)
    loss = margin_cross_entropy(logits, torch.zeros(0, dtype=torch.long), 0.2)
    loss.backward()
    assert float(loss.detach()) == 0.0


def test_pairwise_loss_hand_computed():
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    q = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    # <p0,q0> = 1 -> 0 ; <p1,q1> = 0.5 -> log 2 ; mean = log(2)/2
    assert math.isclose(float(pairwise_loss(p, q)), math.log(2) / 2, rel_tol=1e-6)


def test_entropy_regularizer_uniform_and_collapsed():
    uniform = torch.full((4, 4), 0.25)
    assert abs(float(entropy_regularizer(uniform))) < 1e-6
    collapsed = torch.tensor([[1.0, 0, 0, 0]] * 3)
    assert math.isclose(float(entropy_regularizer(collapsed)), math.log(4), rel_tol=1e-5)
    # mean prediction (0.75, 0.25): log 2 - H = log 2 + 0.75 log .75 + .25 log .25
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    expected = math.log(2) + 0.75 * math.log(0.75) + 0.25 * math.log(0.25)
    assert math.isclose(float(entropy_regularizer(p)), expected, rel_tol=1e-5)
    # KL to a prior equal to the mean prediction is zero
    assert abs(float(entropy_regularizer(p, torch.tensor([0.75, 0.25])))) < 1e-6


def test_normed_head_bounded_by_scale():
    head = NormedLinear(16, 6)
    z = torch.randn(100, 16) * 1000
    out = head(z)
    assert out.abs().max() <= HEAD_SCALE + 1e-4
    # the logit of a weight direction itself reaches exactly s
    w = head.weight.detach()[2:3] * 7.0
    assert math.isclose(float(head(w)[0, 2].detach()), HEAD_SCALE, rel_tol=1e-5)


def test_with_novel_heads_returns_a_new_net_and_keeps_old_weights():
    torch.manual_seed(0)
    net = OrcaNet(20, 3, (16, 8), 0.1)
    old = net.head.weight.detach().clone()
    state = torch.random.get_rng_state()
    new = net.with_novel_heads(torch.ones(2, 8))
    assert torch.equal(torch.random.get_rng_state(), state)  # no random draw
    assert new is not net and net.n_heads == 3 and new.n_heads == 5  # the old net is untouched
    assert torch.equal(new.head.weight[:3].detach(), old)
    assert torch.equal(new.head.weight[3:].detach(), torch.ones(2, 8))
    x = torch.randn(4, 20)
    net.eval(), new.eval()
    # same backbone (a copy): same embedding; the seen heads' logits are unchanged
    assert torch.allclose(net(x)[0], new(x)[0][:, :3])
    assert new.backbone.net[0].weight.data_ptr() != net.backbone.net[0].weight.data_ptr()


def test_select_pairs_labelled_same_class_and_unlabelled_nearest():
    feats = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [1.0, 0.05], [-1.0, 0.0]])
    labels = torch.tensor([0, 0, 1, -1, -1, 2])
    g = torch.Generator().manual_seed(0)
    idx = select_pairs(feats, labels, g)
    assert idx[0] == 1 and idx[1] == 0  # only same-class partner, never itself
    assert idx[2] == 2  # alone in its class in the batch -> itself
    assert idx[5] == 5
    assert idx[3] == 2  # nearest by cosine among the other cells (any label)
    assert idx[4] == 0


def test_joint_cosine_features_average_the_cosines_and_pair_close_in_both_spaces():
    pca = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.8, 0.6], [0.0, 1.0]])
    emb = torch.tensor([[0.0, 2.0], [3.0, 0.0], [0.1, 1.0], [1.0, 1.0]])
    joint = joint_cosine_features(pca, emb)

    def cos(a):
        a = F.normalize(a, dim=1)
        return a @ a.T

    assert torch.allclose(cos(joint), (cos(pca) + cos(emb)) / 2, atol=1e-6)
    unlabelled = torch.full((4,), -1)
    # cell 0: nearest in the PCA is cell 1, in the embedding cell 2; jointly cell 2 (0.8 + 0.995)
    assert int(select_pairs(pca, unlabelled)[0]) == 1
    assert int(select_pairs(emb, unlabelled)[0]) == 2
    assert int(select_pairs(joint, unlabelled)[0]) == 2
    mean_cos = ((cos(pca) + cos(emb)) / 2).fill_diagonal_(-2.0)
    assert torch.equal(select_pairs(joint, unlabelled), mean_cos.argmax(dim=1))


def test_split_similarity_reads_the_fixed_space_alone_for_its_rows_and_both_elsewhere():
    """``pair_space="query_pca"``: rows of batches without labelled cells find their partner,
    and are checked among the partner's nearest cells, in the PCA alone; the other rows pair
    exactly as with ``"both"``.
    """
    g = torch.Generator().manual_seed(0)
    pca, emb = torch.randn(200, 30, generator=g), torch.randn(200, 64, generator=g)
    labels = torch.full((200,), -1)
    labels[:60] = torch.randint(0, 3, (60,), generator=g)
    fixed = torch.zeros(200, dtype=torch.bool)
    fixed[120:] = True

    def pairs(feats, similarity=None):
        gen = torch.Generator().manual_seed(1)
        return select_pairs(feats, labels, gen, mutual=3, similarity=similarity)

    split = pairs(emb, split_cosine_similarity(pca, emb, fixed))
    both, alone = pairs(joint_cosine_features(pca, emb)), pairs(pca)
    assert torch.equal(split[~fixed], both[~fixed]) and torch.equal(split[fixed], alone[fixed])
    assert not torch.equal(both[fixed], alone[fixed])  # the two spaces do pair differently
    none = split_cosine_similarity(pca, emb, torch.zeros(200, dtype=torch.bool))
    assert torch.equal(pairs(emb, none), both)


def test_select_pairs_mutual_keeps_pairs_within_groups_and_self_pairs_strangers():
    deg = torch.tensor([0.0, 1.0, 3.0, 7.0, 20.0, 90.0, 91.0])  # 4-cell group, a stranger, a pair
    rad = torch.deg2rad(deg)
    feats = torch.stack([torch.cos(rad), torch.sin(rad)], dim=1)
    unlabelled = torch.full((7,), -1)
    paper = select_pairs(feats, unlabelled)
    assert paper.tolist() == [1, 0, 1, 2, 3, 6, 5]  # the stranger (4) pairs into the group
    mutual = select_pairs(feats, unlabelled, mutual=3)
    # cell 3 is among its neighbour's (2) 3 nearest cells; the stranger is not among cell 3's
    assert mutual.tolist() == [1, 0, 1, 2, 4, 6, 5]
    assert select_pairs(feats, unlabelled, mutual=1).tolist() == [1, 0, 2, 3, 4, 6, 5]
    # labelled cells keep their same-class partners whatever the rule
    labels = torch.tensor([-1, -1, -1, -1, 0, 0, -1])
    assert select_pairs(feats, labels, mutual=3)[4:6].tolist() == [5, 4]


def test_select_pairs_random_partner_within_class():
    labels = torch.tensor([0] * 10)
    feats = torch.randn(10, 4)
    g = torch.Generator().manual_seed(1)
    seen = set()
    for _ in range(20):
        idx = select_pairs(feats, labels, g)
        assert torch.all(idx != torch.arange(10))
        seen.update(idx.tolist())
    assert len(seen) > 5  # partners are drawn at random, not always the same cell


def test_labelled_partner_is_uniform_among_the_other_cells_of_its_class():
    """Each labelled cell's partner is another cell of its class, each of them equally often
    (chi-square against uniform), never itself unless it is alone in its class in the batch.
    """
    labels = torch.tensor([2, 0, 2, 1, 2, 2, 0, 2, -1, 7])
    feats = torch.randn(10, 3)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([select_pairs(feats, labels, g) for _ in range(3000)])  # (3000, 10)
    for i, c in enumerate(labels.tolist()):
        if c < 0:
            continue
        others = [j for j, d in enumerate(labels.tolist()) if d == c and j != i]
        got = draws[:, i]
        if not others:  # alone in its class: paired with itself
            assert torch.all(got == i)
            continue
        assert set(got.tolist()) == set(others)
        counts = np.array([(got == j).sum().item() for j in others], dtype=float)
        expected = 3000 / len(others)
        chi2 = ((counts - expected) ** 2 / expected).sum()
        assert chi2 < 20.0, (i, counts)  # df <= 4: p < 0.001 under uniformity


def test_dropout_mask_drops_p_independently():
    from orca_sc.module import keep_mask

    torch.manual_seed(0)
    keep = keep_mask((400, 1000), 0.1, torch.device("cpu"))
    assert keep.shape == (400, 1000) and keep.dtype == torch.bool
    drop = (~keep).double()
    assert abs(drop.mean().item() - 0.1) < 0.003  # 400,000 draws: sd 0.0005
    # the four 16-bit lanes of a 64-bit word are independent: neighbours drop together p^2
    both = (drop[:, :-1] * drop[:, 1:]).mean().item()
    assert abs(both - 0.01) < 0.002
    assert keep_mask((7, 3), 0.0, torch.device("cpu")).all()
    assert not keep_mask((7, 3), 1.0, torch.device("cpu")).any()
    h = torch.ones(64, 512, requires_grad=True)
    out = dropout(h, 0.25, True)
    kept = out != 0
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / 0.75))
    out.sum().backward()
    torch.testing.assert_close(h.grad, kept.float() / 0.75)


def test_orcanet_shapes():
    net = OrcaNet(20, 7, (16, 8), 0.1)
    logits, z = net(torch.randn(5, 20))
    assert logits.shape == (5, 7) and z.shape == (5, 8)
    np.testing.assert_array_less(logits.abs().detach().numpy(), HEAD_SCALE + 1e-4)


def test_objective_gradient_is_the_same_every_time_with_many_heads_and_two_threads():
    """Many cells share a partner, and with hundreds of heads the gradient of the partners'
    predictions is large enough for torch to accumulate it on several threads: it must still be
    the same sum every time (an indexed gather's backward added the shared rows in a varying
    order; annotating 39,000 cells with 402 candidate heads twice gave different labels).
    """
    g = torch.Generator().manual_seed(0)
    b, k = 512, 400
    logits = torch.randn(b, k, generator=g)
    labels = torch.where(
        torch.rand(b, generator=g) < 0.5, torch.randint(0, 4, (b,), generator=g), -1
    )
    space = torch.randn(b, 2, generator=g)  # two dimensions: a few cells are many cells' nearest

    def grad():
        x = logits.clone().requires_grad_(True)
        gen = torch.Generator().manual_seed(1)
        orca_objective(x, x * 0.9, space, labels, 0.2, generator=gen, mutual=0).loss.backward()
        return x.grad

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        first = grad()
        assert all(torch.equal(first, grad()) for _ in range(20))
    finally:
        torch.set_num_threads(threads)
