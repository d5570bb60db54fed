"""Scale (issue 22): input read from disk in chunks, gene selection from streamed statistics,
and the training step's layouts and shortcuts, which must not change what is computed.
"""

import hashlib
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from click.testing import CliRunner
from conftest import FAST, FAST_LAB, FAST_OPTIONS, SHARED_DATA

import orca_sc
import orca_sc._read as read_mod
import orca_sc._store as store_mod
from orca_sc._cells import CellMatrix, infer
from orca_sc._config import OrcaConfig
from orca_sc._data import OrcaInputError, prepare
from orca_sc._hvg import GeneStats, select_from_stats, select_genes
from orca_sc._read import ChunkReader, log_normalize
from orca_sc.cli import main
from orca_sc.losses import margin_cross_entropy, masked_margin_cross_entropy
from orca_sc.module import OrcaNet


# --------------------------------------------------------------------------- gene selection
def _stats(X, batches, n_chunks=3):
    codes = np.unique(batches, return_inverse=True)[1]
    stats = GeneStats(int(codes.max()) + 1, X.shape[1])
    for rows in np.array_split(np.arange(X.shape[0]), n_chunks):
        stats.add(X[rows], codes[rows])
    return stats


@pytest.mark.parametrize("case", ["three batches", "one batch", "a one-cell batch"])
def test_streamed_gene_selection_matches_scanpy(case):
    """Statistics summed over chunks rank the same 200 genes as scanpy's seurat flavour on the
    whole matrix (batch-aware, one batch, and with a batch of one cell that takes no part).
    """
    a = orca_sc.datasets.simulate(1500, 600, 6, n_batches=3, library_size=400, seed=3)
    X = log_normalize(a.X.tocsr(), 1e4)
    batches = a.obs["batch"].astype(str).to_numpy()
    if case == "one batch":
        batches = np.full(X.shape[0], "b")
    elif case == "a one-cell batch":
        batches = batches.copy()
        batches[7] = "lonely"
    genes = list(a.var_names)
    expected = select_genes(X, genes, batches, 200)
    got = select_from_stats(_stats(X, batches), 200)
    assert got.size == expected.size == 200
    np.testing.assert_array_equal(got, expected)


@pytest.mark.skipif(not (SHARED_DATA / "baron_mouse.h5ad").exists(), reason="shared data absent")
def test_streamed_gene_selection_matches_scanpy_on_real_counts():
    import anndata as ad

    a = ad.read_h5ad(SHARED_DATA / "baron_mouse.h5ad")
    X = log_normalize(a.X.tocsr(), 1e4)
    batches = a.obs["batch"].astype(str).to_numpy()
    expected = select_genes(X, list(a.var_names), batches, 2000)
    np.testing.assert_array_equal(select_from_stats(_stats(X, batches, 4), 2000), expected)


# --------------------------------------------------------------------------- reading from disk
@pytest.fixture
def on_disk(tmp_path, monkeypatch):
    """A reference (4 of 6 types, batch 0) and a query (batch 1) as .h5ad, the query also as
    .zarr; chunks of 150 cells, so every input is read in several pieces.
    """
    monkeypatch.setattr(read_mod, "CHUNK_CELLS", 150)
    a = orca_sc.datasets.simulate(1200, 400, 6, n_batches=2, library_size=400, seed=1)
    ref = a[(a.obs["batch"] == "batch_0").to_numpy()].copy()
    ref = ref[ref.obs["cell_type"].isin([f"type_{i}" for i in range(4)]).to_numpy()].copy()
    ref.obs.loc[ref.obs_names[:20], "cell_type"] = np.nan  # unlabelled reference cells: dropped
    query = a[(a.obs["batch"] == "batch_1").to_numpy()].copy()
    paths = {
        "ref": tmp_path / "ref.h5ad",
        "query": tmp_path / "q.h5ad",
        "zarr": tmp_path / "q.zarr",
    }
    ref.write_h5ad(paths["ref"])
    query.write_h5ad(paths["query"])
    with warnings.catch_warnings():  # anndata's notice about the zarr format version
        warnings.simplefilter("ignore", UserWarning)
        query.write_zarr(paths["zarr"])
    return ref, query, paths


def _md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("fmt", ["query", "zarr"])
def test_prepare_from_disk_equals_in_memory(on_disk, fmt):
    ref, query, paths = on_disk
    cfg = OrcaConfig(n_genes=150)
    mem = prepare(query, ref, "cell_type", cfg)
    lazy_q = orca_sc.read_lazy(paths[fmt])
    assert read_mod.on_disk(lazy_q)
    disk = prepare(lazy_q, orca_sc.read_lazy(paths["ref"]), "cell_type", cfg)
    assert disk.info["streamed"] and not mem.info["streamed"]
    assert disk.genes == mem.genes and len(disk.genes) == 150
    assert (disk.X != mem.X).nnz == 0 and disk.X.shape == mem.X.shape
    np.testing.assert_array_equal(disk.labels, mem.labels)
    np.testing.assert_array_equal(disk.domain, mem.domain)
    assert disk.input_scale == mem.input_scale == {"reference": "counts", "query": "counts"}


def test_selected_matrix_from_disk_lives_in_an_unlinked_scratch_file(
    on_disk, tmp_path, monkeypatch
):
    """Input on disk: the selected matrix is written once into arrays of its final size in a
    memory-mapped scratch file, which leaves nothing in the temporary folder; with no room for
    it the arrays are kept in memory, with the same values.
    """
    ref, query, paths = on_disk
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    cfg = OrcaConfig(n_genes=150)
    mem = prepare(query, ref, "cell_type", cfg)
    disk = prepare(
        orca_sc.read_lazy(paths["query"]), orca_sc.read_lazy(paths["ref"]), "cell_type", cfg
    )
    assert isinstance(disk.X.data, np.memmap) and isinstance(disk.X.indices, np.memmap)
    assert list(scratch.iterdir()) == []  # unlinked at once
    assert (disk.X != mem.X).nnz == 0 and disk.X.has_sorted_indices

    def no_room(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_mod.os, "posix_fallocate", no_room, raising=False)
    full = prepare(
        orca_sc.read_lazy(paths["query"]), orca_sc.read_lazy(paths["ref"]), "cell_type", cfg
    )
    assert not isinstance(full.X.data, np.memmap)
    assert (full.X != mem.X).nnz == 0


def test_blocks_of_unknown_size_spill_to_a_mapped_scratch_file(tmp_path, monkeypatch):
    """What ``OrcaModel.predict`` does with input on disk (one pass, the number of stored values
    not known before): the joined matrix lives in unlinked memory-mapped files and equals
    ``sp.vstack`` of the blocks; with no room part-way, the rest is kept in memory, same values.
    """
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr("tempfile.tempdir", None)
    rng = np.random.default_rng(0)
    blocks = [
        sp.random(n, 40, density=0.2, format="csr", dtype=np.float32, random_state=rng)
        for n in (30, 0, 25, 1, 44)
    ]
    expected = sp.vstack(blocks, format="csr")
    b = blocks[2]  # the same block with its columns unsorted within each row
    for r in range(b.shape[0]):
        lo, hi = b.indptr[r], b.indptr[r + 1]
        b.indices[lo:hi], b.data[lo:hi] = b.indices[lo:hi][::-1].copy(), b.data[lo:hi][::-1].copy()
    b.has_sorted_indices = False
    X = store_mod.spill_csr(iter(blocks), 40)
    assert isinstance(X.data, np.memmap) and isinstance(X.indices, np.memmap)
    assert list(scratch.iterdir()) == []
    assert X.shape == (100, 40) and (X != expected).nnz == 0 and X.has_sorted_indices
    X.check_format(full_check=True)

    written = []

    def full_after_two(f, values):
        if len(written) >= 2:
            raise OSError(28, "No space left on device")
        written.append(values.size)
        f.write(memoryview(values).cast("B"))

    monkeypatch.setattr(store_mod, "_append", full_after_two)
    Y = store_mod.spill_csr(iter(blocks), 40)
    assert not isinstance(Y.data, np.memmap)
    assert (Y != expected).nnz == 0
    Y.check_format(full_check=True)
    empty = store_mod.spill_csr(iter([]), 40)
    assert empty.shape == (0, 40) and empty.nnz == 0


def test_annotate_predict_and_cli_from_disk_give_the_in_memory_labels(on_disk, tmp_path):
    """Same seed: the same labels whether the query is in memory, a backed .h5ad or a zarr
    store, from Python or from ``orca-sc annotate --on-disk``; the files are not modified; a
    saved model labels the on-disk query as it labels the in-memory one, and the summary's
    markers come from a sample read from disk.
    """
    ref, query, paths = on_disk
    before = _md5(paths["query"])
    # the command line's schedule (no Ablation there): 10 epochs of at least 15 steps
    kw = {**FAST_OPTIONS, "n_genes": 150, "epochs": 10, "warmup_epochs": 2}
    q_mem = query.copy()
    orca_sc.tl.annotate(q_mem, ref, labels_key="cell_type", save_model=tmp_path / "m.pt", **kw)
    model = orca_sc.OrcaModel.load(tmp_path / "m.pt")
    expected = q_mem.obs["orca_label"].astype(str).to_numpy()
    assert len(set(expected) - set(ref.obs["cell_type"].dropna())) >= 1  # a novel cluster
    for fmt in ("query", "zarr"):
        q = orca_sc.read_lazy(paths[fmt])
        orca_sc.tl.annotate(q, ref, labels_key="cell_type", **kw)
        np.testing.assert_array_equal(q.obs["orca_label"].astype(str).to_numpy(), expected)
        assert q.uns["orca"]["data"]["streamed"]
    summary = orca_sc.tl.summarize(q)
    assert summary["novel"] and all(len(c["markers"]) == 5 for c in summary["novel"])
    labels_mem, _, _ = model.predict(query)
    labels_disk, _, info = model.predict(orca_sc.read_lazy(paths["zarr"]))
    np.testing.assert_array_equal(labels_disk, labels_mem)
    assert info["input_scale"] == "counts"
    # the command line, the reference read from disk too
    args = ["annotate", paths["ref"], paths["query"], "--labels-key", "cell_type", "--epochs", "10",
            "--warmup-epochs", "2", "--n-genes", "150", "-q",
            "-o", tmp_path / "disk.h5ad", "--on-disk"]  # fmt: skip
    r = CliRunner().invoke(main, [str(x) for x in args])
    assert r.exit_code == 0, (r.output, r.exception)
    cli = orca_sc.read_lazy(tmp_path / "disk.h5ad").obs["orca_label"].astype(str).to_numpy()
    np.testing.assert_array_equal(cli, expected)
    assert _md5(paths["query"]) == before
    bad = tmp_path / "notzarr"
    bad.mkdir()
    r = CliRunner().invoke(main, ["predict", str(tmp_path / "m.pt"), str(bad), "--on-disk"])
    assert r.exit_code == 2 and "notzarr" in r.stderr


def test_chunks_of_counts_then_non_integers_are_refused(tmp_path, monkeypatch):
    import anndata as ad

    monkeypatch.setattr(read_mod, "CHUNK_CELLS", 50)
    X = sp.random(120, 30, density=0.3, format="csr", dtype=np.float32, random_state=0)
    X.data = np.ceil(X.data * 5)
    X.data[X.indptr[100] :] += 0.5  # cells 100-119 are not counts
    ad.AnnData(X=X).write_h5ad(tmp_path / "mixed.h5ad")
    reader = ChunkReader(orca_sc.read_lazy(tmp_path / "mixed.h5ad"), None, "query", 1e4)
    with pytest.raises(OrcaInputError, match="non-integer values in cells 100-119"):
        list(reader)


def test_read_lazy_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(OrcaInputError, match="does not exist"):
        orca_sc.read_lazy(tmp_path / "missing.h5ad")
    (tmp_path / "plain").mkdir()
    with pytest.raises(OrcaInputError, match="not a zarr store"):
        orca_sc.read_lazy(tmp_path / "plain")
    (tmp_path / "junk.h5ad").write_text("not hdf5")
    with pytest.raises(OrcaInputError, match="as h5ad"):
        orca_sc.read_lazy(tmp_path / "junk.h5ad")


# --------------------------------------------------------------------------- training step
def _cells(layout, seed=0):
    a = orca_sc.datasets.simulate(400, 300, 4, n_batches=2, library_size=150, seed=seed)
    X = log_normalize(a.X.tocsr(), 1e4)
    dom = (a.obs["batch"] == "batch_1").to_numpy().astype(np.int64)
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.5, 2.0, (2, 300)).astype(np.float32)
    offset = rng.normal(0, 0.3, (2, 300)).astype(np.float32)
    return CellMatrix(X, dom, scale, offset, torch.device("cpu"), layout=layout)


def test_sparse_and_dense_batches_give_the_same_layer_and_gradient():
    """The sparse first layer (with the per-batch scale and offset) equals the dense product of
    the aligned rows, in value and in the weight's gradient; inference agrees too.
    """
    sparse, dense = _cells("sparse"), _cells("dense")
    assert sparse.layout == "sparse" and dense.layout == "dense"
    idx = np.random.default_rng(1).permutation(400)[:64]
    torch.manual_seed(0)
    net = OrcaNet(300, 5, (64, 16), 0.0)
    grads = []
    for cells in (sparse, dense):
        net.zero_grad()
        h = net.backbone._trunk(cells.batch(idx))
        h.pow(2).sum().backward()
        grads.append((h.detach().clone(), net.backbone.net[0].weight_t.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-4, atol=1e-3)
    p1, e1 = infer(net, sparse)
    p2, e2 = infer(net, dense)
    np.testing.assert_allclose(p1, p2, atol=1e-5)
    np.testing.assert_allclose(e1, e2, atol=1e-5)


@pytest.mark.parametrize("empty_rows", [[], [0, 7], list(range(8))])
def test_sparse_product_with_empty_rows(empty_rows):
    """The sparse first product (rows summed as weighted bags of gene rows) equals the dense
    product, value and weight gradient, also with cells that hold no stored value (first, last
    or all rows of the batch).
    """
    from orca_sc._cells import _csr_tensor
    from orca_sc.module import _SparseMatmul

    m = sp.random(8, 30, density=0.3, format="csr", dtype=np.float32, random_state=0)
    m = m.tolil()
    m[empty_rows, :] = 0
    m = m.tocsr()
    m.eliminate_zeros()
    w = torch.randn(30, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    g = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    out = _SparseMatmul.apply(_csr_tensor(m), _csr_tensor(m.T.tocsr()), w)
    (out * g).sum().backward()
    dense = torch.from_numpy(m.toarray())
    torch.testing.assert_close(out, dense @ w.detach())
    torch.testing.assert_close(w.grad, dense.T @ g)
    assert not out[empty_rows].any()


def test_auto_layout_follows_the_share_of_non_zeros():
    a = orca_sc.datasets.simulate(300, 200, 3, library_size=3000, seed=0)
    X = log_normalize(a.X.tocsr(), 1e4)
    one, zero = np.ones((1, 200)), np.zeros((1, 200))
    dom = np.zeros(300, dtype=np.int64)
    assert X.nnz / np.prod(X.shape) > 0.2
    assert CellMatrix(X, dom, one, zero, torch.device("cpu")).layout == "dense"
    b = orca_sc.datasets.simulate(300, 200, 3, library_size=40, seed=0)
    thin = log_normalize(b.X.tocsr(), 1e4)
    assert thin.nnz / np.prod(thin.shape) < 0.2
    assert CellMatrix(thin, dom, one, zero, torch.device("cpu")).layout == "sparse"


def test_two_views_share_the_trunk_but_not_the_dropout():
    """``forward_views`` gives what two calls of ``forward`` give with the same random stream
    (the same dropout masks, drawn in the same order), and leaves the same BatchNorm running
    statistics.
    """
    x = torch.randn(32, 50)
    torch.manual_seed(0)
    a = OrcaNet(50, 6, (40, 12), 0.5)
    b = OrcaNet(50, 6, (40, 12), 0.5)
    b.load_state_dict(a.state_dict())
    a.train()
    b.train()
    torch.manual_seed(1)
    (l1, z1), (l2, z2) = a.forward_views(x)
    torch.manual_seed(1)
    m1, y1 = b(x)
    m2, y2 = b(x)
    for u, v in ((l1, m1), (z1, y1), (l2, m2), (z2, y2)):
        torch.testing.assert_close(u, v)
    assert not torch.equal(z1, z2)  # two dropout masks
    for k, v in a.state_dict().items():
        torch.testing.assert_close(v, b.state_dict()[k], msg=k)


def test_masked_cross_entropy_is_the_cross_entropy_of_the_labelled_rows():
    logits = torch.randn(10, 4)
    target = torch.tensor([0, -1, 2, 3, -1, 1, 1, -1, 0, 2])
    keep = target >= 0
    torch.testing.assert_close(
        masked_margin_cross_entropy(logits, target, 0.3),
        margin_cross_entropy(logits[keep], target[keep], 0.3),
    )
    assert float(masked_margin_cross_entropy(logits, torch.full((10,), -1), 0.3)) == 0.0


def test_marker_sample_caps_each_label():
    from orca_sc.tl._summary import marker_sample

    labels = np.array(["a"] * 50 + ["b"] * 5 + ["c"] * 30)
    rows = marker_sample(labels, 10)
    assert np.all(np.diff(rows) > 0)
    counts = {k: int((labels[rows] == k).sum()) for k in "abc"}
    assert counts == {"a": 10, "b": 5, "c": 10}


def test_first_layer_weight_is_held_transposed_and_saves_as_nn_linear(tmp_path):
    """The first weight is held as a contiguous ``(G, H)`` parameter (for the sparse product and
    Adam's fused kernel), but its values, shape and ``state_dict`` are those of ``nn.Linear``:
    files saved before load, and the same draws give the same initial weights.
    """
    torch.manual_seed(0)
    net = OrcaNet(30, 3, (8, 4), 0.1)
    torch.manual_seed(0)
    plain = torch.nn.Linear(30, 8)
    first = net.backbone.net[0]
    assert first.weight_t.shape == (30, 8) and first.weight_t.is_contiguous()
    assert first.weight.shape == (8, 30)
    torch.testing.assert_close(first.weight, plain.weight)
    torch.testing.assert_close(first(torch.ones(2, 30)), plain(torch.ones(2, 30)))
    state = net.state_dict()
    assert list(state)[:2] == ["backbone.net.0.weight", "backbone.net.0.bias"]
    assert state["backbone.net.0.weight"].shape == (8, 30)
    assert [n for n, _ in net.named_parameters()][0] == "backbone.net.0.weight_t"
    torch.save(state, tmp_path / "n.pt")
    other = OrcaNet(30, 3, (8, 4), 0.1)
    other.load_state_dict(torch.load(tmp_path / "n.pt", weights_only=True))
    torch.testing.assert_close(other.backbone.net[0].weight, first.weight)
    # a file of nn.Linear's layout (as saved before this parameter was held transposed)
    old = {k: v.contiguous() for k, v in state.items()}
    third = OrcaNet(30, 3, (8, 4), 0.1)
    third.load_state_dict(old)
    torch.testing.assert_close(third.backbone.net[0].weight, first.weight)
    assert third.backbone.net[0].weight_t.is_contiguous()


def test_same_seed_same_result_with_two_threads():
    """Same seed, same device: bit-identical embeddings on cross-batch sparse data with 2 CPU
    threads (the batch offsets' gradient was once scatter-added in a varying order). The fold
    warm-ups of the novelty test train through the same step, so they are left out here (the
    default run's repeatability: ``test_annotate.py::test_same_seed_same_labels_and_copy``).
    """
    a = orca_sc.datasets.simulate(900, 1000, 5, n_batches=2, library_size=100, seed=2)
    ref = a[(a.obs["batch"] == "batch_0").to_numpy()].copy()
    ref = ref[ref.obs["cell_type"].isin(["type_0", "type_1", "type_2"]).to_numpy()].copy()
    query = a[(a.obs["batch"] == "batch_1").to_numpy()].copy()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for _ in range(2):
            q = query.copy()
            # a short schedule: a varying order of the sum shows in the first steps
            short = {**FAST, "ablation": FAST_LAB.replace(epoch_min_steps=8)}
            orca_sc.tl.annotate(q, ref, labels_key="cell_type", **short, novelty_folds=0)
            assert q.uns["orca"]["training"]["layout"] == "sparse"
            assert 0 < q.uns["orca"]["training"]["density"] <= 0.2  # SPARSE_MAX_DENSITY
            runs.append(q.obsm["X_orca"].copy())
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_array_equal(runs[0], runs[1])
