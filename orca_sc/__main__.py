"""``python -m orca_sc``: the ``orca-sc`` command line."""

from .cli import main

main(prog_name="orca-sc")
