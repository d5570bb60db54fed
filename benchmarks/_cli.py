"""What the benchmark scripts share: the task options and writing a report."""

from __future__ import annotations

import argparse
from pathlib import Path

#: the shared real data beside the checkout (``../shared/data``)
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def task_parser(
    doc: str | None, out: str, seeds: tuple[int, ...] = (0,)
) -> argparse.ArgumentParser:
    """A parser with ``--data``, ``--seeds``, ``--only`` (tasks whose name contains one) and
    ``--out`` (default ``out``); scripts add their own options.
    """
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(seeds))
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--out", type=Path, default=Path(out))
    return ap


def write_report(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (its folder made if need be) and print it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
