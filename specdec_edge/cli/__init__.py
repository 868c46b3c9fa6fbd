"""The `specdec-edge` command line: thin click commands over the public API (``commands``: the group and the
export-side commands; ``run``: chat and generate; ``bench``; ``serve``; ``info``'s summary and rendering;
``demo``; ``options``: the shared -k and -o options). ``main`` is the entry point."""

from specdec_edge.cli.commands import main

__all__ = ["main"]
