"""The benchmark's built-in datasets and tasks (see ``../shared/data/README.md``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ._splits import Task, batch_split, protocol_split


@dataclass(frozen=True)
class TaskSpec:
    """A named task: ``make(seed)`` builds the :class:`Task` (protocol splits depend on the seed)."""

    name: str
    kind: str  # "cross-batch" | "protocol"
    make: Callable[[int], Task]
    description: str


def _read(path: Path):
    import anndata as ad

    return ad.read_h5ad(path)


def _tm(path: Path, seed: int) -> Task:
    a = _read(path)
    a = a[a.obs["cell_type"] != "unannotated"].copy()  # removed by the consortium's QC
    return batch_split(a, "cell_type", "tissue", ["Kidney"], seed=seed, name="tm_kidney_to_marrow")


BARON_HIDDEN = ("ductal", "endothelial", "quiescent_stellate", "macrophage")


def _baron(path: Path, seed: int) -> Task:
    return batch_split(
        _read(path), "cell_type", "batch", ["mouse1"], novel_classes=BARON_HIDDEN, seed=seed,
        name="baron_mouse1_to_mouse2",
    )  # fmt: skip


def _pbmc_tech(path: Path, seed: int) -> Task:
    return batch_split(
        _read(path), "cell_type", "batch", ["Drop-seq"], novel_classes=["B cell"], seed=seed,
        name="pbmc_dropseq_to_indrops",
    )  # fmt: skip


def _protocol_file(path: Path, name: str, seed: int) -> Task:
    return protocol_split(_read(path), "cell_type", seed=seed, name=name)


def pbmc68k(seed: int) -> Task:
    """The paper's protocol on scanpy's pbmc68k_reduced (log-normalised values of 765 genes)."""
    import scanpy as sc

    a = sc.datasets.pbmc68k_reduced().raw.to_adata()
    a.obs["cell_type"] = a.obs["bulk_labels"].astype(str)
    return protocol_split(a, "cell_type", seed=seed, name="pbmc68k_protocol")


def builtin_tasks(data_dir: str | Path | None) -> list[TaskSpec]:
    """pbmc68k_reduced (ships with scanpy) plus every task whose file is in ``data_dir``."""
    specs = []
    d = Path(data_dir) if data_dir is not None else None

    def have(name):
        return d is not None and (d / name).is_file()

    if have("tm_facs_scfind.h5ad"):
        p = d / "tm_facs_scfind.h5ad"
        specs.append(
            TaskSpec(
                "tm_kidney_to_marrow",
                "cross-batch",
                lambda s, p=p: _tm(p, s),
                "Tabula Muris FACS: kidney reference, marrow query (B-lineage types novel)",
            )
        )
    if have("baron_mouse.h5ad"):
        p = d / "baron_mouse.h5ad"
        specs.append(
            TaskSpec(
                "baron_mouse1_to_mouse2",
                "cross-batch",
                lambda s, p=p: _baron(p, s),
                f"pancreas, mouse 1 reference without {', '.join(BARON_HIDDEN)}; mouse 2 query",
            )
        )
    if have("scannotate_pbmc.h5ad"):
        p = d / "scannotate_pbmc.h5ad"
        specs.append(
            TaskSpec(
                "pbmc_dropseq_to_indrops",
                "cross-batch",
                lambda s, p=p: _pbmc_tech(p, s),
                "PBMC cross-technology: Drop-seq reference without B cells; inDrops query",
            )
        )
    for file, name in (("mca_bladder.h5ad", "mca_bladder"), ("worm_neuron.h5ad", "worm_neuron")):
        if have(file):
            p = d / file
            specs.append(
                TaskSpec(
                    f"{name}_protocol",
                    "protocol",
                    lambda s, p=p, n=f"{name}_protocol": _protocol_file(p, n, s),
                    f"{name}: paper protocol (half the classes seen, half of each labelled)",
                )
            )
    specs.append(
        TaskSpec(
            "pbmc68k_protocol",
            "protocol",
            pbmc68k,
            "pbmc68k_reduced (scanpy): paper protocol",
        )
    )
    return specs
