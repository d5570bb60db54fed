"""The benchmark's built-in datasets and tasks (see ``../shared/data/README.md``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ._splits import Task, batch_split, protocol_split


@dataclass(frozen=True)
class TaskSpec:
    """A named task: ``make(seed)`` builds the :class:`Task` (protocol splits depend on the seed)."""

    name: str
    kind: str  # "cross-batch" | "protocol"
    make: Callable[[int], Task]
    description: str


#: the dataset family of a task, by what its name holds (first match): the suite's real tasks
#: come from seven datasets, and a default must pay on each of them, not only in aggregate
DATASET_FAMILIES = (
    ("pbmc_sorted", "PBMC sorted / pbmc3k"),
    ("pbmc_3k", "PBMC sorted / pbmc3k"),
    ("pbmc68k", "pbmc68k"),
    ("pbmc", "PBMC Drop-seq / inDrops"),
    ("tm", "Tabula Muris"),
    ("baron", "Baron pancreas"),
    ("mca", "MCA bladder"),
    ("worm", "worm neurons"),
    ("sim_", "simulated"),
)


def dataset_family(task: str) -> str:
    """The dataset family of the task named ``task`` (:data:`DATASET_FAMILIES`; ``"other"``: a
    user's own ``--h5ad`` task).
    """
    name = task.lower()
    return next((family for key, family in DATASET_FAMILIES if key in name), "other")


def real_family(task: str) -> bool:
    """Whether the task named ``task`` is of real data (any family but the simulations, a
    user's own ``--h5ad`` task included): the families a default is judged on
    (``--only family:real``, ``orca-sc compare --ceiling``).
    """
    return dataset_family(task) != "simulated"


def _read(path: Path):
    import anndata as ad

    return ad.read_h5ad(path)


def read_tm(path: Path):
    """The Tabula Muris cells with an annotation (``unannotated``: removed by the QC)."""
    a = _read(path)
    return a[a.obs["cell_type"] != "unannotated"].copy()


def _tm(path: Path, name: str, seed: int, reference: str = "Kidney") -> Task:
    return batch_split(read_tm(path), "cell_type", "tissue", [reference], seed=seed, name=name)


BARON_HIDDEN = ("ductal", "endothelial", "quiescent_stellate", "macrophage")


def _baron(
    path: Path, name: str, seed: int, reference: str = "mouse1", hidden=BARON_HIDDEN
) -> Task:
    return batch_split(
        _read(path), "cell_type", "batch", [reference], novel_classes=hidden, seed=seed,
        name=name,
    )  # fmt: skip


def _pbmc_tech(
    path: Path, name: str, seed: int, reference: str = "Drop-seq", hidden=("B cell",)
) -> Task:
    return batch_split(
        _read(path), "cell_type", "batch", [reference], novel_classes=hidden, seed=seed,
        name=name,
    )  # fmt: skip


#: the two experiments of ``pbmc_sorted_vs_3k.h5ad`` (same 10x 3' v1 chemistry, other donors)
SORTED, PBMC3K = "Zheng2017_sorted_10xv1", "pbmc3k_10xv1"


def _pbmc_sorted(path: Path, name: str, seed: int, reference: str = SORTED) -> Task:
    """Bead-sorted PBMC populations against the whole pbmc3k, scored on the shared vocabulary
    (``cell_type_common``): the types of one side the other lacks are novel.
    """
    return batch_split(_read(path), "cell_type_common", "batch", [reference], seed=seed, name=name)


def read_pbmc_sorted(path: Path):
    """The sorted experiment of ``pbmc_sorted_vs_3k.h5ad`` alone, its nine populations as
    ``obs['cell_type']``.
    """
    a = _read(path)
    return a[a.obs["batch"] == SORTED].copy()


def _protocol_file(path: Path, name: str, seed: int) -> Task:
    return protocol_split(_read(path), "cell_type", seed=seed, name=name)


def read_pbmc68k():
    """Scanpy's pbmc68k_reduced: log-normalised values of 765 genes, ``obs['cell_type']``."""
    import scanpy as sc

    a = sc.datasets.pbmc68k_reduced().raw.to_adata()
    a.obs["cell_type"] = a.obs["bulk_labels"].astype(str)
    return a


def pbmc68k(seed: int) -> Task:
    """The paper's protocol on scanpy's pbmc68k_reduced (log-normalised values of 765 genes)."""
    return protocol_split(read_pbmc68k(), "cell_type", seed=seed, name="pbmc68k_protocol")


#: (file in the data directory, task name, kind, builder(path, name, seed), description)
_FILE_TASKS = [
    ("tm_facs_scfind.h5ad", "tm_kidney_to_marrow", "cross-batch", _tm,
     "Tabula Muris FACS: kidney reference, marrow query (B-lineage types novel)"),
    ("baron_mouse.h5ad", "baron_mouse1_to_mouse2", "cross-batch", _baron,
     f"pancreas, mouse 1 reference without {', '.join(BARON_HIDDEN)}; mouse 2 query"),
    ("scannotate_pbmc.h5ad", "pbmc_dropseq_to_indrops", "cross-batch", _pbmc_tech,
     "PBMC cross-technology: Drop-seq reference without B cells; inDrops query"),
    ("mca_bladder.h5ad", "mca_bladder_protocol", "protocol", _protocol_file,
     "mca_bladder: paper protocol (half the classes seen, half of each labelled)"),
    ("worm_neuron.h5ad", "worm_neuron_protocol", "protocol", _protocol_file,
     "worm_neuron: paper protocol (half the classes seen, half of each labelled)"),
    ("pbmc_sorted_vs_3k.h5ad", "pbmc_sorted_to_3k", "cross-batch", _pbmc_sorted,
     "PBMC bead-sorted populations reference, whole pbmc3k query (another donor): FCGR3A+ "
     "monocytes beside CD14+, DC and platelets novel"),
]  # fmt: skip

#: the cross-batch tasks the other way round (development suite)
_REVERSED = [
    ("tm_facs_scfind.h5ad", "tm_marrow_to_kidney", "cross-batch",
     partial(_tm, reference="Marrow"),
     "Tabula Muris FACS: marrow reference (macrophage, B lineage), kidney query"),
    ("baron_mouse.h5ad", "baron_mouse2_to_mouse1", "cross-batch",
     partial(_baron, reference="mouse2"),
     f"pancreas, mouse 2 reference without {', '.join(BARON_HIDDEN)}; mouse 1 query"),
    ("scannotate_pbmc.h5ad", "pbmc_indrops_to_dropseq", "cross-batch",
     partial(_pbmc_tech, reference="inDrops"),
     "PBMC cross-technology: inDrops reference without B cells; Drop-seq query"),
    ("pbmc_sorted_vs_3k.h5ad", "pbmc_3k_to_sorted", "cross-batch",
     partial(_pbmc_sorted, reference=PBMC3K),
     "PBMC: pbmc3k reference, bead-sorted query (Treg and the sorted CD4 helper mix novel)"),
]  # fmt: skip


def _file_specs(data_dir: str | Path | None, table: list) -> list[TaskSpec]:
    """The tasks of ``table`` whose file is in ``data_dir``."""
    if data_dir is None:
        return []
    d = Path(data_dir)
    return [
        TaskSpec(name, kind, partial(build, d / file, name), description)
        for file, name, kind, build, description in table
        if (d / file).is_file()
    ]


def reversed_tasks(data_dir: str | Path | None) -> list[TaskSpec]:
    """The cross-batch tasks of :func:`builtin_tasks` with reference and query swapped."""
    return _file_specs(data_dir, _REVERSED)


def builtin_tasks(data_dir: str | Path | None) -> list[TaskSpec]:
    """pbmc68k_reduced (ships with scanpy) plus every task whose file is in ``data_dir``."""
    specs = _file_specs(data_dir, _FILE_TASKS)
    specs.append(
        TaskSpec(
            "pbmc68k_protocol", "protocol", pbmc68k, "pbmc68k_reduced (scanpy): paper protocol"
        )
    )
    return specs
