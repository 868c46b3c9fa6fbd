"""Prefill through the bundle's prefill graph: the target's prefill passes run by ONNX Runtime on
``target/prefill.onnx`` (the same weights, its 4-bit layers computing with fp32 activations:
``export/prefill_graph.py``), every other pass by the target graph, over the one KV cache.

Why: on CPUs where ONNX Runtime's int8 path for the 4-bit layers is slow per row (AVX2 without VNNI), unpacking the
blocks to fp32 once per pass and running an fp32 GEMM over hundreds of rows is faster, and it computes the prompt's
K/V as the fp32 model does (docs/lab/prefill-and-passes.md). Decode passes stay on the target graph: at a few rows
the unpacking would cost more than it saves.

Exactness is that of any other prefill runtime (``runtime/ov_prefill.py``): every call, plain or speculative,
prefills through it, so their outputs stay identical; verdicts and step costs are measured and cached with it.
Like OpenVINO's, its first pass is checked against the target graph's on the same rows (``OrtEngine.prefill_run``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import PREFILL_CHUNK, StepInputs, StepOutput
from specdec_edge.runtime.sessions import bind_cache, bind_host_outputs, check_contract, create_session
from specdec_edge.runtime.threads import CpuThreads, cpu_session_options

NAME = "fp32"  # its name among the prefill runtimes (``--prefill fp32``)
# Its passes unpack every 4-bit block once: a cost per call that only passes of many rows repay.
MIN_ROWS = 64


class GraphPrefill:
    """ONNX Runtime on the bundle's prefill graph (the session made on first use), running prefill passes into an
    engine's cache."""

    chunk = PREFILL_CHUNK
    min_rows = MIN_ROWS
    checked = False  # its first pass was checked against the target graph's (OrtEngine.check_prefiller)
    # What it computes is fixed by the bundle's bytes (checked against their sha256 at load), ONNX Runtime's version
    # and the CPU: the check passed when `--prefill auto` chose it on this device holds for every later load
    # (``prefill_choice.choose_prefill``), which then skips it. OpenVINO compiles anew in each process: checked each.
    check_holds_per_device = True
    required = False  # ``--prefill fp32``: a failure is an error, else the engine prefills with the target graph

    def __init__(self, model_path: str | Path, graph, cpu: CpuThreads):
        self.model_path, self.graph, self.cpu = Path(model_path), graph, cpu
        self.name, self.version = NAME, ort.__version__
        self.label = f"{NAME} (the bundle's prefill graph, onnxruntime {self.version})"  # reports, `info`
        self.setting = f"+{NAME}-prefill"  # device identities: verdicts and costs measured with it are kept apart
        self.session = self.binding = None
        self._cache_id: int | None = None  # the cache array whose layers are bound (the engine's, one for life)
        self._cache_values: list = []
        self._outputs: dict = {}

    def compile(self) -> None:
        """Make the session (once); a graph that does not load or keep the target's contract is a ``SpecdecError``."""
        if self.session is not None:
            return
        if not self.model_path.is_file():
            raise SpecdecError(
                f"the bundle's prefill graph {self.model_path} is missing; re-copy or re-export the bundle, or "
                "prefill with the target graph (--prefill onnxruntime)."
            )
        session = create_session(self.model_path, cpu_session_options(self.cpu), "cpu")
        check_contract(session, self.graph, self.model_path)
        self.session, self.binding = session, session.io_binding()

    def _bind_cache(self, cache: np.ndarray) -> None:
        if self._cache_id == id(cache):
            return
        self._cache_values = bind_cache(self.binding, self.graph.cache, cache)  # kept alive: they bind its memory
        self._cache_id = id(cache)

    def run(self, cache: np.ndarray, past: int, step: StepInputs) -> StepOutput:
        """One pass of ``step`` after ``past`` committed slots of ``cache`` (the engine's): the new K/V land in
        slots past..past+S-1, in place, as a target-graph pass writes them."""
        self.compile()
        self._bind_cache(cache)
        seq = step.ids.shape[1]
        self.binding.bind_cpu_input("input_ids", step.ids)
        self.binding.bind_cpu_input("position_ids", step.positions)
        self.binding.bind_cpu_input("attention_bias", step.bias)
        keep = np.array([step.keep], dtype=np.int64)  # alive through the run: the binding may read its memory then
        self.binding.bind_cpu_input("logits_to_keep", keep)
        logits, hidden, layers = bind_host_outputs(self.binding, self._outputs, self.graph, seq, step.keep)
        self.session.run_with_iobinding(self.binding)
        return StepOutput(
            logits[0, : step.keep],
            None if hidden is None else hidden[0, :seq],
            None if layers is None else layers[0, :seq],
        )


def open_graph_prefill(root: Path, graph, cpu: CpuThreads) -> GraphPrefill | None:
    """The prefill-graph runtime of the target ``graph`` of the bundle at ``root``, or None where it has none."""
    if not graph.prefill_path:
        return None
    return GraphPrefill(Path(root) / graph.prefill_path, graph, cpu)
