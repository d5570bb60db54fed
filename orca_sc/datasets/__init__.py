"""Datasets: a realistic single-cell count simulator."""

from ._simulate import simulate

__all__ = ["simulate"]
