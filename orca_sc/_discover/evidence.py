"""The evidence verdicts: per novel cluster, whether the data can support the call (supported by
the novelty test, too thin to tell and why, not confirmed, not tested), and the one line the log
says of the clusters the data cannot support.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._notes import Note
from ._stage import _FEW_LABELS


def novel_evidence(names: list[str], sizes: dict[str, int], similarity: dict[str, Any],
                   n_labelled: np.ndarray, test: dict[str, Any] | None,
                   n_neighbors: int) -> dict[str, list]:  # fmt: skip
    """Per novel cluster, what the data say about its call (``uns['orca']['novel_evidence']``,
    column-wise): its size, its closest known type (``similarity``:
    :meth:`OrcaModel.novel_similarity`) and that type's labelled cells (``n_labelled``, per
    known type in ``similarity['types']`` order), the novelty test's verdict (``test``: ``uns['orca']['novelty_test']``; ``None``: not
    run) and ``evidence``:

    * ``"supported"``: the novelty test finds its cells unlike the reference (a stated error rate;
      where the test's premise fails in the cluster's batch, more unlike it than that batch's
      cells labelled a known type);
    * ``"cannot tell"``: the data are too thin for a call, and ``reason`` says which part: the
      test has too few labelled cells to calibrate it, the cluster has fewer cells than the
      clustering graph's ``n_neighbors`` (it may be a fragment of a known type), or its closest
      known type has fewer than 50 labelled cells (the warm-up fits so few closely, so cells of
      the type unlike them can be called novel: the suite's few-label corners; the limit of the
      run-wide note, :mod:`orca_sc._discover._stage`);
    * ``"not confirmed"``: enough data, but the test does not find the cells unlike the reference
      (no evidence either way: it has little power for a type close to a known one);
    * ``"not tested"``: no novelty test (``novelty_folds=0``) and no shortage found.
    """
    types = [str(t) for t in similarity.get("types", [])]
    rows = dict(zip(similarity.get("clusters", []), similarity.get("similarity", []), strict=False))
    table = test.get("clusters", {}) if test else {}
    verdicts = dict(zip(table.get("cluster", []), table.get("supported", []), strict=False))
    out: dict[str, list] = {k: [] for k in ("cluster", "n_cells", "closest_type",
                                            "closest_similarity", "closest_type_labelled",
                                            "novelty_test", "evidence", "reason")}  # fmt: skip
    for name in names:
        row = np.asarray(rows.get(name, []), dtype=np.float64)
        best = int(np.argmax(row)) if row.size else -1
        closest = types[best] if best >= 0 else ""
        n_lab = int(n_labelled[best]) if best >= 0 else 0
        n = int(sizes.get(name, 0))
        verdict = str(verdicts.get(name, "not tested"))
        shortage = []
        if verdict == "cannot tell":
            shortage.append("too few labelled cells calibrate the novelty test")
        if n < n_neighbors:
            shortage.append(
                f"only {n} cells, under the {n_neighbors} neighbours of the clustering graph: "
                "maybe a fragment of a known type"
            )
        if 0 <= best and n_lab < _FEW_LABELS:
            shortage.append(f"its closest known type, {closest}, has only {n_lab} labelled cells")
        if verdict == "significant":
            evidence, reason = "supported", ""
        elif shortage:
            evidence, reason = "cannot tell", "; ".join(shortage)
        elif verdict == "not significant":
            evidence = "not confirmed"
            reason = (
                "the novelty test does not find its cells more unlike the reference than "
                "known-type cells (little power for a type close to a known one)"
            )
        else:
            evidence, reason = "not tested", "no novelty test (novelty_folds=0)"
        values = (name, n, closest, round(float(row[best]), 4) if best >= 0 else float("nan"),
                  n_lab, verdict, evidence, reason)  # fmt: skip
        for key, v in zip(out, values, strict=True):
            out[key].append(v)
    return out


def evidence_note(evidence: dict[str, list]) -> Note | None:
    """The note naming the novel clusters the data cannot support (``None``: none), with each
    one's reason in its paragraph.
    """
    reasons = evidence.get("reason")
    reasons = [""] * len(evidence["cluster"]) if reasons is None else list(reasons)
    thin = [(c, r) for c, e, r in zip(evidence["cluster"], evidence["evidence"], reasons,
                                      strict=True) if e == "cannot tell"]  # fmt: skip
    if not thin:
        return None
    names = ", ".join(c for c, _ in thin)
    return Note(
        f"Novel cluster(s) {names}: the data are too thin to tell whether they are new types "
        "(uns['orca']['novel_evidence']).",
        f"Novel cluster(s) {names}: the data are too thin to tell whether they are new types. "
        + " ".join(f"{c}: {r}." for c, r in thin if r)
        + " (uns['orca']['novel_evidence'], evidence 'cannot tell', with the reason)",
    )
