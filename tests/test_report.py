"""The HTML report of a run (issue 35 item 2): one self-contained page, images inline, that says
what was found; rendered in headless Chromium where one is installed.
"""

import base64
import json
import shutil
import struct
import subprocess
import warnings
from html.parser import HTMLParser

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from conftest import FAST, FAST_ARGS  # noqa: E402

import orca_sc  # noqa: E402
from orca_sc import OrcaInputError  # noqa: E402
from orca_sc.cli import main  # noqa: E402


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.imgs = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.imgs.append(dict(attrs)["src"])


def _png_size(src: str) -> tuple[int, int]:
    head = "data:image/png;base64,"
    assert src.startswith(head)
    data = base64.b64decode(src[len(head) :])
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def demo(demo_run):
    """The shared default run on the demo data (:func:`conftest.demo_run`), read back."""
    import anndata as ad

    return ad.read_h5ad(demo_run["adata"])


def test_report_is_one_self_contained_page(demo, tmp_path):
    obs_before, uns_before = list(demo.obs.columns), sorted(demo.uns)
    path = orca_sc.tl.report(demo, tmp_path / "run.html", truth_key="bulk_labels")
    text = path.read_text()
    tags = _Tags()
    tags.feed(text)
    # nothing to fetch: no script, stylesheet link or frame; every image inline
    assert not {"script", "link", "iframe", "object"} & set(tags.tags)
    assert "http://" not in text and "https://" not in text
    # cells (label + truth), novel-cluster dot plot, confidence / novelty / reliability
    assert len(tags.imgs) == 3
    assert all(min(_png_size(src)) > 200 for src in tags.imgs)
    summary = orca_sc.tl.summarize(demo)
    for r in summary["novel"]:  # each novel cluster: size, verdict, closest known type
        assert f"{r['name']}</td><td>{r['size']:,}</td>" in text
        assert r["supported"] in text and r["closest"][0]["type"].replace("+", "+") in text
    for note in demo.uns["orca"]["estimate"]["notes"]:
        assert note.split(":")[0] in text
    assert "Parameters and versions" in text and "labels_key" in text
    assert "calibration error on held-out labelled cells" in text
    # the AnnData is read, never written
    assert list(demo.obs.columns) == obs_before and sorted(demo.uns) == uns_before
    with pytest.raises(OrcaInputError, match="truth_key 'nope'"):
        orca_sc.tl.report(demo, tmp_path / "x.html", truth_key="nope")
    with pytest.raises(OrcaInputError, match="does not exist"):
        orca_sc.tl.report(demo, tmp_path / "no" / "x.html")


def test_cli_writes_html_or_json_by_suffix(tmp_path):
    a = orca_sc.datasets.simulate(500, 200, 5, markers_per_type=20, marker_fold=5.0, seed=2)
    rng = np.random.default_rng(0)
    ref_mask = a.obs["cell_type"].isin(["type_0", "type_1", "type_2"]).to_numpy()
    ref_mask &= rng.random(a.n_obs) < 0.5
    a[ref_mask].copy().write_h5ad(tmp_path / "ref.h5ad")
    a[~ref_mask].copy().write_h5ad(tmp_path / "q.h5ad")
    # annotate writes the HTML page, predict (same writer) the JSON
    args = ["annotate", tmp_path / "ref.h5ad", tmp_path / "q.h5ad", "--labels-key", "cell_type",
            "-o", tmp_path / "a.h5ad", "--report", tmp_path / "run.html", "--save-model",
            tmp_path / "m.pt", "--truth-key", "cell_type", *FAST_ARGS]  # fmt: skip
    r = CliRunner().invoke(main, [str(x) for x in args])
    assert r.exit_code == 0, r.output
    args = ["predict", tmp_path / "m.pt", tmp_path / "q.h5ad", "-o", tmp_path / "p.h5ad",
            "--report", tmp_path / "run.json", "--truth-key", "cell_type"]  # fmt: skip
    r = CliRunner().invoke(main, [str(x) for x in args])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "run.html").read_text().startswith("<!DOCTYPE html>")
    rep = json.loads((tmp_path / "run.json").read_text())
    assert rep["output"] == str(tmp_path / "p.h5ad") and {"summary", "metrics"} <= set(rep)
    assert not list(tmp_path.glob(".*orca-tmp*"))


CHROMIUM = next(
    (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)),
    None,
)


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium installed")
def test_report_renders_in_headless_chromium(demo, tmp_path):
    path = orca_sc.tl.report(demo, tmp_path / "run.html", truth_key="bulk_labels")
    base = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--allow-file-access-from-files",
    ]
    dom = subprocess.run([*base, "--dump-dom", path.as_uri()], capture_output=True, text=True,
                         timeout=120, check=True).stdout  # fmt: skip
    tags = _Tags()
    tags.feed(dom)
    assert len(tags.imgs) == 3 and all(s.startswith("data:image/png") for s in tags.imgs)
    shot = tmp_path / "shot.png"
    subprocess.run([*base, f"--screenshot={shot}", "--window-size=1200,2400", path.as_uri()],
                   capture_output=True, timeout=120, check=True)  # fmt: skip
    assert _png_size("data:image/png;base64," + base64.b64encode(shot.read_bytes()).decode())


def test_report_without_novel_clusters_or_truth(tmp_path):
    a = orca_sc.datasets.simulate(300, 200, 3, markers_per_type=20, marker_fold=5.0, seed=1)
    a.obs["lab"] = a.obs["cell_type"].astype(object).where(np.arange(a.n_obs) % 2 == 0, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        orca_sc.tl.annotate(a, labels_key="lab", n_novel=0, novelty_folds=0, **FAST)
    text = orca_sc.tl.report(a, tmp_path / "r.html").read_text()
    assert "No novel cluster: every cell got a known type." in text
    assert "not calibrated" in text
