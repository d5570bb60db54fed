"""Per novel cluster, whether the data can support its call (``uns['orca']['novel_evidence']``)."""

import numpy as np

import orca_sc
from orca_sc._discover._stage import _FEW_LABELS as FEW_LABELS
from orca_sc._discover.evidence import evidence_note, novel_evidence
from tests.conftest import FAST

TYPES = ["B", "T", "NK"]
SIM = {
    "clusters": ["novel_1", "novel_2", "novel_3", "novel_4"],
    "types": TYPES,
    # closest known types: T, NK, B, B
    "similarity": [[0.1, 0.8, 0.2], [0.0, 0.3, 0.6], [0.5, 0.1, 0.2], [0.9, 0.0, 0.0]],
}
LABELLED = np.array([200, 400, 12])  # NK has fewer than FEW_LABELS


def _test(verdicts):
    return {"clusters": {"cluster": SIM["clusters"], "supported": verdicts}}


def test_each_level_and_its_reason():
    sizes = {"novel_1": 80, "novel_2": 60, "novel_3": 9, "novel_4": 50}
    verdicts = ["significant", "not significant", "not significant", "not significant"]
    ev = novel_evidence(SIM["clusters"], sizes, SIM, LABELLED, _test(verdicts), n_neighbors=15)
    assert ev["cluster"] == SIM["clusters"]
    assert ev["closest_type"] == ["T", "NK", "B", "B"]
    assert ev["closest_type_labelled"] == [400, 12, 200, 200]
    assert ev["closest_similarity"] == [0.8, 0.6, 0.5, 0.9]
    assert ev["novelty_test"] == verdicts
    # confirmed by the test; few labels of NK; 9 cells < 15 neighbours; enough data, unconfirmed
    assert ev["evidence"] == ["supported", "cannot tell", "cannot tell", "not confirmed"]
    assert ev["reason"][0] == ""
    assert "NK, has only 12 labelled cells" in ev["reason"][1]
    assert "only 9 cells" in ev["reason"][2] and "labelled cells" not in ev["reason"][2]
    assert "does not find its cells more unlike" in ev["reason"][3]
    note = evidence_note(ev)
    assert "novel_2, novel_3" in note and "novel_1" not in note and "novel_4" not in note


def test_a_significant_test_outweighs_thin_data():
    """The test's error rate holds with few labels (cross-fitting), so a cluster it confirms is
    supported even where its closest type has few labels or the cluster is small.
    """
    sizes = {c: 9 for c in SIM["clusters"]}
    ev = novel_evidence(SIM["clusters"], sizes, SIM, LABELLED, _test(["significant"] * 4), 15)
    assert ev["evidence"] == ["supported"] * 4 and evidence_note(ev) is None


def test_an_uncalibrated_test_or_none_at_all():
    sizes = {c: 100 for c in SIM["clusters"]}
    ev = novel_evidence(SIM["clusters"], sizes, SIM, LABELLED, _test(["cannot tell"] * 4), 15)
    assert ev["evidence"] == ["cannot tell"] * 4
    assert all(r.startswith("too few labelled cells calibrate") for r in ev["reason"])
    plenty = np.full(3, FEW_LABELS)
    ev = novel_evidence(SIM["clusters"], sizes, SIM, plenty, None, 15)
    assert ev["evidence"] == ["not tested"] * 4 and ev["novelty_test"] == ["not tested"] * 4
    thin = novel_evidence(SIM["clusters"], sizes, SIM, plenty - 1, None, 15)
    assert thin["evidence"] == ["cannot tell"] * 4
    assert novel_evidence([], {}, {"clusters": [], "types": TYPES, "similarity": []},
                          plenty, None, 15)["cluster"] == []  # fmt: skip


def test_a_run_reports_thin_data_per_cluster(tmp_path):
    """A reference with 8 labelled cells per type: every novel cluster the run reports says the
    data cannot support it (the test cannot be calibrated on 24 cells), in uns, in the summary
    and in the report.
    """
    a = orca_sc.datasets.simulate(1200, 300, 5, markers_per_type=20, marker_fold=5.0, seed=3)
    truth = a.obs["cell_type"].astype(str).to_numpy()
    rng = np.random.default_rng(0)
    ref_rows = np.concatenate(
        [rng.choice(np.flatnonzero(truth == t), 8, replace=False) for t in ("type_0", "type_1",
                                                                           "type_2")]
    )  # fmt: skip
    query_rows = np.setdiff1d(np.arange(a.n_obs), ref_rows)
    ref, query = a[ref_rows].copy(), a[query_rows].copy()
    out = orca_sc.tl.annotate(query, ref, labels_key="cell_type", copy=True, seed=0, **FAST)
    ev = out.uns["orca"]["novel_evidence"]
    names = list(out.obs["orca_novel"].cat.categories)
    assert names and list(ev["cluster"]) == names
    assert list(ev["evidence"]) == ["cannot tell"] * len(names)
    assert all("calibrate the novelty test" in r for r in ev["reason"])
    assert list(ev["closest_type_labelled"]) == [8] * len(names)
    summary = orca_sc.tl.summarize(out, n_markers=0)
    assert [r["evidence"] for r in summary["novel"]] == ["cannot tell"] * len(names)
    html = orca_sc.tl.report(out, tmp_path / "run.html").read_text()
    assert html.count("the data cannot support this call") == len(names)
