"""The package's user-facing errors: each says what is wrong and how to fix it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class OrcaInputError(ValueError):
    """Input data or options that cannot be used, with a message saying how to fix it."""


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or infinite."""


class ConfigError(OrcaInputError):
    """An invalid option value. ``option`` is the :class:`~orca_sc.OrcaConfig` (or
    :class:`~orca_sc.DiscoveryConfig`) field, which is also the keyword of ``tl.annotate``; the
    command line reports it under its own option name (``--warmup-epochs``).
    """

    def __init__(self, option: str, value: Any, expected: str) -> None:
        self.option = option
        self.value = value
        self.expected = expected
        super().__init__(f"Invalid {option}={value!r}: expected {expected}.")


def check_input_file(path: str | Path, what: str, expected: str) -> Path:
    """``path`` as a :class:`~pathlib.Path` if it is a file this process can open; otherwise an
    :class:`OrcaInputError` that says which of the three it is (missing, a directory,
    unreadable). ``what`` names the file ("Model", "Query"); ``expected`` what to pass instead
    of a directory ("an .h5ad file").
    """
    p = Path(path)
    if p.is_dir():
        raise OrcaInputError(f"{what} path {str(p)!r} is a directory; pass {expected}.")
    if not p.is_file():
        raise OrcaInputError(f"{what} file {str(p)!r} does not exist.")
    try:
        with open(p, "rb"):
            pass
    except OSError as e:
        msg = f"Cannot open {what.lower()} file {str(p)!r}: {e.strerror or type(e).__name__}."
        raise OrcaInputError(msg) from None
    return p


def check_output_path(path: Any, what: str) -> Path | None:
    """Refuse, before any work, a path that cannot be written (``None`` passes)."""
    if path is None:
        return None
    p = Path(path)
    if str(path) == "" or p.is_dir():
        msg = f"{what} {str(path)!r} is a directory or empty; give a file name (e.g. model.pt)."
        raise OrcaInputError(msg)
    if not p.parent.is_dir():
        msg = f"{what} {str(path)!r}: the folder {str(p.parent)!r} does not exist; create it first."
        raise OrcaInputError(msg)
    return p


def check_anndata(obj: Any, what: str, *, several: bool = False) -> None:
    """Refuse anything but an :class:`anndata.AnnData` as ``what`` ("adata", "reference"), with
    the fix for what was passed instead (several AnnData, a DataFrame, an array, a path);
    ``several``: the caller also takes a list of AnnData.
    """
    import anndata as ad

    if isinstance(obj, ad.AnnData):
        return
    kind = type(obj).__name__
    if isinstance(obj, (list, tuple)):
        fix = (
            f"a {kind} of {len(obj)} objects; pass one AnnData (for several samples, "
            "orca_sc.tl.annotate([q1, q2], reference, ...) trains one model on all; or "
            "concatenate them with anndata.concat(..., label='sample') and pass "
            "batch_key='sample')"
        )
    elif kind == "DataFrame":
        fix = (
            "a pandas DataFrame; wrap it as anndata.AnnData(df) (cells as rows, gene names as "
            "columns) and put the cell types in .obs"
        )
    elif isinstance(obj, (str, Path)):
        fix = f"a path ({str(obj)!r}); read it first with anndata.read_h5ad(...)"
    elif hasattr(obj, "shape"):
        fix = f"a {kind}; wrap the matrix as anndata.AnnData(X, obs=..., var=...) with gene names"
    else:
        fix = f"a {kind}; pass an anndata.AnnData"
    expected = "an AnnData or a list of them" if several else "an AnnData"
    raise OrcaInputError(f"{what} must be {expected}, got {fix}.")


def check_copy(adata: Any, copy: bool) -> None:
    """``copy=True`` of an AnnData opened in backed mode: refused with the fix (anndata cannot
    copy a backed object to memory without a file name).
    """
    if copy and getattr(adata, "isbacked", False):
        msg = (
            "copy=True cannot copy an AnnData opened in backed mode; drop copy=True (the results "
            "are written into its in-memory obs, obsm and uns; save them with "
            "adata.write(...)) or load it first with adata.to_memory()."
        )
        raise OrcaInputError(msg)
