"""Fingerprints of every output of a run, to prove that a change of code moved no result.

For each development-suite task (``orca_sc.benchmark.dev_suite``) at the given seeds: the md5 of
``obs['orca_label']``, ``obs['orca_novel']``, ``obs['orca_confidence']``, ``obs['orca_novelty']``
and ``obsm['X_orca']`` (their bytes), and of ``uns['orca']`` without its timings (``uns``: as laid
out; ``uns_content``: whatever the key order; ``record``: without the options, ``params``). Then the same
for a task read from disk (``read_lazy``: the streamed reader), for ``tl.predict`` with the saved
model, and for the vision submodule's digits run (its accuracies). Run it before and after a
refactor and compare the two files::

    python benchmarks/fingerprint.py --out reports/fp_before.json
    python benchmarks/fingerprint.py --out reports/fp_after.json
    python benchmarks/fingerprint.py --compare reports/fp_before.json reports/fp_after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
#: ``uns['orca']`` entries that are timings, not results
TIMINGS = ("seconds", "discovery_seconds", "novelty_test_seconds")


def md5(a) -> str:
    return hashlib.md5(np.ascontiguousarray(a).tobytes()).hexdigest()


def _strip(obj):
    """``uns`` as plain JSON without timings (key order kept: the layout is part of the result)."""
    if isinstance(obj, dict):
        return {str(k): _strip(v) for k, v in obj.items() if k not in TIMINGS}
    if isinstance(obj, (list, tuple)):
        return [_strip(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _strip(obj.tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def outputs(adata, key: str = "orca") -> dict[str, str]:
    obs = adata.obs
    out = {
        "label": md5(obs[f"{key}_label"].astype(str).to_numpy().astype("U")),
        "novel": md5(obs[f"{key}_novel"].astype(str).to_numpy().astype("U")),
        "confidence": md5(obs[f"{key}_confidence"].to_numpy()),
        "novelty": md5(obs[f"{key}_novelty"].to_numpy()),
        "embedding": md5(adata.obsm[f"X_{key}"]),
    }
    uns = _strip(adata.uns[key])
    out["uns"] = hashlib.md5(json.dumps(uns, default=str).encode()).hexdigest()
    # the same content whatever the order of keys (h5ad groups do not keep it)
    out["uns_content"] = hashlib.md5(
        json.dumps(uns, sort_keys=True, default=str).encode()
    ).hexdigest()
    # the record without the options it was run with (a refactor of the options alone moves
    # only those)
    record = {k: v for k, v in uns.items() if k != "params"}
    out["record"] = hashlib.md5(
        json.dumps(record, sort_keys=True, default=str).encode()
    ).hexdigest()
    return out


def suite_fingerprints(data: Path | None, seeds: list[int], only: list[str] | None) -> dict:
    from orca_sc.benchmark import annotate_task, dev_suite

    specs = dev_suite(data, large=False, only=only)
    result = {}
    for spec in specs:
        for seed in seeds:
            t0 = time.perf_counter()
            q, _ = annotate_task(spec.make(seed), seed)
            result[f"{spec.name}@{seed}"] = outputs(q)
            print(
                f"{spec.name}@{seed} {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True
            )
    return result


def disk_and_predict_fingerprints() -> dict:
    """A reference + query written to ``.h5ad`` and annotated from disk (the streamed reader),
    then ``tl.predict`` of the query with the saved model, in memory and from disk.
    """
    import orca_sc
    from orca_sc.benchmark import SimSetting, make_sim_task

    task = make_sim_task(SimSetting("fp", n_ref=1500, n_query=1500), 0)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        ref, qry = Path(d) / "ref.h5ad", Path(d) / "query.h5ad"
        task.reference.write_h5ad(ref)
        task.query.write_h5ad(qry)
        model = Path(d) / "model.pt"
        q = orca_sc.read_lazy(qry)
        orca_sc.tl.annotate(
            q, orca_sc.read_lazy(ref), labels_key=task.labels_key, progress=False,
            save_model=str(model),
        )  # fmt: skip
        out["on_disk_annotate"] = outputs(q)
        q2 = task.query.copy()
        orca_sc.tl.predict(q2, str(model))
        out["predict_in_memory"] = outputs(q2)
        q3 = orca_sc.read_lazy(qry)
        orca_sc.tl.predict(q3, str(model))
        out["predict_on_disk"] = outputs(q3)
    return out


def vision_fingerprint() -> dict:
    from orca_sc import vision

    data = vision.load_images("digits")
    run = vision.train_orca(data, vision.preset("digits", epochs=3, seed=0), progress=False)
    last = run.history[-1]
    scores = {k: v for k, v in last.items() if k.startswith(("u_", "t_")) or k == "loss"}
    return {"digits": {k: round(float(v), 6) for k, v in scores.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--only", nargs="*", default=None, help="suite tasks whose name contains one")
    ap.add_argument("--no-suite", action="store_true")
    ap.add_argument("--no-vision", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("reports/fingerprint.json"))
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    warnings.simplefilter("ignore")
    fp = {}
    if not args.no_suite:
        fp.update(
            suite_fingerprints(args.data if args.data.is_dir() else None, args.seeds, args.only)
        )
    fp.update(disk_and_predict_fingerprints())
    if not args.no_vision:
        fp.update(vision_fingerprint())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fp, indent=1) + "\n")
    print(f"{len(fp)} fingerprints written to {args.out}")
    return 0


def compare(before: Path, after: Path) -> int:
    """Exit 1 when an output or the content of ``uns`` differs; a change of key order alone in
    ``uns`` is reported but not counted as a difference.
    """
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    same = reordered = differ = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'after' if name in b else 'before'}")
            differ += 1
            continue
        diff = [k for k in sorted(set(a[name]) | set(b[name])) if a[name].get(k) != b[name].get(k)]
        if diff == ["uns"]:
            reordered += 1
        elif diff:
            print(f"{name}: differs in {', '.join(diff)}")
            differ += 1
        else:
            same += 1
    print(
        f"{same} identical, {reordered} identical but for the key order of uns, {differ} different"
    )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
