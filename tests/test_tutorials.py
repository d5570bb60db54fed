"""The tutorials run (offline form) and their stored notebooks match the sources and are executed."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHARED_DATA

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"
NAMES = ["scanpy_workflow", "tabula_muris_cross_tissue"]


def _run(name):
    # the Tabula Muris tutorial on a local file (its documented option), never a download
    env = {**os.environ, "MPLBACKEND": "Agg",
           "ORCA_SC_TUTORIAL_DATA": str(SHARED_DATA / "tm_facs_scfind.h5ad")}  # fmt: skip
    env.pop("ORCA_SC_QUERY_TISSUE", None)
    return subprocess.run(
        [sys.executable, f"{name}.py"], cwd=TUTORIALS, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip


def test_scanpy_workflow_tutorial_runs():
    r = _run("scanpy_workflow")
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"'novel_accuracy': ([0-9.]+)", r.stdout)
    assert m and float(m.group(1)) > 0.6
    assert "novel_1 (" in r.stdout and "closest:" in r.stdout
    # the tutorial's reading of the clusters: plasma cells (MZB1, J chain) are a cluster of
    # their own, apart from the B cells of the same sort gate
    plasma = [ln for ln in r.stdout.splitlines() if ln.startswith("novel_") and "MZB1" in ln]
    b_cells = [ln for ln in r.stdout.splitlines() if ln.startswith("novel_") and "MS4A1" in ln]
    assert len(plasma) == 1 and len(b_cells) == 1 and plasma != b_cells


@pytest.mark.skipif(not (SHARED_DATA / "tm_facs_scfind.h5ad").exists(), reason="shared data absent")
def test_tabula_muris_tutorial_runs_offline():
    r = _run("tabula_muris_cross_tissue")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Data: a local file (ORCA_SC_TUTORIAL_DATA=tm_facs_scfind.h5ad)" in r.stdout
    assert (
        "novel types in the query: ['immature B cell', 'late pro-B cell', 'naive B cell', 'precursor B cell']"
        in r.stdout
    )
    # the query's 13 macrophages (its only known type) keep their kidney label or go novel
    # together, depending on the seed: at 3 of seeds 0-14 of this split (5 before the training
    # step of issue 22, at other seeds), so their accuracy is no test; the B lineage is
    novel = float(re.search(r"novel_accuracy: ([0-9.]+)", r.stdout).group(1))
    assert novel >= 0.7
    acc = float(re.search(r"accuracy of the saved model: ([0-9.]+)", r.stdout).group(1))
    assert acc >= 0.9
    assert not (TUTORIALS / "tabula_muris_orca_model.pt").exists()  # cleaned up


def _code_cells_from_py(text):
    """Code cells of a jupytext percent file (the header comment block excluded)."""
    cells, cur, kind = [], [], None
    for line in text.splitlines():
        if line.startswith("# %%"):
            if kind == "code":
                cells.append("\n".join(cur).strip())
            kind = "markdown" if "[markdown]" in line else "code"
            cur = []
        elif kind is not None:
            cur.append(line)
    if kind == "code":
        cells.append("\n".join(cur).strip())
    return [c for c in cells if c]


@pytest.mark.parametrize("name", NAMES)
def test_stored_notebooks_match_sources_and_are_executed(name):
    nb = json.loads((TUTORIALS / f"{name}.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    sources = ["".join(c["source"]).strip() for c in code]
    assert sources == _code_cells_from_py((TUTORIALS / f"{name}.py").read_text()), (
        f"{name}.ipynb is out of date: run python tutorials/execute.py {name}"
    )
    assert all(c.get("execution_count") for c in code)  # every cell was executed
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    images = [o for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # the figures are stored
