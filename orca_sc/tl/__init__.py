"""Tools: ``annotate`` (train and label), ``predict`` (apply a trained model), ``summarize``
(what was found) and ``report`` (the run as one HTML page).
"""

from ._annotate import annotate
from ._predict import predict
from ._report import report
from ._summary import summarize

__all__ = ["annotate", "predict", "report", "summarize"]
