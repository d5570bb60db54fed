"""Tools: ``annotate``."""

from ._annotate import annotate

__all__ = ["annotate"]
