"""Calibrated confidence (issue 35 item 1): ``obs['orca_confidence']`` of a cell labelled a known
type is the probability that its label is right, fitted on held-out labelled cells.
"""

import warnings

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import orca_sc  # noqa: E402
from orca_sc import OrcaInputError  # noqa: E402
from orca_sc._calibration import (  # noqa: E402
    FoldPredictions,
    apply_transfer,
    calibrate,
    expected_calibration_error,
)
from orca_sc._demo import demo_data  # noqa: E402


def test_expected_calibration_error_by_hand():
    conf = np.array([0.95, 0.95, 0.95, 0.95, 0.55, 0.55])
    right = np.array([1, 1, 0, 0, 1, 0])
    # bin 0.9-1.0: confidence 0.95, accuracy 0.5 (4 cells); bin 0.5-0.6: 0.55 vs 0.5 (2 cells)
    assert expected_calibration_error(conf, right) == pytest.approx((4 * 0.45 + 2 * 0.05) / 6)
    assert expected_calibration_error(np.ones(5), np.ones(5)) == 0.0
    assert np.isnan(expected_calibration_error(np.array([]), np.array([])))
    rng = np.random.default_rng(0)
    p = rng.random(20000)
    assert expected_calibration_error(p, rng.random(p.size) < p) < 0.02  # calibrated by design


def _overconfident(n, rng):
    """A net's probability of its prediction, right only with probability p**3."""
    p = rng.uniform(0.3, 1.0, n)
    return p, rng.random(n) < p**3


def test_calibrate_maps_held_out_probabilities_to_accuracy():
    rng = np.random.default_rng(1)
    n_lab, n_unl, n_folds = 3000, 2000, 5
    held_prob, held_right = _overconfident(n_lab, rng)
    fold = np.r_[np.arange(n_lab) % n_folds, np.full(n_unl, -1)]
    q_prob, q_right = _overconfident(n_unl, rng)
    label_prob = np.empty((n_folds, n_lab + n_unl), dtype=np.float32)
    label_prob[:, n_lab:] = q_prob  # every fold net agrees on the unlabelled cells
    label_prob[:, :n_lab] = 0.99  # nets that trained on a labelled cell are sure of it...
    label_prob[fold[:n_lab], np.arange(n_lab)] = held_prob  # ...the one it was held out of is not
    final = np.full(n_lab + n_unl, 0.999)
    known = np.ones(n_lab + n_unl, dtype=bool)
    known[-10:] = False  # cells of a novel cluster keep the final net's probability
    cal = calibrate(FoldPredictions(held_prob, held_right, fold, label_prob), final, known)
    conf = cal.confidence
    assert np.all(conf[-10:] == np.float32(0.999))
    raw = expected_calibration_error(q_prob[:-10], q_right[:-10])
    after = expected_calibration_error(conf[n_lab:-10], q_right[:-10])
    assert raw > 0.15 and after < 0.04, (raw, after)
    # labelled cells: the net they were held out of, not those that trained on them
    assert expected_calibration_error(conf[:n_lab], held_right) < 0.04
    rec = cal.record
    assert rec["n_calibration"] == n_lab
    assert rec["ece_heldout"] < 0.04 < rec["ece_heldout_uncalibrated"]
    # the transfer map: monotone, within [0, 1]; without a map a probability passes as is
    x, y = cal.transfer
    assert np.all(np.diff(x) >= 0) and np.all(np.diff(y) >= -1e-12) and 0 <= min(y) <= max(y) <= 1
    p = np.array([0.2, 0.5, 0.999])
    assert np.array_equal(apply_transfer(([], []), p), p)


@pytest.fixture(scope="module")
def demo_runs(demo_run):
    """The demo (700 real PBMCs, 3 sorted types hidden) annotated with (the shared default run,
    :func:`conftest.demo_run`, its model saved) and without the cross-fitted warm-ups.
    """
    import anndata as ad

    cal = ad.read_h5ad(demo_run["adata"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = demo_data(0)
        orca_sc.tl.annotate(raw, labels_key="input_label", progress=False, novelty_folds=0)
    return cal, raw, demo_run["model"]


def _query_known(adata):
    """Query cells labelled a known type: their confidence and whether the label is right."""
    label = adata.obs["orca_label"].astype(str).to_numpy()
    m = adata.obs["input_label"].isna().to_numpy() & adata.obs["orca_novel"].isna().to_numpy()
    right = label == adata.obs["bulk_labels"].astype(str).to_numpy()
    return adata.obs["orca_confidence"].to_numpy()[m], right[m]


def test_confidence_is_calibrated_on_real_cells(demo_runs):
    cal, raw, _ = demo_runs
    assert (cal.obs["orca_label"] == raw.obs["orca_label"]).all()  # the labels do not change
    conf, right = _query_known(cal)
    conf_raw, right_raw = _query_known(raw)
    ece, ece_raw = (
        expected_calibration_error(conf, right),
        expected_calibration_error(conf_raw, right_raw),
    )
    # max softmax: ~0.99 on labels right ~60% of the time; calibrated: within 0.15 of it
    assert ece_raw > 0.25 and ece < 0.15 and ece < ece_raw / 2, (ece, ece_raw)
    assert abs(conf.mean() - right.mean()) < 0.1
    rec = cal.uns["orca"]["confidence"]
    assert rec["calibrated"] and rec["n_calibration"] == int(cal.obs["input_label"].notna().sum())
    assert rec["ece_heldout"] < rec["ece_heldout_uncalibrated"]
    assert raw.uns["orca"]["confidence"] == {
        "calibrated": False,
        "meaning": "the model's probability of the cell's head (maximum softmax; not calibrated)",
    }
    # novel clusters keep the probability of their head, as stated
    novel = cal.obs["orca_novel"].notna().to_numpy()
    assert novel.any()
    np.testing.assert_array_equal(
        cal.obs["orca_confidence"].to_numpy()[novel], raw.obs["orca_confidence"].to_numpy()[novel]
    )


def test_saved_model_carries_the_calibration(demo_runs, tmp_path):
    cal, raw, path = demo_runs
    model = orca_sc.OrcaModel.load(path)
    x, y = model.confidence_map
    assert len(x) == len(y) > 1
    again = demo_data(0)
    orca_sc.tl.predict(again, path)
    conf, right = _query_known(again)
    assert expected_calibration_error(conf, right) < 0.15
    assert conf.mean() < np.mean(_query_known(raw)[0]) - 0.2  # not the raw max softmax
    # a damaged map is refused
    payload = torch.load(path, weights_only=True)
    payload["meta"]["extra"]["confidence_map"] = [[0.5, 0.2], [2.0]]
    torch.save(payload, tmp_path / "bad.pt")
    with pytest.raises(OrcaInputError, match="confidence map is not two lists of knots"):
        orca_sc.OrcaModel.load(tmp_path / "bad.pt")


def test_reliability_diagram(demo_runs):
    cal, _, _ = demo_runs
    ax = orca_sc.pl.reliability(cal, "bulk_labels", show=False)
    labelled = cal.obs["input_label"].notna().to_numpy() & cal.obs["orca_novel"].isna().to_numpy()
    # every cell labelled a known type counts (the labelled ones too)
    assert f"over {int(_query_known(cal)[0].size + labelled.sum())} cells" in ax.get_title()
    heights = [p.get_height() for p in ax.patches]
    assert heights and all(0 <= h <= 1 for h in heights)
    plt.close("all")
    with pytest.raises(KeyError, match="truth_key 'nope'"):
        orca_sc.pl.reliability(cal, "nope", show=False)
