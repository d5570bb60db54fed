import math

import anndata as ad
import numpy as np
import pandas as pd
import pytest

from orca_sc import metrics

SEEN = ["A", "B"]
TRUTH = ["A", "A", "B", "B", "C", "C", "C", "D", "D"]
PRED = ["A", "B", "B", "B", "novel_1", "novel_1", "novel_2", "novel_2", "novel_2"]


def test_seen_accuracy_plain():
    assert metrics.seen_accuracy(TRUTH, PRED, SEEN) == 0.75


def test_novel_accuracy_hungarian():
    # C -> novel_1 (2 of 3), D -> novel_2 (2 of 2): 4 of 5
    assert metrics.novel_accuracy(TRUTH, PRED, SEEN) == 0.8
    # label names do not matter for novel accuracy
    renamed = [p.replace("novel_1", "x").replace("novel_2", "y") for p in PRED]
    assert metrics.novel_accuracy(TRUTH, renamed, SEEN) == 0.8


def test_all_accuracy_hungarian_over_all_classes():
    # A->A(1), B->B(2), novel_1->C(2), novel_2->D(2) = 7/9
    assert math.isclose(metrics.all_accuracy(TRUTH, PRED), 7 / 9)
    # a one-to-one matching: one predicted label cannot serve two classes
    assert metrics.all_accuracy(["a", "b"], ["x", "x"]) == 0.5


def test_novel_nmi_perfect_and_random():
    assert metrics.novel_nmi(["C", "C", "D", "D"], ["n1", "n1", "n2", "n2"], SEEN) == 1.0
    assert metrics.novel_nmi(["C", "D", "C", "D"], ["n1", "n1", "n2", "n2"], SEEN) == 0.0
    assert math.isnan(metrics.novel_nmi(["A"], ["A"], SEEN))


def test_per_class_recall():
    df = metrics.per_class_recall(TRUTH, PRED, SEEN).set_index("class")
    assert df.loc["A", "recall"] == 0.5
    assert df.loc["C", "matched_label"] == "novel_1"
    assert math.isclose(df.loc["C", "recall"], 2 / 3)
    assert df.loc["D", "recall"] == 1.0 and not df.loc["D", "seen"]


def test_report_on_annotated_anndata():
    a = ad.AnnData(np.zeros((len(TRUTH), 1), dtype=np.float32))
    a.obs["truth"] = TRUTH
    a.obs["orca_label"] = pd.Categorical(PRED)
    a.uns["orca"] = {"seen_classes": SEEN, "novel_cluster_sizes": {"novel_1": 2, "novel_2": 3}}
    r = metrics.report(a, "truth")
    assert r["seen_accuracy"] == 0.75 and r["novel_accuracy"] == 0.8
    assert r["n_novel_true"] == 2 and r["n_novel_found"] == 2 and r["n_cells"] == 9
    with pytest.raises(KeyError, match="truth_key 'nope'"):
        metrics.report(a, "nope")
    with pytest.raises(KeyError, match="run orca_sc.tl.annotate"):
        metrics.report(a, "truth", key_added="other")
