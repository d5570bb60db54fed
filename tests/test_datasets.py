"""Dataset manifests and the checksummed downloader, against a local HTTP server (``server``
in conftest.py).
"""

import hashlib
import json

import numpy as np
import pytest
from conftest import _Handler

import orca_sc
from orca_sc.datasets import DownloadError, Manifest, fetch, load
from orca_sc.datasets._download import manifest_dirs, validate_manifest


def _manifest(url, filename="data.bin", **extra):
    return Manifest.from_dict(
        {
            "name": "testdata", "description": "test", "citation": "none", "license": "CC0",
            "landing_page": url, "format": "binary", "labels_key": "cell_type", "values": "x",
            "preprocessing": "none", "files": [{"filename": filename, "url": f"{url}/{filename}", **extra}],
        }
    )  # fmt: skip


PAYLOAD = np.random.default_rng(0).bytes(3_000_000)  # 3 MB: several read chunks
SHA = hashlib.sha256(PAYLOAD).hexdigest()


def test_download_verify_and_offline_reuse(server, tmp_path):
    httpd, url = server
    _Handler.files["/data.bin"] = PAYLOAD
    m = _manifest(url, size=len(PAYLOAD), sha256=SHA)
    paths = fetch(m, cache_dir=tmp_path, progress=False)
    assert paths["data.bin"] == tmp_path / "testdata" / "data.bin"
    assert paths["data.bin"].read_bytes() == PAYLOAD
    assert sorted(p.name for p in (tmp_path / "testdata").iterdir()) == ["data.bin"]
    httpd.shutdown()  # offline from now on: the cached, verified file is used
    assert fetch(m, cache_dir=tmp_path, progress=False)["data.bin"].read_bytes() == PAYLOAD


def test_resume_after_cut_connection(server, tmp_path):
    _, url = server
    _Handler.files["/data.bin"] = PAYLOAD
    _Handler.cut["/data.bin"] = 1_000_000
    m = _manifest(url, size=len(PAYLOAD), sha256=SHA)
    # no retries: the call fails, the partial file is kept under the .part name only
    with pytest.raises(DownloadError, match="partial download \\(1,000,000 bytes\\) is kept"):
        fetch(m, cache_dir=tmp_path, progress=False, retries=0)
    assert sorted(p.name for p in (tmp_path / "testdata").iterdir()) == ["data.bin.part"]
    # the next call resumes with a Range request and completes
    path = fetch(m, cache_dir=tmp_path, progress=False)["data.bin"]
    assert path.read_bytes() == PAYLOAD
    assert _Handler.requests[-1] == ("/data.bin", "bytes=1000000-")
    # within one call, a cut connection is resumed automatically
    _Handler.cut["/data.bin"] = 500_000
    path2 = fetch(m, cache_dir=tmp_path / "again", progress=False)["data.bin"]
    assert path2.read_bytes() == PAYLOAD
    assert _Handler.requests[-1] == ("/data.bin", "bytes=500000-")


def test_checksum_and_size_mismatch_reject_the_file(server, tmp_path):
    _, url = server
    _Handler.files["/data.bin"] = PAYLOAD
    bad = _manifest(url, sha256="0" * 64)
    with pytest.raises(DownloadError, match="does not match the published"):
        fetch(bad, cache_dir=tmp_path, progress=False)
    assert list((tmp_path / "testdata").iterdir()) == []  # neither final nor partial file
    wrong_size = _manifest(url, size=len(PAYLOAD) + 1)
    with pytest.raises(DownloadError, match="expected 3,000,001"):
        fetch(wrong_size, cache_dir=tmp_path, progress=False, retries=0)
    assert not (tmp_path / "testdata" / "data.bin").exists()


def test_unpublished_checksum_is_recorded_then_enforced(server, tmp_path, caplog):
    _, url = server
    _Handler.files["/data.bin"] = PAYLOAD
    m = _manifest(url)
    with caplog.at_level("WARNING"):
        path = fetch(m, cache_dir=tmp_path, progress=False)["data.bin"]
    assert f"recorded sha256 {SHA}" in caplog.text
    assert (tmp_path / "testdata" / "data.bin.sha256").read_text().strip() == SHA
    path.write_bytes(PAYLOAD[:-1] + b"\0")  # the cached file changes
    with pytest.raises(DownloadError, match="differs from the one recorded"):
        fetch(m, cache_dir=tmp_path, progress=False)


def test_404_and_offline_messages(server, tmp_path):
    _, url = server
    with pytest.raises(DownloadError, match="HTTP 404"):
        fetch(_manifest(url, filename="missing.bin"), cache_dir=tmp_path, progress=False)
    dead = _manifest("http://127.0.0.1:9", filename="x.h5ad")  # nothing listens on port 9
    target = tmp_path / "testdata" / "x.h5ad"
    with pytest.raises(DownloadError) as e:
        fetch(dead, cache_dir=tmp_path, progress=False, retries=1)
    assert "Could not download http://127.0.0.1:9/x.h5ad" in str(e.value)
    assert f"place it at {target}" in str(e.value)


def test_load_h5ad_and_cache_env(server, tmp_path, monkeypatch):
    _, url = server
    a = orca_sc.datasets.simulate(50, 60, 2, markers_per_type=10, seed=0)
    a.write_h5ad(tmp_path / "src.h5ad")
    _Handler.files["/sim.h5ad"] = (tmp_path / "src.h5ad").read_bytes()
    monkeypatch.setenv("ORCA_SC_DATA", str(tmp_path / "cache"))
    b = load(_manifest(url, filename="sim.h5ad"), progress=False)
    assert (b.X != a.X).nnz == 0 and list(b.obs_names) == list(a.obs_names)
    assert (tmp_path / "cache" / "testdata" / "sim.h5ad").exists()


def test_shipped_manifests_are_valid():
    (d,) = manifest_dirs()[:1]
    files = sorted(d.glob("*.json"))
    names = set()
    for f in files:
        raw = json.loads(f.read_text())
        validate_manifest(raw)
        assert f.stem == raw["name"] and raw["name"] not in names
        names.add(raw["name"])
    assert {"tabula_muris_senis_facs", "tabula_muris_2018_facs", "tabula_muris_2018_droplet",
            "pbmc68k_reduced"} <= names  # fmt: skip
    tms = orca_sc.datasets.manifests()["tabula_muris_senis_facs"]
    assert tms.files[0].url == "https://ndownloader.figshare.com/files/23939711"
    with pytest.raises(ValueError, match="missing field 'citation'"):
        validate_manifest(
            {k: v for k, v in json.loads(files[0].read_text()).items() if k != "citation"}
        )
    p = load("pbmc68k_reduced")  # bundled with scanpy: no download
    assert (
        p.n_obs == 700 and (p.X.min() if not hasattr(p.X, "toarray") else p.X.toarray().min()) >= 0
    )
