"""Opening AnnData files without loading their expression matrix (for data larger than memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._errors import OrcaInputError, check_input_file


def read_lazy(path: str | Path, what: str = "Input") -> Any:
    """Open an ``.h5ad`` file or a ``.zarr`` store with ``obs``, ``var`` and ``uns`` in memory
    and the expression matrix ``X`` left on disk: an ``.h5ad`` as
    ``anndata.read_h5ad(path, backed="r")``, a zarr store with ``X`` as anndata's on-disk
    sparse dataset (``anndata.io.sparse_dataset``). :func:`orca_sc.tl.annotate`,
    :func:`orca_sc.tl.predict` and :meth:`orca_sc.OrcaModel.predict` then read the matrix
    10,000 cells at a time and hold only the genes they use. The file is never modified.
    """
    import anndata as ad

    p = Path(path)
    if p.is_dir():
        if not ((p / ".zgroup").exists() or (p / "zarr.json").exists()):
            msg = f"{what} path {str(p)!r} is a directory but not a zarr store; pass an .h5ad file or a .zarr store."
            raise OrcaInputError(msg)
        try:
            import zarr

            group = zarr.open(str(p), mode="r")
            X = group["X"]
            if "indptr" in X:  # a sparse matrix: read on access
                X = ad.io.sparse_dataset(X)
            return ad.AnnData(
                X=X,
                obs=ad.io.read_elem(group["obs"]),
                var=ad.io.read_elem(group["var"]),
                uns=ad.io.read_elem(group["uns"]) if "uns" in group else None,
            )
        except OrcaInputError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to parse means an unusable store
            msg = (
                f"Cannot read {what.lower()} store {str(p)!r} as AnnData zarr ({type(e).__name__}); "
                "write it with adata.write_zarr()."
            )
            raise OrcaInputError(msg) from None
    p = check_input_file(p, what, "an .h5ad file or a .zarr store")
    try:
        return ad.read_h5ad(p, backed="r")
    except Exception as e:  # noqa: BLE001
        msg = (
            f"Cannot read {what.lower()} file {str(p)!r} as h5ad ({type(e).__name__}); it is not "
            "an AnnData .h5ad file or it is truncated/corrupt. Re-export it with adata.write_h5ad()."
        )
        raise OrcaInputError(msg) from None
