"""Integration before discovery (``DiscoveryConfig.integration``): Harmony on the joint PCA, the
record of what was used, the same result for the same seed, and the suite's figures of mixing,
separation and over-correction.
"""

import numpy as np
import pytest
from conftest import FAST, LABELS_ONLY

import orca_sc
from orca_sc import benchmark as B
from orca_sc._integrate import harmony, integrated_space


def _two_batches(seed=0):
    """A reference batch without ``type_4`` and a query batch holding every type; the batch
    effect differs by type (a shift Harmony must remove per cluster).
    """
    a = orca_sc.datasets.simulate(
        900, 300, 5, markers_per_type=30, marker_fold=5.0, n_batches=2, batch_strength=0.3,
        seed=seed,
    )  # fmt: skip
    batch = a.obs["batch"].astype(str).to_numpy()
    ref = a[(batch == "batch_0") & (a.obs["cell_type"] != "type_4").to_numpy()].copy()
    query = a[batch == "batch_1"].copy()
    return ref, query


def test_harmony_mixes_batches_and_keeps_its_seed():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 20)) * 4
    types = np.repeat(np.arange(3), 200)
    batch = np.tile(np.repeat(["a", "b"], 100), 3)
    x = centres[types] + rng.normal(size=(600, 20))
    x[batch == "b"] += 3.0  # a batch shift as large as the types' spread
    z = harmony(x, batch, seed=0)
    assert z.shape == x.shape and np.isfinite(z).all()

    def gap(e):  # distance between the batches' means of type 0, relative to its spread
        t0 = types == 0
        d = e[t0 & (batch == "a")].mean(0) - e[t0 & (batch == "b")].mean(0)
        return np.linalg.norm(d) / e[t0].std(0).mean()

    assert gap(z) < 0.5 * gap(x)
    np.testing.assert_array_equal(z, harmony(x, batch, seed=0))
    none, info = integrated_space(x, np.zeros(600), "harmony")
    assert none is None and info == {"method": "none", "reason": "one batch"}


def test_an_annotation_with_harmony_records_it_and_repeats_itself():
    ref, query = _two_batches()
    cfg = FAST | LABELS_ONLY | {"integration": "harmony"}
    runs = []
    for _ in range(2):
        q = query.copy()
        orca_sc.tl.annotate(q, ref, labels_key="cell_type", **cfg)
        runs.append(q)
    info = runs[0].uns["orca"]["estimate"]["integration"]
    assert info["method"] == "harmony" and info["batches"] == 2
    assert info["cells"] == ref.n_obs + query.n_obs and info["n_pcs"] == 30
    assert runs[0].obs["orca_label"].equals(runs[1].obs["orca_label"])
    # type_4 (only in the query) is still found as novel in the integrated space
    novel = runs[0].obs["orca_novel"].notna().to_numpy()
    is4 = (query.obs["cell_type"] == "type_4").to_numpy()
    assert novel[is4].mean() > 0.8 and novel[~is4].mean() < 0.1
    # the default reads the PCA of each cell set, and says so
    q = query.copy()
    orca_sc.tl.annotate(q, ref, labels_key="cell_type", **(FAST | LABELS_ONLY))
    assert q.uns["orca"]["estimate"]["integration"] == {"method": "none"}


def test_integration_option_is_checked():
    with pytest.raises(orca_sc.OrcaInputError, match="integration"):
        orca_sc.OrcaConfig().replace(integration="scvi")


def test_integration_figures_see_mixing_and_over_correction():
    ref, query = _two_batches(seed=1)
    ref.obs["cell_type"] = ref.obs["cell_type"].astype(str)
    query.obs["_truth"] = query.obs["cell_type"].astype(str)
    seen = sorted(set(ref.obs["cell_type"]))
    task = B.Task("two_batches", ref, query, "cell_type", seen, single=False)
    f = B.integration_figures(task, seed=0)
    for k in ("mix", "sep_qshare", "sep_knn", "over"):
        assert 0 <= f[f"{k}_pca"] <= 1 and 0 <= f[f"{k}_harmony"] <= 1, k
    assert f["mix_harmony"] > f["mix_pca"]  # the batches mix once integrated
    assert f["sep_knn_pca"] > 0.9  # the novel type lies far from every reference cell
    # a "novel" type that the reference does have: it is pulled onto it (over-correction 1)
    fake = B.Task("fake", ref, query[query.obs["cell_type"] != "type_4"].copy(), "cell_type",
                  [s for s in seen if s != "type_0"], single=False)  # fmt: skip
    g = B.integration_figures(fake, seed=0)
    assert g["over_harmony"] > 0.9 and g["over_harmony"] >= g["over_pca"]
