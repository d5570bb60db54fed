"""Offline proof of orca_sc.vision on this CPU (issue 20): ORCA vs ORCA-ZM vs ORCA-FNM vs K-means on
frozen SimCLR features, the paper's split (50% classes seen, 50% of their images labelled), several
seeds, small CNN. Writes a Markdown + CSV report and per-epoch histories.

    python benchmarks/vision_offline.py --dataset digits --seeds 0 1 2 --out reports/vision_digits
    python benchmarks/vision_offline.py --dataset npz:../shared/data/cifar10_small.npz \
        --pretrain-epochs 40 --epochs 20 --shared-pretrain --out reports/vision_cifar10_small

One SimCLR pretraining per seed (``--shared-pretrain``: one for all seeds, as the paper uses one
pretrained network); the ORCA variants of a seed start from the same pretrained backbone and differ
only in the margin. Seeds also change the labelled images, the initial head and the augmentations.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pandas as pd

from orca_sc import vision

VARIANTS = {name: margin for margin, name in vision.METHOD_NAMES.items()}
# --ablations: the paper's other settings (App. B), ORCA with the adaptive margin
ABLATIONS = {
    "ORCA heads ×2": {"head_multiplier": 2},
    "ORCA heads ×4": {"head_multiplier": 4},
    "ORCA 10% labels": {"labelled_fraction": 0.1},
    "ORCA 30% seen": {"seen_fraction": 0.3},
    "ORCA 70% seen": {"seen_fraction": 0.7},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arch", default="small")
    ap.add_argument("--pretrain-epochs", type=int, default=40)
    ap.add_argument("--epochs", type=int, default=None, help="ORCA epochs (default: the preset)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--shared-pretrain", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--ablations", action="store_true", help="also " + ", ".join(ABLATIONS).replace("%", "%%")
    )
    ap.add_argument("--out", default="reports/vision_offline")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = vision.load_images(a.dataset)
    over = {"arch": a.arch, "eval_test": False}
    if a.epochs:
        over |= {"epochs": a.epochs, "milestones": (round(0.7 * a.epochs), round(0.9 * a.epochs))}
    if a.batch_size:
        over["batch_size"] = a.batch_size
    bs = a.batch_size or vision.preset(a.dataset).batch_size
    rows, histories = [], []
    ckpt = None
    for seed in a.seeds:
        if ckpt is None or not a.shared_pretrain:
            ckpt = out / f"simclr_seed{seed}.pt"
            t0 = time.perf_counter()
            pre = vision.pretrain_simclr(
                data,
                vision.PretrainConfig(
                    arch=a.arch, epochs=a.pretrain_epochs, batch_size=bs, seed=seed
                ),
                device=a.device,
                checkpoint=ckpt,
            )
            print(f"seed {seed}: SimCLR {a.pretrain_epochs} epochs, loss "
                  f"{pre.history[0]['loss']:.3f} -> {pre.history[-1]['loss']:.3f}, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
            backbone = pre.backbone
        split = vision.open_world_split(data.y_train, data.n_classes, seed=seed)
        t0 = time.perf_counter()
        km = vision.kmeans_baseline(backbone, data, split, device=a.device, seed=seed)
        rows.append({"dataset": a.dataset, "method": "K-means (SimCLR)", "seed": seed,
                     "seconds": time.perf_counter() - t0, **km})  # fmt: skip
        runs = {name: {"margin": margin} for name, margin in VARIANTS.items()}
        if a.ablations:
            runs |= ABLATIONS
        for name, extra in runs.items():
            cfg = vision.preset(a.dataset, seed=seed, **over, **extra)
            t0 = time.perf_counter()
            run = vision.train_orca(data, cfg, pretrained=ckpt, device=a.device)
            last = run.history[-1]
            rows.append({"dataset": a.dataset, "method": name, "seed": seed,
                         "seconds": time.perf_counter() - t0,
                         **{k: v for k, v in last.items() if k.startswith(("u_", "t_"))}})  # fmt: skip
            histories += [{"method": name, "seed": seed, **h} for h in run.history]
            print(f"seed {seed} {name}: seen {last['u_seen']:.3f} novel {last['u_novel']:.3f} "
                  f"all {last['u_all']:.3f} novel->novel {last['u_novel_called_novel']:.3f} "
                  f"found {last['u_novel_found']}/{last['u_novel_true']} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
        df = pd.DataFrame(rows)
        pd.DataFrame(histories).to_csv(out / "history.csv", index=False)
        notes = (
            f"Dataset `{a.dataset}`, backbone `{a.arch}`, SimCLR {a.pretrain_epochs} epochs "
            f"({'one pretraining shared by all seeds' if a.shared_pretrain else 'one per seed'}), "
            f"ORCA settings: `{json.dumps(over)}`. Command: `python benchmarks/vision_offline.py "
            f"{' '.join(sys.argv[1:] if argv is None else argv)}`."
        )
        vision.write_report(df, out / "report.md", "orca_sc.vision offline check", notes)
    print((out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
