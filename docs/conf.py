"""Sphinx configuration of the orca_sc documentation site.

Build it offline, warnings as errors (as CI does)::

    pip install -e ".[docs]"
    sphinx-build -W --keep-going -b html docs docs/_build/html

The API reference is generated from the numpydoc docstrings (autosummary + napoleon), the
tutorials are the executed notebooks rendered with their stored outputs (never run here), and
the command line's help comes from the click commands themselves.
"""

from __future__ import annotations

from importlib.metadata import version as _version

project = "orca_sc"
author = "orca_sc developers"
copyright = "2026, orca_sc developers"  # noqa: A001 - Sphinx's name
release = _version("orca_sc")
version = release

extensions = [
    "myst_nb",  # Markdown (MyST) pages and the tutorials' executed notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # numpydoc-style sections
    "sphinx_click",
    "sphinx_copybutton",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
templates_path = ["_templates"]
exclude_patterns = [
    "_build",
    "**/.ipynb_checkpoints",
    # the tutorials folder links the repository's own: its sources and runner are not pages
    "tutorials/*.py",
]

# notebooks are rendered with the outputs they were stored with; the build runs nothing
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3

autosummary_generate = True
autodoc_default_options = {"members": True, "inherited-members": False, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autoclass_content = "class"
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_use_param = True

html_theme = "sphinx_book_theme"
html_title = f"orca_sc {release}"
html_theme_options = {
    "repository_url": "https://github.com/orca-sc/orca_sc",
    "use_repository_button": False,
    "show_toc_level": 2,
}
html_static_path: list[str] = []
