"""One colour per label across every plot: known types keep the colour of their place among the
reference's classes (so a type has the same colour in every run on that reference, whatever the
query holds), novel clusters a saturated palette of their own. Stored as scanpy stores
``*_colors``: ``uns['{key}_label_colors']``, aligned with the categories of ``obs['{key}_label']``.
"""

from __future__ import annotations

from collections.abc import Sequence

#: known types: matplotlib's tab20c / tab20b hues, lighter shades first (muted, so that novel
#: clusters stand out)
KNOWN = (
    "#6baed6", "#fd8d3c", "#74c476", "#9e9ac8", "#5254a3", "#8ca252", "#bd9e39", "#ad494a",
    "#a55194", "#9ecae1", "#fdae6b", "#a1d99b", "#bcbddc", "#6b6ecf", "#b5cf6b", "#e7ba52",
    "#d6616b", "#ce6dbd", "#3182bd", "#e6550d", "#31a354", "#756bb1", "#393b79", "#637939",
    "#8c6d31", "#843c39", "#7b4173", "#c6dbef", "#fdd0a2", "#c7e9c0", "#dadaeb", "#9c9ede",
    "#cedb9c", "#e7cb94", "#e7969c", "#de9ed6",
)  # fmt: skip
#: novel clusters: tab10 and Set1, saturated (grey and yellow left out)
NOVEL = (
    "#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#e377c2", "#17becf", "#8c564b",
    "#bcbd22", "#e41a1c", "#377eb8", "#4daf4a", "#984ea3", "#ff7f00", "#a65628", "#f781bf",
)  # fmt: skip
#: categories of another column that are neither a known type nor a novel cluster (e.g. the true
#: names of hidden types): dark, earthy tones unlike both palettes
OTHER = (
    "#4d4d4d", "#7f3b08", "#2d004b", "#00441b", "#67001f", "#053061", "#8e0152", "#543005",
    "#40004b", "#003c30",
)  # fmt: skip


def label_colors(
    categories: Sequence[str], classes: Sequence[str], novel_names: Sequence[str]
) -> list[str]:
    """The colour of each label category: a known type by its index among ``classes`` (the
    reference's), a novel cluster (``novel_k``) by its number, anything else from :data:`OTHER`.
    """
    colors = {n: NOVEL[(_number(n) - 1) % len(NOVEL)] for n in novel_names}
    colors.update({c: KNOWN[i % len(KNOWN)] for i, c in enumerate(classes)})  # known first
    return colors_of(categories, colors)


def colors_of(categories: Sequence[str], colors: dict[str, str]) -> list[str]:
    """The colour of each category from ``colors``; a category it lacks gets the next colour of
    :data:`OTHER`.
    """
    out, n_other = [], 0
    for c in map(str, categories):
        if c in colors:
            out.append(colors[c])
        else:
            out.append(OTHER[n_other % len(OTHER)])
            n_other += 1
    return out


def _number(name: str) -> int:
    """``k`` of a novel cluster's name ``novel_k`` (1 for any other name)."""
    tail = name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() and int(tail) > 0 else 1
