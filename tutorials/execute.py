"""Execute the tutorials and store them as paired notebooks with their outputs.

Usage (from the repository root, with ``pip install jupytext nbclient ipykernel``)::

    python tutorials/execute.py                # every tutorial
    python tutorials/execute.py scanpy_workflow

The ``.py`` files (jupytext percent format) are the source; the ``.ipynb`` files are generated
here with every output and figure. ``tests/test_tutorials.py`` runs the ``.py`` files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jupytext
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def execute(name: str) -> Path:
    src = HERE / f"{name}.py"
    nb = jupytext.read(src)
    NotebookClient(
        nb, kernel_name="python3", timeout=1800, resources={"metadata": {"path": str(HERE)}}
    ).execute()
    out = src.with_suffix(".ipynb")
    jupytext.write(nb, out)
    return out


if __name__ == "__main__":
    names = sys.argv[1:] or sorted(p.stem for p in HERE.glob("*.py") if p.stem != "execute")
    for n in names:
        print("executed:", execute(n))
