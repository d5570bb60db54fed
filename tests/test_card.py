"""A saved model's card (issue 35 item 6): the reference it learned, the accuracy of each known
type on held-out reference cells, the novel clusters, versions and the command; printed by
``orca-sc predict --info``.
"""

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from conftest import FAST, FAST_ARGS

import orca_sc
from orca_sc.cli import main


@pytest.fixture(scope="module")
def split():
    """A reference whose type_0 is split at random into two names (type_0a / type_0b: cells
    that no model can tell apart) beside three distinct types, and a query with two novel types.
    """
    a = orca_sc.datasets.simulate(900, 300, 6, markers_per_type=30, marker_fold=5.0, seed=4)
    rng = np.random.default_rng(0)
    t = a.obs["cell_type"].astype(str).to_numpy()
    in_ref = np.isin(t, ["type_0", "type_1", "type_2", "type_3"]) & (rng.random(a.n_obs) < 0.6)
    ref, query = a[in_ref].copy(), a[~in_ref].copy()
    rt = ref.obs["cell_type"].astype(str).to_numpy()
    halves = np.where(rng.random(ref.n_obs) < 0.5, "type_0a", "type_0b")
    ref.obs["cell_type"] = pd.Categorical(np.where(rt == "type_0", halves, rt))
    return ref, query


def test_card_reports_reference_and_held_out_accuracy_per_type(split, tmp_path):
    ref, query = split
    model = orca_sc.OrcaModel.fit(query, ref, labels_key="cell_type", **FAST)
    card = model.card
    counts = ref.obs["cell_type"].value_counts()
    assert card["reference"]["cells_per_type"] == {c: int(counts[c]) for c in model.classes}
    assert card["reference"]["n_genes"] == len(model.genes)
    assert card["n_cells_annotated"] == query.n_obs
    acc = card["accuracy"]["per_type"]
    # the two names of one population cannot be told apart; the distinct types can
    assert acc["type_0a"] < 0.8 and acc["type_0b"] < 0.8
    assert min(acc["type_1"], acc["type_2"], acc["type_3"]) > 0.95
    weights = np.array([counts[c] for c in model.classes])
    overall = np.average([acc[c] for c in model.classes], weights=weights)
    assert card["accuracy"]["overall"] == pytest.approx(overall)
    assert set(card["novel_clusters"]) == set(model.novel_names)
    assert card["command"] is None and card["options"]["epochs"] == 5
    assert card["versions"]["torch"] == torch.__version__
    text = model.describe()
    assert "from Python" in text and "type_0a" in text and "Novel clusters: novel_1" in text
    # kept by save / load
    model.save(tmp_path / "m.pt")
    assert orca_sc.OrcaModel.load(tmp_path / "m.pt").card == card
    # a model without the cross-fitted warm-ups has no held-out accuracy, and says why
    bare = orca_sc.OrcaModel.fit(query, ref, labels_key="cell_type", novelty_folds=0, **FAST)
    assert bare.card["accuracy"] == {} and "no held-out accuracy" in bare.describe()


def test_cli_predict_info_prints_the_card(split, tmp_path):
    ref, query = split
    ref.write_h5ad(tmp_path / "ref.h5ad")
    query.write_h5ad(tmp_path / "q.h5ad")
    runner = CliRunner()
    args = ["annotate", tmp_path / "ref.h5ad", tmp_path / "q.h5ad", "--labels-key", "cell_type",
            "-o", tmp_path / "o.h5ad", "--save-model", tmp_path / "m.pt", "-q", *FAST_ARGS]  # fmt: skip
    r = runner.invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, ["predict", str(tmp_path / "m.pt"), "--info"])
    assert r.exit_code == 0, r.output
    assert "Command: orca-sc annotate" in r.output and "--labels-key cell_type" in r.output
    for c, n in ref.obs["cell_type"].value_counts().items():
        line = next(x for x in r.output.splitlines() if x.strip().startswith(c + " "))
        assert f"{n:,}" in line and 0 <= float(line.split()[-1]) <= 1
    options = next(x for x in r.output.splitlines() if x.startswith("Options (not default): "))
    assert "overall accuracy" in r.output and "epochs=10" in options
    r = runner.invoke(main, ["predict", str(tmp_path / "m.pt")])
    assert r.exit_code == 2 and "Missing argument 'QUERY.h5ad' (or pass --info)" in r.output
