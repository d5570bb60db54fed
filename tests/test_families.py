"""The development suite's real tasks by dataset family, and the tasks of the bead-sorted PBMC
populations against pbmc3k (another donor and experiment, close T-cell subsets).
"""

import numpy as np
import pandas as pd
import pytest
from conftest import SHARED_DATA

from orca_sc.benchmark import dev_suite
from orca_sc.benchmark._suite_table import family_goals, suite_markdown, suite_table
from orca_sc.benchmark._tasks import dataset_family

SORTED = SHARED_DATA / "pbmc_sorted_vs_3k.h5ad"


def test_every_suite_task_has_its_dataset_family():
    names = [s.name for s in dev_suite(SHARED_DATA if SHARED_DATA.is_dir() else None, large=False)]
    families = {n: dataset_family(n) for n in names}
    assert "other" not in families.values()
    assert families["sim_base"] == "simulated" and families["sibling_pbmc68k"] == "pbmc68k"
    assert dataset_family("tiny_pbmc") == "PBMC Drop-seq / inDrops"
    assert dataset_family("few5_mca") == "MCA bladder"
    assert dataset_family("pbmc_3k_to_sorted") == dataset_family("sibling_pbmc_sorted")
    assert dataset_family("my_own_h5ad") == "other"


def test_family_goals_count_each_family_apart():
    runs = pd.DataFrame(
        {
            "task": ["sim_a", "sim_a", "baron_x", "baron_x", "tm_y", "tm_y"],
            "method": ["ORCA"] * 6,
            "seed": [0, 1] * 3,
            "n_query": [100] * 6,
            "novel_true": [1, 1, 2, 2, 0, 0],
            "novel_found": [1, 1, 2, 1, 0, 1],
            "novel_called": [0.95, 0.93, 0.5, 0.7, np.nan, np.nan],
            "known_called_novel": [0.01, 0.02, 0.01, 0.03, 0.2, 0.1],
            "seen_acc": [0.9] * 6,
            "novel_acc": [0.9] * 6,
            "all_acc": [0.9, 0.8, 0.7, 0.7, 0.6, 0.6],
            "seconds": [1.0] * 6,
            "error": [""] * 6,
        }
    )
    fam = family_goals(suite_table(runs)).set_index("dataset")
    assert fam.loc["simulated", "novel_called"] == "1/1"
    assert fam.loc["Baron pancreas", "novel_called"] == "0/1"
    assert fam.loc["Baron pancreas", "found_exact"] == "0/1"  # right in 1 of 2 runs
    assert fam.loc["Tabula Muris", "novel_called"] == "0/0"  # no novel type to find
    assert fam.loc["Tabula Muris", "known_called_novel"] == "0/1"
    assert fam.loc["simulated", "all_acc"] == pytest.approx(0.85)
    assert "## Per dataset family (ORCA)" in suite_markdown(runs)


@pytest.mark.skipif(not SORTED.is_file(), reason="shared data absent")
def test_sorted_pbmc_tasks_hide_what_the_other_side_lacks():
    specs = {s.name: s for s in dev_suite(SHARED_DATA, large=False, only=["pbmc_sorted", "3k"])}
    assert set(specs) == {"pbmc_sorted_to_3k", "pbmc_3k_to_sorted", "sibling_pbmc_sorted",
                          "sibling_pbmc_sorted_to_3k", "sibling_pbmc_3k_to_sorted"}  # fmt: skip
    forward = specs["pbmc_sorted_to_3k"].make(0)
    assert forward.novel == ["DC", "FCGR3A+ Mono", "Platelet"]  # FCGR3A+ beside CD14+ Mono
    assert "CD14+ Mono" in forward.seen and forward.query.n_obs == 2638
    back = specs["pbmc_3k_to_sorted"].make(0)
    assert back.novel == ["CD4+ helper T (sorted; naive+memory mix)", "Treg"]
    sib = specs["sibling_pbmc_sorted"].make(0)
    # the sibling split of the sorted populations hides T-cell subsets beside a known one
    assert sib.novel and all(" T " in t or t.endswith("T cell") for t in sib.novel)
    assert not set(sib.novel) & set(sib.seen)
    # across the pair, each way: a sibling of a known type hidden besides what one side lacks
    for name, only_there in (("sibling_pbmc_sorted_to_3k", forward.novel),
                             ("sibling_pbmc_3k_to_sorted", back.novel)):  # fmt: skip
        t = specs[name].make(0)
        assert set(only_there) < set(t.novel) and "Naive CD4 T" in t.seen
        assert "Memory CD4 T" in t.novel  # beside the naive CD4 T cells, which stay known
        assert dataset_family(name) == "PBMC sorted / pbmc3k"


def _per_task(values: dict) -> pd.DataFrame:
    """Per-task means as :func:`orca_sc.benchmark._compare._per_task` gives them."""
    rows = {t: {"novel_called": nn, "known_called_novel": kn, "all_acc": 0.8}
            for t, (nn, kn) in values.items()}  # fmt: skip
    return pd.DataFrame.from_dict(rows, orient="index")


def test_a_change_is_adopted_only_where_it_pays_with_each_family_held_out():
    from orca_sc.benchmark._compare import family_verdict

    # three real families (Baron, MCA, Tabula Muris) and a simulation, which never counts
    tasks = ["baron_mouse1_to_mouse2", "few5_mca", "tm_kidney_to_marrow", "sim_base"]
    ceiling = _per_task({t: (0.95, 0.01) for t in tasks})
    before = _per_task({t: (0.5, 0.01) for t in tasks})
    # after: Baron and MCA reach the novel goal, Tabula Muris as before, the simulation worse
    after = _per_task({**{t: (0.95, 0.01) for t in tasks[:2]},
                       tasks[2]: (0.5, 0.01), tasks[3]: (0.1, 0.5)})  # fmt: skip
    v = family_verdict(before, after, ceiling)
    assert v.adopt and "simulated" not in v.table.index and len(v.table) == 3
    assert v.table.loc["Baron pancreas", "score_after"] == 2  # both goals on the feasible task
    # a change that costs one family is not adopted, however much it lifts the others
    costs = after.copy()
    costs.loc["tm_kidney_to_marrow", "known_called_novel"] = 0.2
    assert not family_verdict(before, costs, ceiling).adopt
    # a gain on one family alone is not chosen with that family held out: not adopted
    one = before.copy()
    one.loc["baron_mouse1_to_mouse2", "novel_called"] = 0.95
    assert not family_verdict(before, one, ceiling).adopt
    # nor one that costs a task more than 2 points of all-class accuracy
    cheaper = after.copy()
    cheaper.loc["tm_kidney_to_marrow", "all_acc"] = 0.75
    assert not family_verdict(before, cheaper, ceiling).adopt
    # where the ceiling misses a goal, the task does not count for it
    hard = ceiling.copy()
    hard.loc["tm_kidney_to_marrow", "known_called_novel"] = 0.3
    assert family_verdict(before, costs, hard).adopt
    assert (
        family_verdict(before, costs, hard).table.loc["Tabula Muris", "known_called_novel_feasible"]
        == 0
    )
    # a user's own task is real data: judged as a family of its own, as `--only family:real`
    # selects it (one predicate, orca_sc.benchmark._tasks.real_family)
    mine = _per_task({"my_h5ad": (0.95, 0.01), "sim_base": (0.95, 0.01)})
    assert list(family_verdict(mine, mine, mine).table.index) == ["other"]


def _runs(values: dict, seeds=(0, 1, 2), jitter=0.0) -> pd.DataFrame:
    """Per-seed ORCA rows (``task, seed`` and the figures), each seed ``jitter`` apart."""
    rows = [{"task": t, "seed": s, "novel_called": nn + jitter * s, "known_called_novel": kn,
             "all_acc": 0.8, "seen_acc": 0.8, "novel_acc": 0.8, "novel_found": 1,
             "novel_true": 1, "seconds": 1.0, "exact": 1.0}
            for t, (nn, kn) in values.items() for s in seeds]  # fmt: skip
    return pd.DataFrame(rows)


def test_a_rule_stays_where_a_family_needs_it_and_goes_where_none_does():
    from orca_sc.benchmark._compare import rule_need

    tasks = ["baron_mouse1_to_mouse2", "few5_mca", "tm_kidney_to_marrow", "sim_base"]
    ceiling = _per_task({t: (0.95, 0.01) for t in tasks})
    with_rule = _runs({t: (0.95, 0.01) for t in tasks})
    # without it nothing real moves (the simulation, which never counts, does): it goes
    inert = with_rule.copy()
    inert.loc[inert.task == "sim_base", "novel_called"] = 0.1
    need = rule_need(with_rule, inert, ceiling)
    assert need.goes and need.needed_by == () and "simulated" not in need.table.index
    # the simulations are judged apart, as one family
    assert rule_need(with_rule, inert, ceiling, simulated=True).needed_by == ("simulated",)
    # one family loses a goal without it: that family needs it, however much the others gain
    costs = with_rule.copy()
    costs.loc[costs.task == "few5_mca", "known_called_novel"] = 0.2
    costs.loc[costs.task == "baron_mouse1_to_mouse2", "all_acc"] = 0.9
    need = rule_need(with_rule, costs, ceiling)
    assert not need.goes and need.needed_by == ("MCA bladder",)
    assert need.gains_without == ("Baron pancreas",)
    assert need.table.loc["MCA bladder", "goals_without"] == 1
    # a task more than 2 points of all-class accuracy lower without it is a need too
    lower = with_rule.copy()
    lower.loc[lower.task == "tm_kidney_to_marrow", "all_acc"] = 0.75
    assert rule_need(with_rule, lower, ceiling).needed_by == ("Tabula Muris",)
    # so is a detection figure worse beyond noise though no goal is lost (0.95 -> 0.91) ...
    worse = with_rule.copy()
    worse.loc[worse.task == "baron_mouse1_to_mouse2", "novel_called"] = 0.91
    need = rule_need(with_rule, worse, ceiling)
    assert need.needed_by == ("Baron pancreas",) and need.table["worse"].sum() == 1
    # ... but not one within two paired standard errors of the seeds' spread
    base = _runs({t: (0.5, 0.01) for t in tasks}, jitter=0.2)
    noisy = _runs({t: (0.5, 0.01) for t in tasks}, jitter=0.2)
    noisy.loc[noisy.task == "few5_mca", "novel_called"] -= [0.0, 0.1, -0.02]
    assert rule_need(base, noisy, ceiling).goes
    # read on the tasks both runs hold: an ablation run on one family's tasks judges that one
    part = rule_need(with_rule, lower[lower.task == "tm_kidney_to_marrow"], ceiling)
    assert list(part.table.index) == ["Tabula Muris"]
