"""What every ``orca-sc`` command shares: one-line errors with their exit codes, logging on
stderr, reading input files, and output files committed together.

Exit codes: 0 success; 2 bad input or usage (:class:`~orca_sc.OrcaInputError`, click's usage
errors), one ``Error: ...`` line; 1 a failed run that is not the input's fault (training
diverged, a download failed), one line; 1 any other exception, which is a bug of orca_sc: one
line asking to report it, the traceback with ``orca-sc --debug``; 130 interrupted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

logger = logging.getLogger("orca_sc")

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class CliError(click.ClickException):
    """A user error: printed as one ``Error: ...`` line on stderr, exit code 2."""

    exit_code = EXIT_BAD_INPUT


def _usage_in_one_line(parse, ctx: click.Context, args: list[str], command: str) -> list[str]:
    """``parse(ctx, args)`` with click's usage errors turned into one ``Error:`` line."""
    try:
        return parse(ctx, args)
    except click.UsageError as e:
        if ctx.resilient_parsing:
            raise
        raise CliError(f"{e.format_message()} See '{command} --help'.") from None


class Command(click.Command):
    """Usage errors (missing argument, bad option value) on one line, like every other error."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return _usage_in_one_line(super().parse_args, ctx, args, f"orca-sc {ctx.info_name}")


class Group(click.Group):
    command_class = Command

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["orca_argv"] = list(args)  # the command line, for a saved model's card
        return _usage_in_one_line(super().parse_args, ctx, args, "orca-sc")

    def resolve_command(self, ctx: click.Context, args: list[str]):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as e:
            raise CliError(f"{e.format_message()} See 'orca-sc --help'.") from None


# ------------------------------------------------------------------------------------- errors
EXIT_FAILED = 1


class InternalError(click.ClickException):
    """An exception that is not the user's input: a bug of orca_sc (exit 1, one line)."""

    exit_code = EXIT_FAILED


@contextmanager
def errors(ctx: click.Context):
    """One line on stderr for every error, with its exit code (see the module docstring);
    ``orca-sc --debug`` re-raises instead, with the full traceback.
    """
    debug = ctx.find_root().params.get("debug", False)
    try:
        yield
    except click.ClickException:
        raise
    except KeyboardInterrupt:
        click.echo("Interrupted; no output was written.", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as e:
        if debug:
            raise
        from ._errors import ConfigError, OrcaInputError, TrainingDivergedError
        from .datasets._download import DownloadError

        if isinstance(e, ConfigError):
            raise CliError(option_message(ctx, e)) from None
        if isinstance(e, OrcaInputError):
            raise CliError(one_line(e)) from None
        if isinstance(e, (TrainingDivergedError, DownloadError)):  # failed runs, not bugs
            raise click.ClickException(one_line(e)) from None
        msg = (
            f"internal error ({type(e).__name__}: {one_line(e)}). This is a bug in orca_sc, not "
            "in your input; please report it with the traceback that 'orca-sc --debug ...' prints."
        )
        raise InternalError(msg) from None


def rank() -> int:
    """The rank of this process under ``torchrun`` (0 otherwise)."""
    return int(os.environ.get("RANK", "0"))


@contextmanager
def reported_by_rank0():
    """Under ``torchrun`` only rank 0 reports an error (the others exit with the same status,
    silently): every rank meets the same error.
    """
    try:
        yield
    except click.ClickException as e:
        if rank() != 0:
            sys.exit(e.exit_code)
        raise


def option_message(ctx: click.Context, e: Any) -> str:
    """A :class:`~orca_sc._errors.ConfigError` in the command's own terms: the field and any
    other field it names become the command-line options (``warmup_epochs=5`` -> ``--warmup-epochs
    5``).
    """
    flags = {
        p.name: p.opts[-1] for p in ctx.command.params if isinstance(p, click.Option) and p.name
    }

    def cli(text: str) -> str:
        for name, flag in flags.items():
            text = re.sub(rf"\b{name}=(\S+?)\b", rf"{flag} \1", text)
        return text

    value = e.value if isinstance(e.value, (int, float, str)) else repr(e.value)
    name = flags.get(e.option)
    if name is None:
        return one_line(e)
    return " ".join(f"Invalid {name} {value}: expected {cli(e.expected)}.".split())


def one_line(e: BaseException) -> str:
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(str(msg).split())  # always one line


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


@contextmanager
def held_notes():
    """The run's notes kept out of the log (the caller prints them with the result): the
    warnings of ``orca_sc._model``, which logs every note of a run in one place.
    """
    notes_logger, hold = logging.getLogger("orca_sc._model"), _BelowWarning()
    notes_logger.addFilter(hold)
    try:
        yield
    finally:
        notes_logger.removeFilter(hold)


@contextmanager
def cli_logging(quiet: bool, silent: bool = False):
    """Log and warn on stderr as single lines; ``quiet`` keeps only warnings and errors,
    ``silent`` (the ranks other than 0 under torchrun) only errors.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    old_level, old_propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.ERROR if silent else logging.WARNING if quiet else logging.INFO)
    # once: a library that configures the root logger (CellTypist does) would print it again
    logger.propagate = False

    def show(message, category, filename, lineno, file=None, line=None):
        click.echo(f"Warning: {' '.join(str(message).split())}", err=True)

    try:
        with warnings.catch_warnings():  # restores the filters and showwarning on exit
            # orca_sc's own warnings are for the user; third-party notices are noise here
            warnings.simplefilter("ignore")
            if not silent:
                warnings.filterwarnings("default", category=UserWarning, module=r"orca_sc(\.|$)")
            warnings.showwarning = show
            yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate


def read_h5ad(path: str, what: str, on_disk: bool = False):
    import anndata as ad

    from ._errors import check_input_file

    if on_disk:
        from ._io import read_lazy

        return read_lazy(path, what)  # its OrcaInputError is reported like any other

    p = check_input_file(path, what, "an .h5ad file")
    try:
        adata = ad.read_h5ad(p)
    except Exception as e:  # noqa: BLE001 - any failure to parse means an unusable file
        msg = (
            f"Cannot read {what} file {path!r} as h5ad ({type(e).__name__}); it is not an AnnData "
            ".h5ad file or it is truncated/corrupt. Re-export it with adata.write_h5ad()."
        )
        raise CliError(msg) from None
    return adata


class Outputs:
    """Output files, checked before any work and committed together (temp file + rename)."""

    def __init__(self, overwrite: bool, inputs: list[str]) -> None:
        self.overwrite = overwrite
        self.inputs = {Path(p).resolve() for p in inputs}
        self.pending: list[tuple[Path, Callable[[Path], None]]] = []
        self.written: list[tuple[Path, Path]] = []  # staged: written by the caller
        self.claimed: dict[Path, str] = {}

    def claim(self, path: str | Path, what: str) -> Path:
        if not str(path).strip():
            raise CliError(f"{what} path is empty; give a file name or leave the option out.")
        p = Path(path)
        full = p.resolve()
        if full in self.claimed:
            other = self.claimed[full]
            raise CliError(
                f"{what} and {other.lower()} are the same file {str(p)!r}; give each its own path."
            )
        if full in self.inputs:
            raise CliError(
                f"{what} {str(p)!r} is one of the input files; inputs are never modified. Choose another path."
            )
        if p.is_dir():
            raise CliError(f"{what} {str(p)!r} is a directory; give a file name.")
        if p.exists() and not self.overwrite:
            raise CliError(
                f"{what} {str(p)!r} already exists; pass --overwrite to replace it or choose another path."
            )
        parent = p.parent  # Path("x.h5ad").parent is Path(".")
        if not parent.is_dir():
            raise CliError(
                f"Directory {str(parent)!r} for the {what.lower()} does not exist; create it first."
            )
        if not os.access(parent, os.W_OK | os.X_OK):
            raise CliError(
                f"Directory {str(parent)!r} is not writable; choose another location for the {what.lower()}."
            )
        self.claimed[full] = what
        return p

    def add(self, path: Path, write: Callable[[Path], None]) -> None:
        """Write ``path`` at :meth:`commit` with ``write(temporary path)``."""
        self.pending.append((path, write))

    def staged(self, path: Path | None) -> Path | None:
        """A temporary path that the caller writes now and :meth:`commit` renames to ``path``
        (removed by :meth:`discard` or a failed commit).
        """
        if path is None:
            return None
        tmp = self._temp(path)
        self.written.append((tmp, path))
        return tmp

    def commit(self) -> None:
        temps = list(self.written)
        try:
            for path, write in self.pending:
                tmp = self._temp(path)
                temps.append((tmp, path))
                write(tmp)
            for tmp, path in temps:
                os.replace(tmp, path)
        finally:
            self.written = []
            self._remove(temps)

    def discard(self) -> None:
        """Remove what was staged (an error before :meth:`commit`)."""
        self._remove(self.written)
        self.written = []

    @staticmethod
    def _temp(path: Path) -> Path:
        return path.with_name(f".{path.stem}.orca-tmp-{os.getpid()}{path.suffix}")

    @staticmethod
    def _remove(temps: list[tuple[Path, Path]]) -> None:
        for tmp, _ in temps:
            if tmp.exists():
                tmp.unlink()


def write_json(obj: Any) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_text(json.dumps(obj, indent=2, default=json_default) + "\n")

    return write


def json_default(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)
