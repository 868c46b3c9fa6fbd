"""The ``trt`` and ``trt-rtx`` backends: a prebuilt engine run through TensorRT's or TensorRT-RTX's own API.

Engines come from ``specdec-edge build-engines`` (``export/build_engines.py``); ``prebuilt.py``
finds the one that fits this GPU and library version. Device memory and copies go through
cuda-python. The libraries are imported when an engine is opened, never at module import;
where TensorRT-RTX differs (JIT kernels, runtime cache) see ``trt_libraries.py``.
"""

from __future__ import annotations

import hashlib
import weakref
from pathlib import Path

import numpy as np

from specdec_edge.bundle.schema import GraphSpec
from specdec_edge.errors import BundleError, SpecdecError
from specdec_edge.runtime.base import PAD_TO, CachedEngine, StepOutput, pad_step
from specdec_edge.runtime.prebuilt import REBUILD, cuda_check, find_prebuilt, import_cudart
from specdec_edge.runtime.trt_libraries import LIBRARIES, TENSORRT, check_rtx_engine, import_library, rtx_context
from specdec_edge.user_cache import cache_dir


def runtime_cache_path(plan: bytes) -> Path:
    """Where TensorRT-RTX keeps the kernels it compiled for one engine (the bundle may be read-only)."""
    base = cache_dir() / "trt-rtx"
    return base / f"{hashlib.sha256(plan).hexdigest()[:16]}.cache"


def _save_quietly(save) -> None:
    try:
        save()
    except (OSError, RuntimeError):  # a cache that cannot be written only costs compile time next run
        pass


class TensorRTEngine(CachedEngine):
    """One serialized TensorRT engine with device KV buffers, run with ``execute_async_v3`` (batch 1).

    The cache is two device slabs ``[layers, 2, 1, kv_heads, capacity, head_dim]`` that ping-pong
    (TensorRT does not promise in-place updates of aliased inputs/outputs). Compaction after a tree
    step is one strided ``cudaMemcpy2DAsync`` per moved slot covering every layer, K and V.
    """

    def __init__(
        self, plan_path: Path, graph: GraphSpec, sidecar: dict, pad_to: int | None = None, backend: str = "trt"
    ):
        library = LIBRARIES[backend]
        trt, self._cudart = import_library(library), import_cudart()
        cudart = self._cudart
        self.graph = graph
        cuda_check(cudart, cudart.cudaSetDevice(0))
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        plan = Path(plan_path).read_bytes()
        if library is not TENSORRT:
            check_rtx_engine(trt, self._runtime, plan, Path(plan_path).name, REBUILD)
        self._engine = self._runtime.deserialize_cuda_engine(plan)
        if self._engine is None:
            raise BundleError(f"{library.title} could not deserialize {plan_path}; {REBUILD}.")
        if library is TENSORRT:
            self._context = self._engine.create_execution_context()
        else:  # kernels compile just in time; the runtime cache keeps them for the next run
            self._context, save = rtx_context(trt, self._engine, runtime_cache_path(plan))
            weakref.finalize(self, _save_quietly, save)
        self._stream = cuda_check(cudart, cudart.cudaStreamCreate())
        spec = graph.cache
        self.capacity, self.length = spec.capacity, 0
        self._max_seq = int(sidecar["profile"]["input_ids"][2][1])
        self.pad_to = min(PAD_TO if pad_to is None else pad_to, self._max_seq)
        item = 2 if spec.dtype == "float16" else 4
        self._row = spec.head_dim * item  # bytes of one slot of one head
        self._buffer_bytes = spec.num_kv_heads * spec.capacity * self._row
        self._slab_bytes = self._buffer_bytes * spec.num_layers * 2
        self._memory = []
        self._cache = self._malloc(2 * self._slab_bytes)
        top, vocab = self._max_seq, graph.vocab_size
        self._inputs = {
            "input_ids": self._malloc(8 * top),
            "position_ids": self._malloc(8 * top),
            "attention_bias": self._malloc(4 * top * spec.capacity),
        }
        self._outputs = {"logits": self._malloc(4 * top * vocab)}
        if graph.has_hidden_states:
            self._outputs["hidden_states"] = self._malloc(4 * top * graph.hidden_size)
        self._feature_width = len(graph.feature_layers) * graph.hidden_size
        if self._feature_width:
            self._outputs["layer_features"] = self._malloc(4 * top * self._feature_width)
        self._keep = np.ones(1, dtype=np.int64)
        # logits_to_keep sizes the logits, so TensorRT usually makes it a shape-value input read on the host.
        self._keep_on_host = self._engine.is_shape_inference_io("logits_to_keep")
        if not self._keep_on_host:
            self._inputs["logits_to_keep"] = self._malloc(8)
        kv = (1, spec.num_kv_heads, spec.capacity, spec.head_dim)
        for layer in range(spec.num_layers):
            for kind in ("key", "value"):
                self._context.set_input_shape(spec.input_name(layer, kind), kv)
        self._current = 0

    @classmethod
    def from_bundle(
        cls, root: Path, role: str, graph: GraphSpec, pad_to: int | None = None, backend: str = "trt"
    ) -> TensorRTEngine:
        entry = find_prebuilt(root, role, LIBRARIES[backend].engine_kind, graph, required=True)
        return cls(Path(root) / entry["file"], graph, entry["sidecar_data"], pad_to, backend)

    def _malloc(self, size: int) -> int:
        ptr = cuda_check(self._cudart, self._cudart.cudaMalloc(size))
        self._memory.append(ptr)
        return int(ptr)

    def __del__(self):
        for ptr in getattr(self, "_memory", ()):
            self._cudart.cudaFree(ptr)
        if getattr(self, "_stream", None) is not None:
            self._cudart.cudaStreamDestroy(self._stream)

    def _upload(self, name: str, array: np.ndarray) -> None:
        kind = self._cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        cuda_check(
            self._cudart,
            self._cudart.cudaMemcpyAsync(self._inputs[name], array.ctypes.data, array.nbytes, kind, self._stream),
        )
        self._context.set_input_shape(name, array.shape)
        self._context.set_tensor_address(name, self._inputs[name])

    def run(self, input_ids, position_ids=None, attention_bias=None, logits_to_keep=None) -> StepOutput:
        step = self.step_inputs(input_ids, position_ids, attention_bias, logits_to_keep)
        seq, keep = step.ids.shape[1], step.keep
        if seq > self._max_seq:
            raise SpecdecError(
                f"this step has {seq} new tokens; the engine takes at most {self._max_seq} per pass: "
                "rebuild the engine with a larger --max-verify."
            )
        width = max(self.pad_to, self.min_width)  # one shape for every pass: see ort_gpu_engine
        if seq < width <= self.capacity - self.length:
            step = pad_step(step, width, self.length)
        self._keep[0] = step.keep
        self._upload("input_ids", step.ids)
        self._upload("position_ids", step.positions)
        self._upload("attention_bias", step.bias)
        if self._keep_on_host:
            self._context.set_input_shape("logits_to_keep", self._keep.shape)
            self._context.set_tensor_address("logits_to_keep", self._keep.ctypes.data)
        else:
            self._upload("logits_to_keep", self._keep)
        spec, dst = self.graph.cache, 1 - self._current
        src_slab, dst_slab = self._cache + self._current * self._slab_bytes, self._cache + dst * self._slab_bytes
        for layer in range(spec.num_layers):
            for k, kind in enumerate(("key", "value")):
                offset = (layer * 2 + k) * self._buffer_bytes
                self._context.set_tensor_address(spec.input_name(layer, kind), src_slab + offset)
                self._context.set_tensor_address(spec.output_name(layer, kind), dst_slab + offset)
        for name, ptr in self._outputs.items():
            self._context.set_tensor_address(name, ptr)
        if not self._context.execute_async_v3(int(self._stream)):
            raise SpecdecError("engine execution failed (see the TensorRT log above); " + REBUILD + ".")
        self._current = dst
        logits = self._download("logits", (step.keep, self.vocab_size))
        hidden = None
        if self.graph.has_hidden_states:
            hidden = self._download("hidden_states", (step.ids.shape[1], self.graph.hidden_size))
        layers = None
        if self._feature_width:
            layers = self._download("layer_features", (step.ids.shape[1], self._feature_width))
        cuda_check(self._cudart, self._cudart.cudaStreamSynchronize(self._stream))
        return StepOutput(
            logits[:keep], None if hidden is None else hidden[:seq], None if layers is None else layers[:seq]
        )

    def _download(self, name: str, shape: tuple) -> np.ndarray:
        out = np.empty(shape, dtype=np.float32)
        kind = self._cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        cuda_check(
            self._cudart,
            self._cudart.cudaMemcpyAsync(out.ctypes.data, self._outputs[name], out.nbytes, kind, self._stream),
        )
        return out

    def _compact(self, path: np.ndarray) -> None:
        if np.any(np.diff(path) <= 0):
            raise SpecdecError(f"tree path {path.tolist()} is not in topological (increasing) order.")
        # Slot s of every (layer, K/V, head) row sits at base + row * capacity*row_bytes + s*row_bytes: one
        # 2D copy moves a slot everywhere. Increasing path: a destination is never a later source.
        spec, cudart = self.graph.cache, self._cudart
        base, pitch = self._cache + self._current * self._slab_bytes, spec.capacity * self._row
        height = spec.num_layers * 2 * spec.num_kv_heads
        kind = cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        for j, p in enumerate(path.tolist()):
            if p != j:
                dst, src = base + (self.length + j) * self._row, base + (self.length + p) * self._row
                cuda_check(
                    cudart, cudart.cudaMemcpy2DAsync(dst, pitch, src, pitch, self._row, height, kind, self._stream)
                )
        cuda_check(cudart, cudart.cudaStreamSynchronize(self._stream))
