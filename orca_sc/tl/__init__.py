"""Tools: ``annotate`` (train and label), ``predict`` (apply a trained model), ``summarize``
(what was found), ``report`` (the run as one HTML page) and ``RunRecord`` (the run's record,
``uns['orca']``, read back as a typed object).
"""

from .._annotation import RunRecord
from ._annotate import annotate
from ._predict import predict
from ._report import report
from ._summary import summarize

__all__ = ["RunRecord", "annotate", "predict", "report", "summarize"]
