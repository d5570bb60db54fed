"""Majority voting over an over-clustering (issue 35 item 5): per-cell noise is cleaned within
clusters, mixed clusters keep their per-cell labels and are flagged, the per-cell labels are kept.
"""

import warnings

import numpy as np
import pandas as pd
from click.testing import CliRunner
from conftest import FAST

import orca_sc
from orca_sc._vote import MIN_SHARE, majority_vote
from orca_sc.cli import main


def test_vote_cleans_noise_and_flags_mixed_clusters():
    rng = np.random.default_rng(0)
    centers = np.eye(3, 16) * 20
    emb = np.concatenate([c + rng.normal(size=(200, 16)) for c in centers])
    blob = np.repeat(np.arange(3), 200)
    labels = np.array(["A", "B", "C"], dtype=object)[blob]
    noise = rng.random(labels.size) < 0.1  # 10% of cells mislabelled at random
    labels[noise] = "B"
    third = blob == 2  # blob 2: four labels in equal shares, none holds half of it
    labels[third] = rng.choice(np.array(["A", "B", "C", "D"], dtype=object), third.sum())
    v = majority_vote(emb, labels, seed=0)
    assert v.record["resolution"] == 5.0
    # every over-cluster lies within one blob
    for c in np.unique(v.cluster):
        assert np.unique(blob[v.cluster == c]).size == 1
    assert np.all(v.labels[blob == 0] == "A")  # the noise is voted away
    mixed = v.mixed
    share = (
        pd.crosstab(v.cluster, labels).max(axis=1)
        / pd.Series(v.cluster).value_counts().sort_index()
    )
    assert np.array_equal(mixed, (share < MIN_SHARE).to_numpy()[v.cluster])
    assert mixed[third].mean() > 0.8 and not mixed[blob == 0].any()
    np.testing.assert_array_equal(v.labels[mixed], labels[mixed])  # mixed keep their own
    assert v.record["n_changed"] == int(np.sum(v.labels != labels))
    again = majority_vote(emb, labels, seed=0)  # same seed, same vote
    np.testing.assert_array_equal(again.cluster, v.cluster)


def test_annotate_with_majority_vote_keeps_the_per_cell_labels(tmp_path):
    a = orca_sc.datasets.simulate(600, 300, 5, markers_per_type=30, marker_fold=5.0, seed=3)
    rng = np.random.default_rng(0)
    seen = a.obs["cell_type"].isin(["type_0", "type_1", "type_2"]).to_numpy()
    a.obs["lab"] = a.obs["cell_type"].astype(object).where(seen & (rng.random(a.n_obs) < 0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = orca_sc.tl.annotate(a, labels_key="lab", copy=True, **FAST)
        voted = orca_sc.tl.annotate(a, labels_key="lab", copy=True, majority_vote=True, **FAST)
    obs = voted.obs
    assert (obs["orca_label_per_cell"].astype(str) == plain.obs["orca_label"].astype(str)).all()
    unl = a.obs["lab"].isna().to_numpy()
    assert obs["orca_overcluster"][~unl].isna().all() and obs["orca_overcluster"][unl].notna().all()
    clean = unl & ~obs["orca_vote_mixed"].to_numpy()
    per_cluster = obs[clean].groupby("orca_overcluster", observed=True)["orca_label"].nunique()
    assert (per_cluster == 1).all()
    rec = voted.uns["orca"]["majority_vote"]
    changed = (obs["orca_label"].astype(str) != obs["orca_label_per_cell"].astype(str)).sum()
    assert rec["n_changed"] == changed
    assert rec["n_clusters"] == obs["orca_overcluster"].nunique()
    assert "orca_label_per_cell" not in plain.obs and "majority_vote" not in plain.uns["orca"]
    assert "--majority-vote" in CliRunner().invoke(main, ["annotate", "--help"]).output
