"""``orca-sc vision pretrain | train | evaluate``: the paper's image benchmarks from the shell.

Added to the ``orca-sc`` group by :mod:`orca_sc.cli`; torch and :mod:`orca_sc.vision` are
imported only when a command runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from ._cli_common import CliError, Command, Group, Outputs, cli_logging, errors

_DATASET_HELP = "cifar10, cifar100, imagenet100 (with --data-dir), digits or npz:PATH."
_ARCHS = ("small", "resnet18", "resnet50")


def _common(f):
    opts = [
        click.option("--dataset", required=True, help=_DATASET_HELP),
        click.option(
            "--data-dir", default=None, help="ImageNet-100 root with train/<wnid>/ and val/<wnid>/."
        ),
        click.option(
            "--cache-dir", default=None, help="Download cache (default $ORCA_SC_DATA or ~/.cache)."
        ),
        click.option(
            "--arch",
            type=click.Choice(_ARCHS),
            default=None,
            help="Backbone (default: resnet18 for CIFAR, resnet50 for ImageNet-100, small otherwise).",
        ),
        click.option("--epochs", type=int, default=None, help="Epochs (default: the preset)."),
        click.option("--batch-size", type=int, default=None, help="Mini-batch size (default 512)."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option(
            "--device", default="auto", show_default=True, help="auto, cpu, cuda[:N], mps."
        ),
        click.option("--amp", is_flag=True, help="bfloat16 autocast on CUDA."),
        click.option("--workers", type=int, default=None, help="Image-decoding worker processes."),
        click.option(
            "-o", "--output", required=True, help="Checkpoint to write after every epoch (.pt)."
        ),
        click.option("--resume", default=None, help="Continue the run saved in this checkpoint."),
        click.option("--quiet", "-q", is_flag=True, help="No progress bar or log messages."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _claim(
    output: str | None, report: str | None, inputs: list[str | None]
) -> tuple[Path, Path | None]:
    """The checkpoint (rewritten after every epoch, so an existing one is replaced) and report
    paths, checked before any work by the annotate command's rules (not empty, not a directory,
    not an input, folder present and writable).
    """
    outs = Outputs(overwrite=True, inputs=[p for p in inputs if p])
    out = outs.claim(output, "Checkpoint") if output is not None else None
    return out, (outs.claim(report, "Report") if report is not None else None)


def _milestones(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise CliError(f"Invalid --milestones {text!r}: expected epochs such as 140,180.") from None


def _load(dataset, data_dir, cache_dir):
    from .vision import load_images

    return load_images(dataset, data_dir=data_dir, cache_dir=cache_dir)


def _echo_metrics(scores: dict) -> None:
    """The ``u_*`` (unlabelled training images) and ``t_*`` (test split) metrics as a table."""
    keys = ("seen", "novel", "all", "novel_called_novel", "seen_called_novel", "novel_found")
    click.echo("split        " + "  ".join(f"{k:>18}" for k in keys))
    for name, prefix in (("unlabelled", "u_"), ("test", "t_")):
        vals = [scores.get(prefix + k) for k in keys]
        click.echo(
            f"{name:<12} "
            + "  ".join(f"{v:>18.3f}" if isinstance(v, float) else f"{v!s:>18}" for v in vals)
        )


def _write_report(path: Path, dataset: str, config: dict, scores: dict, title: str, notes: str):
    """One run's Markdown + CSV report (:func:`orca_sc.vision._report.write_report`)."""
    import pandas as pd

    from .vision import METHOD_NAMES
    from .vision._report import write_report

    row = {"dataset": dataset, "method": METHOD_NAMES[config["margin"]], "seed": config["seed"]}
    write_report(pd.DataFrame([row | scores]), path, title, notes)


@click.group(cls=Group)
def vision() -> None:
    """ORCA on images: the paper's CIFAR-10/100 and ImageNet-100 benchmarks.

    \b
    Examples:
      orca-sc vision pretrain --dataset cifar10 -o simclr_c10.pt
      orca-sc vision train --dataset cifar10 --pretrained simclr_c10.pt -o orca_c10.pt
      orca-sc vision evaluate orca_c10.pt --report orca_c10.md
    """


@vision.command("pretrain", cls=Command)
@_common
@click.option("--lr", type=float, default=1e-3, show_default=True, help="Adam learning rate.")
@click.option("--temperature", type=float, default=0.5, show_default=True, help="NT-Xent τ.")
@click.pass_context
def pretrain(ctx, dataset, data_dir, cache_dir, arch, epochs, batch_size, seed, device, amp,
             workers, output, resume, quiet, lr, temperature):  # fmt: skip
    """SimCLR pretraining of a backbone on all training images (labelled or not)."""
    with errors(ctx), cli_logging(quiet):
        out, _ = _claim(output, None, [])
        from .vision import PretrainConfig, preset, pretrain_simclr

        p = preset(dataset)
        cfg = PretrainConfig(
            arch=arch or p.arch,
            epochs=epochs or 200,
            batch_size=batch_size or p.batch_size,
            lr=lr,
            temperature=temperature,
            seed=seed,
            amp=amp,
            workers=p.workers if workers is None else workers,
        )
        data = _load(dataset, data_dir, cache_dir)
        run = pretrain_simclr(
            data, cfg, device=device, progress=not quiet, checkpoint=out, resume=resume
        )
    h = run.history[-1] if run.history else {}
    click.echo(
        f"SimCLR {cfg.arch} on {data.name}: {len(run.history)} epochs, loss {h.get('loss', float('nan')):.4f}, "
        f"{h.get('images_per_s', 0):.0f} images/s. Wrote {out} and {out}.json"
    )


@vision.command("train", cls=Command)
@_common
@click.option("--pretrained", default=None, help="SimCLR checkpoint to start the backbone from.")
@click.option("--lr", type=float, default=None, help="SGD learning rate (default 0.1).")
@click.option("--milestones", default=None, help="Epochs where lr drops 10× (default 140,180).")
@click.option("--weight-decay", type=float, default=None, help="Default 5e-4 (1e-4 ImageNet).")
@click.option(
    "--margin",
    type=click.Choice(["adaptive", "fixed", "zero"]),
    default="adaptive",
    show_default=True,
    help="ORCA, ORCA-FNM (fixed 0.5) or ORCA-ZM.",
)
@click.option("--fixed-margin", type=float, default=0.5, show_default=True)
@click.option(
    "--head-multiplier", type=int, default=1, show_default=True, help="Heads = k × classes."
)
@click.option("--seen-fraction", type=float, default=0.5, show_default=True)
@click.option("--labelled-fraction", type=float, default=0.5, show_default=True)
@click.option(
    "--freeze/--no-freeze",
    default=None,
    help="Train only the last block and the head (default: when --pretrained is given).",
)
@click.option("--report", default=None, help="Write a Markdown report here (+ .csv, history).")
@click.pass_context
def train(ctx, dataset, data_dir, cache_dir, arch, epochs, batch_size, seed, device, amp, workers,
          output, resume, quiet, pretrained, lr, milestones, weight_decay, margin, fixed_margin,
          head_multiplier, seen_fraction, labelled_fraction, freeze, report):  # fmt: skip
    """ORCA training with the paper's open-world split, metrics after every epoch."""
    with errors(ctx), cli_logging(quiet):
        out, report_path = _claim(output, report, [pretrained])
        from .vision import METHOD_NAMES, preset, train_orca

        over = dict(
            margin=margin, fixed_margin=fixed_margin, head_multiplier=head_multiplier,
            seen_fraction=seen_fraction, labelled_fraction=labelled_fraction, freeze=freeze,
            seed=seed, amp=amp,
        )  # fmt: skip
        for k, v in dict(
            arch=arch, epochs=epochs, batch_size=batch_size, lr=lr, workers=workers,
            milestones=_milestones(milestones), weight_decay=weight_decay,
        ).items():  # fmt: skip
            if v is not None:
                over[k] = v
        if epochs is not None and milestones is None:  # keep the paper's 70% / 90% decay points
            over["milestones"] = (round(0.7 * epochs), round(0.9 * epochs))
        cfg = preset(dataset, **over)
        data = _load(dataset, data_dir, cache_dir)
        run = train_orca(
            data, cfg, pretrained=pretrained, device=device, progress=not quiet,
            checkpoint=out, resume=resume,
        )  # fmt: skip
        scores = {k: v for k, v in run.history[-1].items() if k.startswith(("u_", "t_"))}
        if report_path is not None:
            import pandas as pd

            history = report_path.with_name(report_path.stem + ".history.csv")
            pd.DataFrame(run.history).to_csv(history, index=False)
            config = asdict(run.config)
            title = f"orca_sc.vision: {METHOD_NAMES[config['margin']]} on {data.name}"
            notes = f"Configuration: `{json.dumps(config)}`; {len(run.history)} epochs."
            _write_report(report_path, data.name, config, scores, title, notes)
    _echo_metrics(scores)
    click.echo(f"Wrote {out} and {out}.json" + (f", {report_path}" if report_path else ""))


@vision.command("evaluate", cls=Command)
@click.argument("checkpoint", metavar="CHECKPOINT.pt")
@click.option("--dataset", default=None, help="Default: the checkpoint's dataset.")
@click.option("--data-dir", default=None, help="ImageNet-100 root.")
@click.option("--cache-dir", default=None)
@click.option("--device", default="auto", show_default=True)
@click.option("--report", default=None, help="Write a Markdown report here (+ .csv).")
@click.option("--quiet", "-q", is_flag=True)
@click.pass_context
def evaluate(ctx, checkpoint, dataset, data_dir, cache_dir, device, report, quiet):
    """Score an ORCA checkpoint on the unlabelled training images and the test split."""
    with errors(ctx), cli_logging(quiet):
        _, report_path = _claim(None, report, [checkpoint])
        from ._cells import resolve_device
        from .vision import load_orca, open_world_split, score

        dev = resolve_device(device)
        net, meta = load_orca(checkpoint, device=dev)
        data = _load(dataset or meta["dataset"], data_dir, cache_dir)
        if list(data.classes) != list(meta["classes"]):
            raise CliError(
                f"{checkpoint} was trained on {meta['dataset']!r} classes; --dataset {data.name!r} "
                "has other classes."
            )
        cfg = meta["config"]
        split = open_world_split(
            data.y_train, data.n_classes, cfg["seen_fraction"], cfg["labelled_fraction"],
            cfg["seed"],
        )  # fmt: skip
        scores, _ = score(net, data, split, dev)
        if report_path is not None:
            title = f"orca_sc.vision: {checkpoint}"
            notes = f"Checkpoint `{checkpoint}` after {meta['epoch']} epochs."
            _write_report(report_path, data.name, cfg, scores, title, notes)
    _echo_metrics(scores)
