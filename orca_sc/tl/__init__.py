"""Tools: ``annotate`` (train and label), ``predict`` (apply a trained model), ``summarize``."""

from ._annotate import annotate
from ._predict import predict
from ._summary import summarize

__all__ = ["annotate", "predict", "summarize"]
