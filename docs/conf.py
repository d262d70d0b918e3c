"""Sphinx configuration of the guide: Markdown pages through myst-parser.

Build (CI does, warnings as errors): sphinx-build -W --keep-going -b html docs docs/_build/html
"""

project = "pytest-moe-parity"
author = "pytest-moe-parity contributors"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
# `[text](page.md#a-heading)` links are checked against the headings (level 1 to 3)
myst_heading_anchors = 3
html_theme = "alabaster"
html_title = "pytest-moe-parity"
