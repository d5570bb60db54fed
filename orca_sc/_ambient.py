"""The ambient state of a run, in one ``ContextVar``: what the caller set around a run that the
run's code reads without it being passed down: the observers of its phases and stages (the
benchmark's timers and traces), the command line that started it (for the model card), the
device discovery computes on and the neighbour searches it has made. Each is set for a ``with``
block by the context manager of its module (:func:`orca_sc._engine.observe`,
:func:`orca_sc._card.command_line`, :func:`orca_sc._discover.compute.on_device`,
:func:`orca_sc._discover.compute.neighbours_once`) and read with :func:`current`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Ambient:
    """``observers``: callbacks of every phase and stage; ``command``: the ``orca-sc`` command
    line (``None`` from Python); ``device``: the torch device of discovery's PCAs and neighbour
    searches (``None``: NumPy and scikit-learn); ``found``: the neighbour searches made so far,
    by set of points and count (``None``: not kept).
    """

    observers: tuple = ()
    command: str | None = None
    device: Any = None
    found: dict | None = None


_NONE = Ambient()
_AMBIENT: ContextVar[Ambient | None] = ContextVar("orca_sc_ambient", default=None)


def current() -> Ambient:
    """The ambient state where the caller is."""
    return _AMBIENT.get() or _NONE


@contextmanager
def ambient(**changes: Any) -> Iterator[Ambient]:
    """For the ``with`` block, the ambient state with ``changes``; the one before after it."""
    token = _AMBIENT.set(replace(current(), **changes))
    try:
        yield current()
    finally:
        _AMBIENT.reset(token)
