"""An engine over one decoder graph in ONNX Runtime, with an in-place KV cache.

The cache is a single numpy array ``[layers, 2, batch, kv_heads, capacity, head_dim]``.
Each layer's key and value slice is wrapped once as an OrtValue (no copy) and bound
both as the graph's ``past_*`` input and ``present_*`` output, so the graph writes
new K/V in place. The valid length lives here, on the host:

* ``run(ids)`` computes S new tokens over the first ``length`` cache slots and writes
  their K/V to slots ``length .. length+S-1``; ``length`` does not move.
* ``commit(n)`` keeps the first n of them (``length += n``); the rest are simply
  overwritten by the next ``run`` -- rollback copies nothing.
* ``commit(n, path=idx)`` first moves the K/V of the chosen tree nodes to consecutive
  slots (compaction after tree verification).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from specdec_edge.bundle import GraphSpec
from specdec_edge.runtime.base import CacheLength
from specdec_edge.runtime.providers import create_session



@dataclass
class StepOutput:
    logits: np.ndarray  # (N, V) float32: may be a reused buffer, valid until the engine's next run
    hidden_states: np.ndarray | None = None  # (S, H)


def session_options(threads: int | None = None, share_process: bool = False) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        opts.intra_op_num_threads = int(threads)
    opts.inter_op_num_threads = 1
    if share_process:
        # Two spinning thread pools in one process slow each other by ~50 %.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def bind_host_outputs(binding: ort.IOBinding, buffers: dict, graph: GraphSpec, seq: int, keep: int) -> tuple:
    """Bind reused host buffers for one step's logits [1, keep, V] (and hidden states [1, seq, H]) to
    ``binding``; ``buffers`` caches them per shape. ONNX Runtime writes (or copies from a device) into them."""
    if (seq, keep) not in buffers:
        if len(buffers) > 64:  # prefill chunks of many sizes: keep the cache bounded
            buffers.clear()
        hidden = np.empty((1, seq, graph.hidden_size), np.float32) if graph.has_hidden_states else None
        buffers[seq, keep] = (np.empty((1, keep, graph.vocab_size), np.float32), hidden)
    logits, hidden = buffers[seq, keep]
    binding.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
    if hidden is not None:
        binding.bind_output("hidden_states", "cpu", 0, np.float32, hidden.shape, hidden.ctypes.data)
    return logits, hidden


class OrtEngine(CacheLength):
    """Runs one bundle graph with a fixed-capacity in-place KV cache (batch 1)."""

    def __init__(
        self,
        model_path: str,
        graph: GraphSpec,
        *,
        provider: str = "cpu",
        threads: int | None = None,
        share_process: bool = False,
        capacity: int | None = None,
    ):
        self.graph = graph
        self.session = create_session(model_path, session_options(threads, share_process), provider)
        spec = graph.cache
        self.capacity = min(capacity or spec.capacity, spec.capacity)
        dtype = np.float16 if spec.dtype == "float16" else np.float32
        # (layers, K/V, batch, kv_heads, capacity, head_dim); the graph's buffers keep the exported capacity.
        self.cache = np.zeros((spec.num_layers, 2, 1, spec.num_kv_heads, spec.capacity, spec.head_dim), dtype)
        self.length = 0
        self.binding = self.session.io_binding()
        self._out_buffers: dict = {}
        self._cache_values = []
        for layer in range(spec.num_layers):
            for k, kind in enumerate(("key", "value")):
                value = ort.OrtValue.ortvalue_from_numpy(self.cache[layer, k])
                self._cache_values.append(value)  # keep alive: binds the numpy memory
                self.binding.bind_ortvalue_input(spec.input_name(layer, kind), value)
                self.binding.bind_ortvalue_output(spec.output_name(layer, kind), value)

    def run(
        self,
        input_ids,
        position_ids: np.ndarray | None = None,
        attention_bias: np.ndarray | None = None,
        logits_to_keep: int | None = None,
    ) -> StepOutput:
        """Compute S new tokens after the committed cache; their K/V land in slots length..length+S-1.

        Logits come back for the last ``logits_to_keep`` new tokens (default: all S).
        """
        step = self.step_inputs(input_ids, position_ids, attention_bias, logits_to_keep)
        seq, keep = step.ids.shape[1], step.keep
        self.binding.bind_cpu_input("input_ids", step.ids)
        self.binding.bind_cpu_input("position_ids", step.positions)
        self.binding.bind_cpu_input("attention_bias", step.bias)
        self.binding.bind_cpu_input("logits_to_keep", np.array([keep], dtype=np.int64))
        logits, hidden = bind_host_outputs(self.binding, self._out_buffers, self.graph, seq, keep)
        self.session.run_with_iobinding(self.binding)
        return StepOutput(logits[0], None if hidden is None else hidden[0])

    def _compact(self, path: np.ndarray) -> None:
        start, n = self.length, len(path)
        # Fancy indexing copies the source first, so overlapping moves are safe.
        self.cache[..., start : start + n, :] = self.cache[..., start + path, :]
