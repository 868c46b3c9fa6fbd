"""The sessions of a bundle's trained draft heads (EAGLE, Medusa): small graphs run on the CPU.

A head graph's inputs and outputs are listed in docs/DESIGN.md ("Trained draft heads"); the
proposers that drive them are in ``speculative/eagle.py`` and ``speculative/medusa.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specdec_edge.runtime.sessions import create_session
from specdec_edge.runtime.threads import DEFAULT_THREADS, CpuThreads, cpu_session_options


class HeadGraph:
    """One head graph of a bundle in its own ONNX Runtime session, with its manifest settings."""

    def __init__(self, path: Path, section: dict, cpu: CpuThreads = DEFAULT_THREADS):
        self.session = create_session(path, cpu_session_options(cpu), "cpu")
        self.config = section["config"]  # the head's architecture (hidden size, heads, draft vocabulary, ...)
        self.top_k = int(section["top_k"])  # candidates per row the graph returns
        self.defaults = dict(section.get("tree", {}))  # tree settings the bundle was measured with

    def run(self, **inputs: np.ndarray) -> list[np.ndarray]:
        return self.session.run(None, inputs)


def load_head_graphs(root: Path, heads: dict | None, cpu: CpuThreads = DEFAULT_THREADS) -> dict[str, HeadGraph]:
    """``{"eagle": HeadGraph, "medusa": HeadGraph}`` for the heads a bundle's manifest lists."""
    return {m: HeadGraph(Path(root) / s["graph"], s, cpu) for m, s in (heads or {}).items() if m != "default"}
