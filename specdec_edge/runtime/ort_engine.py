"""The ``cpu`` backend: one decoder graph in ONNX Runtime on the CPU, with an in-place KV cache.

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

import numpy as np

from specdec_edge.bundle.schema import GraphSpec
from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import PREFILL_CHUNK, CachedEngine, StepInputs, StepOutput, pad_step
from specdec_edge.runtime.chain_inputs import ChainInputs
from specdec_edge.runtime.ov_prefill import check_against
from specdec_edge.runtime.sessions import (
    attention_rows,
    bind_cache,
    bind_host_outputs,
    check_contract,
    create_session,
)
from specdec_edge.runtime.threads import DEFAULT_THREADS, CpuThreads, cpu_session_options


class OrtEngine(CachedEngine):
    """Runs one bundle graph with a fixed-capacity in-place KV cache (batch 1)."""

    def __init__(
        self,
        model_path: str,
        graph: GraphSpec,
        *,
        provider: str = "cpu",
        cpu: CpuThreads = DEFAULT_THREADS,
        capacity: int | None = None,
    ):
        self.graph = graph
        self.session = create_session(model_path, cpu_session_options(cpu), provider)
        check_contract(self.session, graph, model_path)
        self.attention_rows = attention_rows(self.session)
        spec = graph.cache
        # Passes narrower than this are padded (the export's verdict, if the spec has one yet; runtime/verdicts.py
        # applies the device's); the slot a 2-row padding writes past the last real token is kept free.
        self.min_width = max(1, graph.verdict.min_pass_width if graph.verdict else 1)
        self.capacity = min(capacity or spec.capacity, spec.capacity - 1)
        dtype = np.float16 if spec.dtype == "float16" else np.float32
        # (layers, K/V, batch, kv_heads, capacity, head_dim); the graph's buffers keep the exported capacity.
        self.cache = np.zeros((spec.num_layers, 2, 1, spec.num_kv_heads, spec.capacity, spec.head_dim), dtype)
        self.length = 0
        self.binding = self.session.io_binding()
        self._out_buffers: dict = {}
        self._bound: tuple | None = None  # ((seq, keep), the host outputs bound for them): kept bound while they repeat
        self._keep_values: dict = {}  # keep -> its int64 [1] input
        self._keep_bound: int | None = None  # the keep whose input is bound now
        self._chains = ChainInputs(spec.capacity)  # reused inputs of decode and chain-verify passes
        self._chain_bound: int | None = None  # the width whose ids/positions buffers are bound now, or None
        self._cache_values = bind_cache(self.binding, spec, self.cache)  # kept alive: they bind the numpy memory

    def run(
        self,
        input_ids,
        position_ids: np.ndarray | None = None,
        attention_bias: np.ndarray | None = None,
        logits_to_keep: int | None = None,
    ) -> StepOutput:
        """Compute S new tokens after the committed cache; their K/V land in slots length..length+S-1.

        Logits come back for the last ``logits_to_keep`` new tokens (default: all S). A pass narrower
        than ``min_width`` runs padded to it (``runtime.base.pad_step``), so every token goes through
        the same kernels whether it is decoded alone or verified among draft tokens.
        """
        step, seq, keep = self._inputs(input_ids, position_ids, attention_bias, logits_to_keep)
        self.binding.bind_cpu_input("attention_bias", step.bias)
        if step.keep != self._keep_bound:  # decoding keeps one count: bound while it repeats
            self._keep_values.setdefault(step.keep, np.array([step.keep], dtype=np.int64))
            self.binding.bind_cpu_input("logits_to_keep", self._keep_values[step.keep])
            self._keep_bound = step.keep
        shape = (step.ids.shape[1], step.keep)
        if self._bound is None or self._bound[0] != shape:  # decoding repeats one shape: its outputs stay bound
            self._bound = shape, bind_host_outputs(self.binding, self._out_buffers, self.graph, *shape)
        logits, hidden, layers = self._bound[1]
        self.session.run_with_iobinding(self.binding)
        return StepOutput(
            logits[0, :keep],
            None if hidden is None else hidden[0, :seq],
            None if layers is None else layers[0, :seq],
        )

    # Chains up to this wide (decode steps, verified drafts) take their inputs from reused buffers (``_inputs``).
    CHAIN_BUFFER_ROWS = 16

    def _inputs(self, input_ids, position_ids, attention_bias, logits_to_keep) -> tuple[StepInputs, int, int]:
        """The pass's inputs padded to ``min_width`` rows, its real rows and real logits rows; ids and positions
        bound. A causal chain up to ``CHAIN_BUFFER_ROWS`` wide is written into reused buffers (``ChainInputs``,
        bound once per width); other passes (trees, prefill chunks, a full cache) are built by ``step_inputs``."""
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        seq, past = len(ids), self.length
        width = max(seq, self.min_width)
        chain = position_ids is None and attention_bias is None and 0 < seq and width <= self.CHAIN_BUFFER_ROWS
        if not chain or past + seq > self.capacity:
            step = self.step_inputs(ids, position_ids, attention_bias, logits_to_keep)
            keep = step.keep
            if seq < self.min_width:
                step = pad_step(step, self.min_width, past)
            self.binding.bind_cpu_input("input_ids", step.ids)
            self.binding.bind_cpu_input("position_ids", step.positions)
            self._chain_bound = None
            return step, seq, keep
        keep = seq if logits_to_keep is None else max(1, min(int(logits_to_keep), seq))
        self._ran = (past, ids)  # what ``step_inputs`` records for ``commit``
        step = self._chains.fill(ids, past, width, keep)
        if self._chain_bound != width:
            self.binding.bind_cpu_input("input_ids", step.ids)
            self.binding.bind_cpu_input("position_ids", step.positions)
            self._chain_bound = width
        return step, seq, keep

    # Another runtime for prefill passes (``runtime/ov_prefill.py``; ``api/engines.py`` attaches it), or None.
    prefiller = None

    @property
    def prefill_chunk(self) -> int:
        return PREFILL_CHUNK if self.prefiller is None else self.prefiller.chunk

    def prefill_run(self, input_ids, logits_to_keep: int | None = None) -> StepOutput:
        """A prefill pass: by the attached ``prefiller`` into this cache where it has ``min_rows`` rows or more,
        else ``run``. A prefiller that cannot compile the graph (``prefill`` "auto") is dropped at its first pass,
        before it wrote anything: every pass from then on runs here."""
        rows = np.asarray(input_ids).size
        if self.prefiller is None or rows < self.prefiller.min_rows:
            return self.run(input_ids, logits_to_keep=logits_to_keep)
        try:  # the first pass compiles it (once), and checks it unless a cached choice vouches for it
            if not self.prefiller.checked:
                return self.check_prefiller(input_ids, logits_to_keep)
            self.prefiller.compile()
        except SpecdecError:
            if self.prefiller.required:
                raise
            self.prefiller = None
            return self.run(input_ids, logits_to_keep=logits_to_keep)
        step = self.step_inputs(input_ids, None, None, logits_to_keep)
        return self.prefiller.run(self.cache, self.length, step)

    def check_prefiller(self, input_ids, logits_to_keep) -> StepOutput:
        """The prefiller's first pass against this engine's on the same rows (``ov_prefill.check_against``); both
        write only the uncommitted slots the pass is for. Returns the prefiller's pass, whose K/V the slots now hold:
        the pass that was asked for (not run a second time)."""
        self.prefiller.compile()
        self.run(input_ids, logits_to_keep=logits_to_keep)
        rows = slice(self.length, self.length + np.asarray(input_ids).size)
        want = self.cache[..., rows, :].copy()
        out = self.prefiller.run(self.cache, self.length, self.step_inputs(input_ids, None, None, logits_to_keep))
        who = "OpenVINO's prefill" if self.prefiller.name == "openvino" else "the prefill graph"
        check_against(self.cache[..., rows, :], want, who)
        self.prefiller.checked = True
        return out

    def _compact(self, path: np.ndarray) -> None:
        start, n = self.length, len(path)
        # Fancy indexing copies the source first, so overlapping moves are safe.
        self.cache[..., start : start + n, :] = self.cache[..., start + path, :]
