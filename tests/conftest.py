import json
import os
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import orca_sc
from orca_sc._ablation import Ablation

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def open_world(adata, seen, labeled_fraction=0.5, seed=0, key="cell_type"):
    """Paper protocol on one AnnData: only part of the seen classes is labelled (``obs['lab']``)."""
    rng = np.random.default_rng(seed)
    lab = adata.obs[key].isin(seen).to_numpy() & (rng.random(adata.n_obs) < labeled_fraction)
    adata.obs["lab"] = adata.obs[key].astype(object).where(lab, None)
    return adata


def hidden_type_pair():
    """A simulated reference (batch 0, type_4 left out) and query (batch 1, type_4 in it) of
    five types with clear markers: the query holds one type the reference lacks.
    """
    a = orca_sc.datasets.simulate(1600, 300, 5, n_batches=2, batch_weights=[0.5, 0.5],
                                  markers_per_type=30, marker_fold=5.0, seed=4)  # fmt: skip
    b = a.obs["batch"].astype(str).to_numpy()
    t = a.obs["cell_type"].astype(str).to_numpy()
    return a[(b == "batch_0") & (t != "type_4")].copy(), a[b == "batch_1"].copy()


def record_returns(monkeypatch, module, name):
    """Replace ``module.name`` by a wrapper that records what each call returns; returns the
    list the return values are appended to.
    """
    orig = getattr(module, name)
    returned = []

    def wrapper(*args, **kwargs):
        out = orig(*args, **kwargs)
        returned.append(out)
        return out

    monkeypatch.setattr(module, name, wrapper)
    return returned


def assert_cli_error(result, *fragments):
    """Exit code 2 and exactly one ``Error:`` line on stderr that contains every fragment; no
    traceback.
    """
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    assert "Traceback" not in result.output


@pytest.fixture
def small_sim():
    """A quick open-world problem: 3 seen + 2 novel well-separated types."""
    a = orca_sc.datasets.simulate(500, 300, 5, markers_per_type=30, marker_fold=5.0, seed=3)
    return open_world(a, ["type_0", "type_1", "type_2"])


#: a short schedule for tests (the defaults train longer on small data): at least 150 optimiser
#: steps over 5 epochs
FAST_LAB = Ablation(epoch_min_steps=30)
#: :data:`FAST`'s user options alone (an OrcaConfig's fields)
FAST_OPTIONS = {"n_genes": None, "epochs": 5, "warmup_epochs": 1, "progress": False}
FAST = {**FAST_OPTIONS, "ablation": FAST_LAB}
#: :data:`FAST` on the command line (at least 150 steps over 10 epochs, 30 of them warm-up)
FAST_ARGS = ["--epochs", "10", "--warmup-epochs", "2", "--n-genes", "0", "-q"]


@dataclass(frozen=True)
class SmallRun:
    """:func:`small_sim` annotated once with :data:`FAST` and the model it saved; tests that
    only read the result share it (``adata()`` is a fresh copy each time).
    """

    annotated: Any
    model_path: Path

    def adata(self):
        return self.annotated.copy()


@pytest.fixture(scope="session")
def small_run(tmp_path_factory):
    """The one annotate run of :func:`small_sim` with :data:`FAST` shared by the tests that read
    its labels, record or model.
    """
    a = orca_sc.datasets.simulate(500, 300, 5, markers_per_type=30, marker_fold=5.0, seed=3)
    a = open_world(a, ["type_0", "type_1", "type_2"])
    path = tmp_path_factory.mktemp("small_run") / "model.pt"
    orca_sc.tl.annotate(a, labels_key="lab", save_model=path, **FAST)
    return SmallRun(a, path)


def computed_once(tmp_path_factory, name: str, compute) -> Any:
    """``compute(folder)``'s JSON-able result, made once per test session and read by every
    pytest-xdist worker that asks for it (a lock file in the session's shared temporary folder;
    with work stealing a module's tests can land on both workers). ``compute`` may also leave
    files in ``folder`` for its readers.
    """
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # one folder for the session's workers
    path = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            result = compute(tmp_path_factory.mktemp(name))
            path.write_text(json.dumps(result))
        return json.loads(path.read_text())


def _annotate_demo(folder: Path) -> dict:
    """The demo data (:func:`orca_sc._demo.demo_data`, seed 0) annotated with the defaults, the
    model saved: the files' paths.
    """
    import warnings

    from orca_sc._demo import demo_data

    model, out = folder / "model.pt", folder / "demo.h5ad"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = demo_data(0)
        orca_sc.tl.annotate(a, labels_key="input_label", progress=False, save_model=model)
    a.write_h5ad(out)
    return {"adata": str(out), "model": str(model)}


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> dict:
    """The default run on the demo data, made once per test session (for every worker): the
    paths of the annotated data (``adata``, read it with ``anndata.read_h5ad``) and of its
    saved model (``model``).
    """
    return {k: Path(v) for k, v in computed_once(tmp_path_factory, "demo", _annotate_demo).items()}


#: tests that need neither p-values nor the cross-fitted warm-ups (about a third of a short
#: run): without them the per-type threshold is the in-sample one and a batch without labelled
#: cells takes the share vote, so labels can differ from a default run's
LABELS_ONLY = {"novelty_folds": 0}


def rare_in_reference(n_rare=15, seed=0):
    """Log-normalised simulated counts: reference = batch 0 without type_5 and with only
    ``n_rare`` type_3 cells; query = batch 1 (all types, type_3 common).
    """
    import scanpy as sc

    from orca_sc.datasets import simulate

    a = simulate(3000, 1000, 6, n_batches=2, batch_strength=0.5, seed=seed)
    sc.pp.normalize_total(a, target_sum=1e4)
    sc.pp.log1p(a)
    t = a.obs["cell_type"].astype(str).to_numpy()
    b = a.obs["batch"].astype(str).to_numpy()
    ref = (b == "batch_0") & (t != "type_5")
    ref[np.flatnonzero(ref & (t == "type_3"))[n_rare:]] = False
    return a[ref].copy(), a[b == "batch_1"].copy()


# ------------------------------------------------ a local HTTP server for the downloader tests
class _Handler(BaseHTTPRequestHandler):
    files: dict = {}
    cut: dict = {}  # path -> bytes to send before dropping the connection (once)
    requests: list = []

    def log_message(self, *args):  # keep test output clean
        pass

    def do_GET(self):
        data = self.files.get(self.path)
        rng = self.headers.get("Range")
        self.requests.append((self.path, rng))
        if data is None:
            self.send_error(404, "Not Found")
            return
        start = int(rng.split("=")[1].rstrip("-")) if rng else 0
        body = data[start:]
        self.send_response(206 if rng else 200)
        self.send_header("Content-Length", str(len(body)))
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        n = self.cut.pop(self.path, None)
        if n is not None:  # drop the connection part-way
            self.wfile.write(body[:n])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)


@pytest.fixture
def server():
    _Handler.files, _Handler.cut, _Handler.requests = {}, {}, []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


#: thread pools that each library sizes to the machine unless told
_POOLS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def pytest_configure(config):
    """Under pytest-xdist every worker runs single-threaded (torch, BLAS, OpenMP, numba), so that
    the workers share the cores instead of oversubscribing them. The controller sets the
    environment before it starts the workers; a worker also sets torch's pool. The few tests
    that run more threads (or processes) on purpose share the cores with the other worker:
    OpenMP threads that wait passively (``OMP_WAIT_POLICY``) instead of spinning keep that from
    costing several times the test's own time (a two-thread test beside three others: 31 s
    spinning, 11 s passive).
    """
    if hasattr(config, "workerinput"):
        import torch

        torch.set_num_threads(1)
    elif getattr(config.option, "numprocesses", None):
        for k in _POOLS:
            os.environ.setdefault(k, "1")
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
