from pathlib import Path

import numpy as np
import pytest

import orca_sc

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def open_world(adata, seen, labeled_fraction=0.5, seed=0, key="cell_type"):
    """Paper protocol on one AnnData: only part of the seen classes is labelled (``obs['lab']``)."""
    rng = np.random.default_rng(seed)
    lab = adata.obs[key].isin(seen).to_numpy() & (rng.random(adata.n_obs) < labeled_fraction)
    adata.obs["lab"] = adata.obs[key].astype(object).where(lab, None)
    return adata


@pytest.fixture
def small_sim():
    """A quick open-world problem: 3 seen + 2 novel well-separated types."""
    a = orca_sc.datasets.simulate(500, 300, 5, markers_per_type=30, marker_fold=5.0, seed=3)
    return open_world(a, ["type_0", "type_1", "type_2"])


FAST = {"n_genes": None, "epochs": 5, "min_steps": 150, "warmup_epochs": 1, "progress": False}
