"""``python -m orca_sc``: the ``orca-sc`` command line."""

from .cli import main

if __name__ == "__main__":  # not when a worker process of `orca-sc benchmark --jobs` imports it
    main(prog_name="orca-sc")
