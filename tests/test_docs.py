"""The documentation site: built offline from ``docs/`` with warnings as errors (the ``docs``
extra), its API reference generated from the docstrings; its index rendered in headless
Chromium where one is installed.
"""

import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("sphinx", reason="the docs extra is not installed (pip install -e '.[docs]')")
pytest.importorskip("myst_nb", reason="the docs extra is not installed (pip install -e '.[docs]')")
pytest.importorskip("sphinx_click", reason="the docs extra is not installed")

CHROMIUM = next(
    (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)),
    None,
)


class _Text(HTMLParser):
    """The visible text and the links of a page."""

    def __init__(self):
        super().__init__()
        self.text, self.links = [], []

    def handle_data(self, data):
        self.text.append(data)

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.links.append(dict(attrs).get("href", ""))


def _page(path: Path) -> _Text:
    parsed = _Text()
    parsed.feed(path.read_text(encoding="utf-8"))
    return parsed


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built from a copy of ``docs/`` and ``tutorials/`` (the build writes the API
    pages beside its sources), offline, every warning an error.
    """
    src = tmp_path_factory.mktemp("site")
    shutil.copytree(ROOT / "docs", src / "docs", symlinks=True,
                    ignore=shutil.ignore_patterns("_build", "generated"))  # fmt: skip
    shutil.copytree(ROOT / "tutorials", src / "tutorials")
    out = src / "html"
    run = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(src / "docs"), str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def test_the_site_documents_every_public_name(site):
    import orca_sc

    api = _page(site / "api.html")
    text = " ".join(api.text)
    for name in ("tl.annotate", "tl.predict", "tl.summarize", "tl.report", "OrcaConfig",
                 "DiscoveryConfig", "OrcaModel", "read_lazy", "datasets.load", "vision.train_orca",
                 *(f"pl.{n}" for n in orca_sc.pl.__all__)):  # fmt: skip
        assert name in text, name
    # tl.annotate's page is generated from its docstring: its parameters and what it writes
    page = " ".join(_page(site / "generated" / "orca_sc.tl.annotate.html").text)
    for word in ("labels_key", "reference", "n_novel", "save_model", "obs['{key_added}_label']"):
        assert word in page, word
    # the command line's help, the tutorials with their stored outputs, the method pages
    cli = " ".join(_page(site / "cli.html").text)
    assert "orca-sc annotate" in cli and "--labels-key" in cli
    nb = (site / "tutorials" / "scanpy_workflow.html").read_text(encoding="utf-8")
    assert "cell_output" in nb and ("data:image/png" in nb or "_images/" in nb)
    for doc in ("method", "discovery", "outputs", "benchmarks"):
        assert (site / f"{doc}.html").exists()


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium installed")
def test_the_index_renders_in_headless_chromium_and_leads_to_annotate(site, tmp_path):
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
            "--allow-file-access-from-files"]  # fmt: skip
    dom = subprocess.run([*base, "--dump-dom", (site / "index.html").as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
    index = _Text()
    index.feed(dom)
    assert "orca_sc" in " ".join(index.text)
    assert any(h.split("#")[0] == "api.html" for h in index.links)
    api = subprocess.run([*base, "--dump-dom", (site / "api.html").as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
    assert "annotate" in api and "generated/orca_sc.tl.annotate.html" in api
    shot = tmp_path / "index.png"
    subprocess.run([*base, f"--screenshot={shot}", "--window-size=1200,1400",
                    (site / "index.html").as_uri()], capture_output=True, timeout=120, check=True)  # fmt: skip
    assert shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 10_000
