"""The ``orca-sc`` command line (a thin shell over the Python API)."""

from __future__ import annotations

import click

from . import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="orca-sc")
def main() -> None:
    """Open-world cell-type annotation with ORCA."""


if __name__ == "__main__":  # pragma: no cover
    main()
