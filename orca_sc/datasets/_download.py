"""Data manifests and a checksummed, resumable downloader (``orca_sc.datasets.load``).

Every public dataset is described by one JSON manifest (``data_manifests/`` in the repository,
shipped inside the package): URLs, sizes and checksums where published. Files are downloaded into
a cache directory (``cache_dir``, else ``$ORCA_SC_DATA``, else the user cache directory) as
``<name>/<file>.part`` and renamed only once their size and checksum are verified, so a partial
file never carries the final name. An interrupted download resumes from the ``.part`` file (HTTP
``Range``). Once cached, loading needs no network. Files without a published checksum get their
SHA-256 recorded on first download (``<file>.sha256`` beside it, reported in the log) and checked
on every later load.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20
MANIFEST_KEYS = {
    "name": str,
    "description": str,
    "citation": str,
    "license": str,
    "landing_page": str,
    "files": list,
    "format": str,
    "labels_key": str,
    "values": str,
    "preprocessing": str,
}
FILE_KEYS = {"filename": str, "url": str}


class DownloadError(OSError):
    """A dataset file could not be obtained or failed verification (the message says what to do)."""


@dataclass(frozen=True)
class RemoteFile:
    filename: str
    url: str
    size: int | None = None
    sha256: str | None = None
    md5: str | None = None
    size_approx: str | None = None


@dataclass(frozen=True)
class Manifest:
    """One dataset: what it is, where it comes from and how to verify it."""

    name: str
    description: str
    files: tuple[RemoteFile, ...]
    format: str
    labels_key: str | None = None
    tissue_key: str | None = None
    builtin: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        validate_manifest(d)
        files = tuple(
            RemoteFile(
                filename=f["filename"],
                url=f["url"],
                size=f.get("size"),
                sha256=f.get("sha256"),
                md5=f.get("md5"),
                size_approx=f.get("size_approx"),
            )
            for f in d["files"]
        )
        return cls(
            name=d["name"],
            description=d["description"],
            files=files,
            format=d["format"],
            labels_key=d.get("labels_key"),
            tissue_key=d.get("tissue_key"),
            builtin=d.get("builtin"),
            raw=dict(d),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Manifest:
        return cls.from_dict(json.loads(Path(path).read_text()))


def validate_manifest(d: Any) -> None:
    """Raise ``ValueError`` naming the first problem of a manifest dict."""
    if not isinstance(d, dict):
        raise ValueError("a manifest must be a JSON object")
    name = d.get("name", "?")
    for key, typ in MANIFEST_KEYS.items():
        if key not in d:
            raise ValueError(f"manifest {name!r}: missing field {key!r}")
        if not isinstance(d[key], typ):
            raise ValueError(f"manifest {name!r}: field {key!r} must be {typ.__name__}")
    if not d["files"] and not d.get("builtin"):
        raise ValueError(f"manifest {name!r}: no files and no 'builtin' loader")
    for f in d["files"]:
        for key, typ in FILE_KEYS.items():
            if not isinstance(f.get(key), typ):
                raise ValueError(f"manifest {name!r}: every file needs a {key!r} ({typ.__name__})")
        if not str(f["url"]).startswith(("https://", "http://")):
            raise ValueError(f"manifest {name!r}: url {f['url']!r} is not http(s)")
        if f.get("size") is not None and (not isinstance(f["size"], int) or f["size"] <= 0):
            raise ValueError(f"manifest {name!r}: size of {f['filename']!r} must be a positive int")
        for algo, n in (("sha256", 64), ("md5", 32)):
            v = f.get(algo)
            if v is not None and (
                not isinstance(v, str) or len(v) != n or any(c not in "0123456789abcdef" for c in v)
            ):
                raise ValueError(
                    f"manifest {name!r}: {algo} of {f['filename']!r} is not {n} hex digits"
                )


# ------------------------------------------------------------------------------------ manifests
def manifest_dirs() -> list[Path]:
    """Where manifests live: inside the installed package, else the repository's directory."""
    here = Path(__file__).resolve()
    return [
        p
        for p in (here.parents[1] / "data_manifests", here.parents[2] / "data_manifests")
        if p.is_dir()
    ]


def manifests() -> dict[str, Manifest]:
    """All known datasets by name."""
    out: dict[str, Manifest] = {}
    for d in manifest_dirs():
        for f in sorted(d.glob("*.json")):
            m = Manifest.from_file(f)
            out.setdefault(m.name, m)
    return out


def get_manifest(name: str) -> Manifest:
    known = manifests()
    if name not in known:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(sorted(known))}.")
    return known[name]


# ---------------------------------------------------------------------------------------- cache
def default_cache_dir() -> Path:
    """``$ORCA_SC_DATA``, else the user cache directory (XDG / macOS / Windows conventions)."""
    env = os.environ.get("ORCA_SC_DATA")
    if env:
        return Path(env).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
        return base / "orca_sc" / "Cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "orca_sc"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "orca_sc"


def _hash(path: Path, algo: str) -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _verify(path: Path, rf: RemoteFile, *, first_download: bool) -> None:
    """Check size and checksum; without a published checksum, record the SHA-256 the first time
    and compare with the record afterwards.
    """
    size = path.stat().st_size
    if rf.size is not None and size != rf.size:
        raise DownloadError(
            f"{rf.filename}: size {size:,} bytes, expected {rf.size:,}; the file is incomplete "
            "or has changed upstream. It was removed; run again to download it anew."
        )
    for algo in ("sha256", "md5"):
        want = getattr(rf, algo)
        if want is not None:
            got = _hash(path, algo)
            if got != want:
                raise DownloadError(
                    f"{rf.filename}: {algo} {got} does not match the published {want}; the file "
                    "is corrupt or was changed upstream. It was removed; run again to retry."
                )
            return
    record = path.with_name(path.name.removesuffix(".part") + ".sha256")
    got = _hash(path, "sha256")
    if first_download or not record.exists():
        record.write_text(got + "\n")
        logger.warning(
            "%s: no published checksum; recorded sha256 %s (%d bytes) in %s. Later loads are "
            "checked against it.",
            rf.filename, got, size, record,
        )  # fmt: skip
    elif record.read_text().strip() != got:
        raise DownloadError(
            f"{rf.filename}: sha256 {got} differs from the one recorded at first download "
            f"({record.read_text().strip()}) in {record}; delete both files to download again."
        )


def _open(url: str, start: int, timeout: float):
    req = urllib.request.Request(url, headers={"User-Agent": "orca_sc"})
    if start:
        req.add_header("Range", f"bytes={start}-")
    return urllib.request.urlopen(req, timeout=timeout)  # noqa: S310 - http(s) only (validated)


def _download(rf: RemoteFile, part: Path, *, progress: bool, timeout: float, retries: int) -> None:
    """Fetch ``rf`` into ``part``, resuming what is there; retries resume after a cut connection."""
    from tqdm import tqdm

    attempt = 0
    while True:
        start = part.stat().st_size if part.exists() else 0
        try:
            with _open(rf.url, start, timeout) as resp:
                if start and resp.status != 206:  # the server ignores Range: start over
                    start = 0
                length = resp.headers.get("Content-Length")
                total = start + int(length) if length is not None else rf.size
                with (
                    open(part, "ab" if start else "wb") as fh,
                    tqdm(
                        total=total, initial=start, unit="B", unit_scale=True,
                        desc=rf.filename, disable=not progress, leave=False,
                    ) as bar,
                ):  # fmt: skip
                    while True:
                        block = resp.read(_CHUNK)
                        if not block:
                            break
                        fh.write(block)
                        bar.update(len(block))
                got = part.stat().st_size
                if total is not None and got < total:
                    raise ConnectionError(f"connection closed at {got:,} of {total:,} bytes")
                return
        except urllib.error.HTTPError as e:
            if e.code == 416 and start:  # asked beyond the end: what we have may be complete
                return
            raise DownloadError(
                f"Could not download {rf.url}: HTTP {e.code} {e.reason}. The manifest's URL may "
                f"be outdated; get {rf.filename} from the dataset's landing page and place it at "
                f"{part.with_name(rf.filename)}."
            ) from None
        except (urllib.error.URLError, http.client.HTTPException, TimeoutError, OSError) as e:
            attempt += 1
            reason = getattr(e, "reason", e)
            if attempt > retries:
                raise DownloadError(
                    f"Could not download {rf.url} ({reason}). Without network access, download "
                    f"it elsewhere and place it at {part.with_name(rf.filename)}; a partial "
                    f"download ({part.stat().st_size if part.exists() else 0:,} bytes) is kept "
                    "and will be resumed."
                ) from None
            logger.warning(
                "%s: %s; resuming (attempt %d of %d).", rf.filename, reason, attempt, retries
            )
            time.sleep(min(2.0**attempt * 0.1, 5.0))


def fetch(
    dataset: str | Manifest,
    *,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    timeout: float = 60.0,
    retries: int = 3,
) -> dict[str, Path]:
    """Make every file of ``dataset`` available locally; returns ``{filename: path}``.

    Cached, verified files are used without network access.
    """
    m = dataset if isinstance(dataset, Manifest) else get_manifest(dataset)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / m.name
    paths = {}
    for rf in m.files:
        final = folder / rf.filename
        if final.exists():
            _verify(final, rf, first_download=False)
            paths[rf.filename] = final
            continue
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DownloadError(
                f"Cannot create the cache directory {folder} ({e}); pass cache_dir= or set ORCA_SC_DATA."
            ) from None
        part = folder / (rf.filename + ".part")
        logger.info(
            "Downloading %s (%s) from %s", rf.filename, rf.size_approx or "size unknown", rf.url
        )
        _download(rf, part, progress=progress, timeout=timeout, retries=retries)
        try:
            _verify(part, rf, first_download=True)
        except DownloadError:
            part.unlink(missing_ok=True)
            raise
        os.replace(part, final)
        paths[rf.filename] = final
    return paths


def load(name: str | Manifest, *, cache_dir: str | Path | None = None, progress: bool = True):
    """Load a dataset listed in ``data_manifests/`` as AnnData, downloading it on first use.

    Datasets bundled with a dependency (``pbmc68k_reduced``) load from there. Image datasets
    (``cifar10``, ``cifar100``, ``digits``, ``imagenet100``) are not AnnData: load them with
    :func:`orca_sc.vision.load_images`, which fetches them through :func:`fetch`. For datasets
    that are not a single ``.h5ad`` (the Tabula Muris 2018 CSV/10x archives) use :func:`fetch`,
    which returns the local file paths.
    """
    import anndata as ad

    from .._errors import OrcaInputError

    m = name if isinstance(name, Manifest) else get_manifest(name)
    if m.raw.get("kind") == "images":
        msg = (
            f"{m.name!r} is an image dataset, not AnnData; load it with "
            f"orca_sc.vision.load_images({m.name!r})."
        )
        raise OrcaInputError(msg)
    if m.builtin == "scanpy.datasets.pbmc68k_reduced":
        import scanpy as sc

        return sc.datasets.pbmc68k_reduced().raw.to_adata()
    h5ads = [f for f in m.files if f.filename.endswith(".h5ad")]
    if len(h5ads) != 1:
        raise ValueError(
            f"dataset {m.name!r} is {m.format}, not one .h5ad; use orca_sc.datasets.fetch("
            f"{m.name!r}) for the local paths."
        )
    paths = fetch(m, cache_dir=cache_dir, progress=progress)
    return ad.read_h5ad(paths[h5ads[0].filename])
