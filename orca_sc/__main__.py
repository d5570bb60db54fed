"""``python -m orca_sc``: run the built-in example."""

from ._demo import main

main()
