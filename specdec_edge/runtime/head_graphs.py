"""The sessions of a bundle's trained draft heads (EAGLE, EAGLE-3, Medusa): small graphs run on the CPU.

A head graph's inputs and outputs are listed in docs/DESIGN.md ("Trained draft heads"); the
proposers that drive them are in ``speculative/eagle.py`` and ``speculative/medusa.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specdec_edge.bundle.schema import HeadSpec
from specdec_edge.errors import BundleError
from specdec_edge.runtime.sessions import create_session
from specdec_edge.runtime.threads import DEFAULT_THREADS, CpuThreads, cpu_session_options

# The dimensions of a head graph's inputs and outputs that its manifest section fixes (None: any).
SHAPES = {
    "eagle": {
        "features": (1, None, "hidden_size"),
        "past_key": (1, None, "num_kv_heads", "head_dim"),
        "past_value": (1, None, "num_kv_heads", "head_dim"),
        "topk_ids": (None, "top_k"),
    },
    "eagle3": {
        "features": (1, None, "hidden_size"),
        "past_key": (1, None, "num_kv_heads", "head_dim"),
        "past_value": (1, None, "num_kv_heads", "head_dim"),
        "topk_ids": (None, "top_k"),
    },
    "medusa": {"hidden_states": (None, "hidden_size"), "topk_ids": ("medusa_heads", None, "top_k")},
}


class HeadGraph:
    """One head graph of a bundle in its own ONNX Runtime session, with its manifest settings."""

    def __init__(self, path: Path, section: HeadSpec, cpu: CpuThreads = DEFAULT_THREADS, method: str | None = None):
        self.session = create_session(path, cpu_session_options(cpu), "cpu")
        self.config = section.config  # the head's architecture (hidden size, heads, draft vocabulary, ...)
        self.top_k = int(section.top_k)  # candidates per row the graph returns
        self.defaults = dict(section.tree)  # tree settings the bundle was measured with
        if method in SHAPES:
            self._check(path, SHAPES[method])

    def _check(self, path: Path, shapes: dict) -> None:
        """The manifest's sizes against the graph's own, before any buffer is sized by them."""
        values = {**self.config, "top_k": self.top_k}
        ports = {p.name: p.shape for p in (*self.session.get_inputs(), *self.session.get_outputs())}
        for name, dims in shapes.items():
            want = [values.get(d) if isinstance(d, str) else d for d in dims]
            have = ports.get(name)
            if (
                have is None
                or len(have) != len(want)
                or any(isinstance(h, int) and w is not None and h != w for h, w in zip(have, want))
            ):
                raise BundleError(
                    f"{path} does not match its manifest section ({name}: graph {have}, manifest {want}); the "
                    "manifest or the graph is damaged: run `specdec-edge verify BUNDLE`, then re-copy or re-export it."
                )

    def run(self, **inputs: np.ndarray) -> list[np.ndarray]:
        return self.session.run(None, inputs)


def load_head_graphs(root: Path, heads: dict[str, HeadSpec], cpu: CpuThreads = DEFAULT_THREADS) -> dict[str, HeadGraph]:
    """``{"eagle": HeadGraph, "medusa": HeadGraph}`` for the heads a bundle's manifest lists."""
    return {m: HeadGraph(Path(root) / s.graph, s, cpu, m) for m, s in heads.items()}
