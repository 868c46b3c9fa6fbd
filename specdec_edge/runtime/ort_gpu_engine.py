"""The ``cuda`` and ``tensorrt`` backends: ONNX Runtime's CUDA or TensorRT execution provider, KV cache on the GPU.

The whole cache is one device allocation (an OrtValue) shaped
``[slabs, layers, 2, 1, kv_heads, capacity, head_dim]``; each layer's key and value is bound
to the session through IOBinding by raw device pointer, once, for input and output. Per step
only token ids, position ids and the attention bias go to the device, and only the kept logits
(and hidden states and layer features, if the graph has them) come back, into reused host buffers.

* CUDA EP: one slab, bound as ``past_*`` *and* ``present_*``: ONNX Runtime's in-place cache
  (GroupQueryAttention share-buffer mode, or ScatterElements skipping its copy when input and
  output are the same buffer), exactly like the CPU engine.
* TensorRT EP: TensorRT does not promise in-place updates when an input and an output share
  memory, so two slabs ping-pong (read one, write the other; one IOBinding per direction, both
  bound once). That costs one cache-sized device copy per step.

Compaction after a tree step (``commit(n, path)``) runs a tiny ONNX graph on the same
provider -- Gather the chosen slots, ScatterElements them to ``length..length+n-1``, in place
on the cache slab -- so the cache never crosses to the host. ONNX Runtime's Python API has no
device-to-device slice copy, and a graph keeps it one launch for all layers. Snapshots for the
prompt cache (``snapshot``/``restore``) are two more such graphs: Gather the used slots into a
host output, ScatterElements host K/V into slots in place; only those slots cross. The graphs are
written as protobuf bytes here, so the light runtime needs no ``onnx`` package.

Padding (``pad_to``, default 32 on the GPU): every pass narrower than ``pad_to`` is padded to
that width (``runtime.base.pad_step``), so that a token's logits come out of the same kernels
whether it was decoded alone or verified among draft tokens -- GPU kernels round differently for
different shapes, which can flip near-tied greedy choices and make speculative output differ
from plain output. On a GPU a pass of 32 rows costs about what a pass of 1 row costs for models
small enough to be bound by weight reads or launches. Passes wider than ``pad_to`` (long prefill
chunks, trees over 32 nodes) run as they are. ``pad_to=0`` turns it off.

fp32 graphs run with TF32 off (ONNX Runtime's CUDA EP enables TF32 matrix products by default,
which rounds fp32 inputs to 10-bit mantissas).

CUDA graphs (``cuda_graph=True``, provider ``cuda``): a small model's decode step is bound by kernel
launches and host work, not by the GPU. ONNX Runtime can capture one step's kernels as a CUDA graph
and replay it (``enable_cuda_graph``), but only while every input and output keeps its shape and
device address. So every pass of at most ``pad_to`` rows runs as one fixed-shape pass: padded to
``pad_to`` rows, its attention bias widened to the whole cache capacity (``base.widen_bias``; the
graph reads the valid length from the bias's values, ``GraphSpec.capacity_bias``), all ``pad_to``
logits rows kept, and its inputs and outputs in device buffers bound once (``_FixedPass``); the host
only copies new values into them. Wider passes (prefill chunks, trees over ``pad_to`` nodes, the
last slots of the cache) run as before, outside the graph (``gpu_graph_id`` -1). ``GpuOptions(fixed_shape=True)``
runs the same fixed-shape passes without a graph, on any device (the CPU tests).

``device="cpu"`` runs the same code on the CPU (tests; no GPU needed).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from specdec_edge.bundle.schema import GraphSpec
from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import DEFAULT_GPU, PAD_TO, CachedEngine, GpuOptions, StepOutput, pad_step, widen_bias
from specdec_edge.runtime.prebuilt import engine_cache_dir, find_prebuilt
from specdec_edge.runtime.sessions import bind_host_outputs, create_session, require_provider, session_options
from specdec_edge.runtime.trt_profiles import tensorrt_ep_options

ONNX_FLOAT, ONNX_INT64, ONNX_FLOAT16 = 1, 7, 10


# ---- a protobuf writer for the tiny compaction graph (field numbers from onnx.proto)
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, value) -> bytes:
    if isinstance(value, int):
        return _varint(num << 3) + _varint(value)
    data = value.encode() if isinstance(value, str) else value
    return _varint(num << 3 | 2) + _varint(len(data)) + data


def _tensor_info(name: str, elem_type: int, dims: list[str]) -> bytes:
    shape = b"".join(_field(1, _field(2, d)) for d in dims)  # TensorShapeProto.dim{dim_param}
    tensor = _field(1, elem_type) + _field(2, shape)  # TypeProto.Tensor
    return _field(1, name) + _field(2, _field(1, tensor))  # ValueInfoProto{name, type{tensor_type}}


def _node(op: str, inputs: list[str], outputs: list[str], **ints) -> bytes:
    attrs = b"".join(_field(5, _field(1, k) + _field(3, v) + _field(20, 2)) for k, v in ints.items())  # INT attrs
    return b"".join(_field(1, i) for i in inputs) + b"".join(_field(2, o) for o in outputs) + _field(4, op) + attrs


CACHE_DIMS = ["layers", "kv", "batch", "heads", "capacity", "head_dim"]


def _model(name: str, nodes: list[bytes], inputs: list[bytes], outputs: list[bytes]) -> bytes:
    graph = b"".join(_field(1, n) for n in nodes) + _field(2, name)
    graph += b"".join(_field(11, i) for i in inputs) + b"".join(_field(12, o) for o in outputs)
    return _field(1, 8) + _field(7, graph) + _field(8, _field(1, "") + _field(2, 17))  # ir 8, opset 17


def _elem(cache_dtype: str) -> int:
    return ONNX_FLOAT16 if cache_dtype == "float16" else ONNX_FLOAT


def compaction_model(cache_dtype: str) -> bytes:
    """ONNX bytes: ``cache_out = cache`` with slots ``dst`` set to the old slots ``src`` (axis 4).

    Inputs: ``cache`` [slab shape, rank 6], ``src`` int64 [n], ``dst`` int64 [1,1,1,1,n,1].
    Bind ``cache`` and ``cache_out`` to the same memory to move K/V in place.
    """
    elem = _elem(cache_dtype)
    nodes = [
        _node("Gather", ["cache", "src"], ["moved"], axis=4),
        _node("Shape", ["moved"], ["moved_shape"]),
        _node("Expand", ["dst", "moved_shape"], ["index"]),
        _node("ScatterElements", ["cache", "index", "moved"], ["cache_out"], axis=4),
    ]
    inputs = [_tensor_info("cache", elem, CACHE_DIMS), _tensor_info("src", ONNX_INT64, ["n"])]
    inputs.append(_tensor_info("dst", ONNX_INT64, ["1", "1", "1", "1", "n", "1"]))
    return _model("kv_compact", nodes, inputs, [_tensor_info("cache_out", elem, CACHE_DIMS)])


def read_slots_model(cache_dtype: str) -> bytes:
    """ONNX bytes: ``kv`` = the slots ``src`` of ``cache`` (axis 4), for a host copy of them (a snapshot)."""
    elem = _elem(cache_dtype)
    inputs = [_tensor_info("cache", elem, CACHE_DIMS), _tensor_info("src", ONNX_INT64, ["n"])]
    out = _tensor_info("kv", elem, ["layers", "kv", "batch", "heads", "n", "head_dim"])
    return _model("kv_read", [_node("Gather", ["cache", "src"], ["kv"], axis=4)], inputs, [out])


def write_slots_model(cache_dtype: str) -> bytes:
    """ONNX bytes: ``cache_out = cache`` with slots ``dst`` set to ``kv``'s (axis 4): a snapshot restored, in place
    when ``cache`` and ``cache_out`` are bound to the same memory."""
    elem = _elem(cache_dtype)
    nodes = [
        _node("Shape", ["kv"], ["kv_shape"]),
        _node("Expand", ["dst", "kv_shape"], ["index"]),
        _node("ScatterElements", ["cache", "index", "kv"], ["cache_out"], axis=4),
    ]
    inputs = [_tensor_info("cache", elem, CACHE_DIMS), _tensor_info("dst", ONNX_INT64, ["1", "1", "1", "1", "n", "1"])]
    inputs.append(_tensor_info("kv", elem, ["layers", "kv", "batch", "heads", "n", "head_dim"]))
    return _model("kv_write", nodes, inputs, [_tensor_info("cache_out", elem, CACHE_DIMS)])


class OrtGpuEngine(CachedEngine):
    """Runs one bundle graph on ONNX Runtime's CUDA or TensorRT EP with a device-resident KV cache (batch 1)."""

    def __init__(
        self,
        model_path: str | Path,
        graph: GraphSpec,
        *,
        provider: str = "cuda",
        device: str = "cuda",
        threads: int | None = None,
        share_process: bool = False,
        provider_options: dict | None = None,
        gpu: GpuOptions = DEFAULT_GPU,
    ):
        pad_to, cuda_graph, ping_pong, fixed_shape = gpu.pad_to, gpu.cuda_graph, gpu.ping_pong, gpu.fixed_shape
        self.graph = graph
        self.device = device  # device 0 of its kind
        require_provider(provider)  # a missing onnxruntime-gpu is the first thing to fix
        if provider == "cuda":
            if graph.flavour == "ort" and graph.dtype == "fp32":
                raise SpecdecError(
                    "this bundle is an fp32 'ort' graph: ONNX Runtime's CUDA GroupQueryAttention exists in fp16 and "
                    "bf16 only, so every attention layer would run on the CPU with the cache copied back and forth. "
                    "Export with --dtype fp16 for provider 'cuda' (or --flavour portable to keep fp32)."
                )
            provider_options = {**({"use_tf32": "0"} if graph.dtype == "fp32" else {}), **(provider_options or {})}
        self.pad_to = (0 if device == "cpu" else PAD_TO) if pad_to is None else pad_to
        self._slabs = (2 if provider == "tensorrt" else 1) if ping_pong is None else (2 if ping_pong else 1)
        fixed = cuda_graph if fixed_shape is None else fixed_shape
        check_fixed_shape(graph, provider, cuda_graph, fixed, self.pad_to, self._slabs)
        if cuda_graph:
            provider_options = {**(provider_options or {}), "enable_cuda_graph": "1"}
        self.session = create_session(model_path, session_options(threads, share_process), provider, provider_options)
        small = session_options(1, True), "cpu" if provider == "cpu" else "cuda"  # the cache's own device
        self._compactor = create_session(compaction_model(graph.cache.dtype), *small)
        self._reader = create_session(read_slots_model(graph.cache.dtype), *small)
        self._writer = create_session(write_slots_model(graph.cache.dtype), *small)
        spec = graph.cache
        self.capacity = spec.capacity
        self.length = 0
        self._dtype = np.float16 if spec.dtype == "float16" else np.float32
        self._slab_shape = [spec.num_layers, 2, 1, spec.num_kv_heads, spec.capacity, spec.head_dim]
        self._buffer_shape = [1, spec.num_kv_heads, spec.capacity, spec.head_dim]
        shape = [self._slabs, *self._slab_shape]
        self.cache = ort.OrtValue.ortvalue_from_shape_and_type(shape, self._dtype, device, 0)
        self.cache.update_inplace(np.zeros(shape, self._dtype))  # slots never written stay finite
        self._buffer_bytes = int(np.prod(self._buffer_shape)) * np.dtype(self._dtype).itemsize
        self._slab_bytes = self._buffer_bytes * spec.num_layers * 2
        # binding[s]: reads slab s, writes slab (s + 1) % slabs; the current slab holds the valid cache.
        self._bindings = [self._bind_cache(s, (s + 1) % self._slabs) for s in range(self._slabs)]
        self._current = 0
        self._out_buffers: dict = {}
        self._fixed = _FixedPass(self) if fixed else None
        self._graph_id = self._no_graph = None  # run options: replay the captured graph / run outside it
        if cuda_graph:
            self._graph_id, self._no_graph = ort.RunOptions(), ort.RunOptions()
            self._graph_id.add_run_config_entry("gpu_graph_id", "1")  # 0 is ONNX Runtime's own
            self._no_graph.add_run_config_entry("gpu_graph_id", "-1")
        self.passes = self.fixed_passes = 0  # passes run, and those of them run as the fixed-shape pass

    @classmethod
    def from_bundle(
        cls,
        root: Path,
        role: str,
        graph: GraphSpec,
        *,
        provider: str,
        threads: int | None = None,
        share_process: bool = False,
        gpu: GpuOptions = DEFAULT_GPU,
    ) -> OrtGpuEngine:
        """CUDA EP over the bundle's graph; TensorRT EP over a matching prebuilt EPContext model if the
        bundle has one (``build-engines``), else over the ONNX graph with a per-user engine cache."""
        model_path, options = root / graph.path, None
        if provider == "tensorrt":
            cache_dir = engine_cache_dir(root, graph)
            options = tensorrt_ep_options(graph, cache_dir)  # refuses a non-portable graph first
            cache_dir.mkdir(parents=True, exist_ok=True)
            prebuilt = find_prebuilt(root, role, "ort-epcontext", graph)
            model_path = root / prebuilt["file"] if prebuilt else model_path
        return cls(
            model_path,
            graph,
            provider=provider,
            device="cuda",
            threads=threads,
            share_process=share_process,
            provider_options=options,
            gpu=gpu,
        )

    def _pointer(self, slab: int, layer: int, k: int) -> int:
        return self.cache.data_ptr() + slab * self._slab_bytes + (layer * 2 + k) * self._buffer_bytes

    def _bind_cache(self, src: int, dst: int) -> ort.IOBinding:
        binding = self.session.io_binding()
        spec = self.graph.cache
        for layer in range(spec.num_layers):
            for k, kind in enumerate(("key", "value")):
                buffer = (self.device, 0, self._dtype, self._buffer_shape)  # device, device id, dtype, shape
                binding.bind_input(spec.input_name(layer, kind), *buffer, self._pointer(src, layer, k))
                binding.bind_output(spec.output_name(layer, kind), *buffer, self._pointer(dst, layer, k))
        return binding

    def run(
        self,
        input_ids,
        position_ids: np.ndarray | None = None,
        attention_bias: np.ndarray | None = None,
        logits_to_keep: int | None = None,
    ) -> StepOutput:
        """Compute S new tokens after the committed cache; their K/V land in slots length..length+S-1."""
        step = self.step_inputs(input_ids, position_ids, attention_bias, logits_to_keep)
        seq, keep = step.ids.shape[1], step.keep
        self.passes += 1
        if self._fixed is not None and seq <= self.pad_to <= self.capacity - self.length:
            self.fixed_passes += 1
            logits, hidden, layers = self._fixed.run(pad_step(step, self.pad_to, self.length))
            return StepOutput(
                logits[seq - keep : seq],
                None if hidden is None else hidden[:seq],
                None if layers is None else layers[:seq],
            )
        width = max(self.pad_to, self.min_width)  # the device verdict's padding, where pad_to is off
        if seq < width <= self.capacity - self.length:
            step = pad_step(step, width, self.length)
        binding = self._bindings[self._current]
        binding.bind_cpu_input("input_ids", step.ids)
        binding.bind_cpu_input("position_ids", step.positions)
        binding.bind_cpu_input("attention_bias", step.bias)
        binding.bind_cpu_input("logits_to_keep", np.array([step.keep], dtype=np.int64))
        logits, hidden, layers = bind_host_outputs(binding, self._out_buffers, self.graph, step.ids.shape[1], step.keep)
        self.session.run_with_iobinding(binding, self._no_graph)
        self._current = (self._current + 1) % self._slabs
        return StepOutput(
            logits[0, :keep],
            None if hidden is None else hidden[0, :seq],
            None if layers is None else layers[0, :seq],
        )

    def kv_layout(self) -> tuple[tuple, np.dtype]:
        """Snapshots are host copies of the slots (``read_slots_model``), restored by ``write_slots_model``."""
        shape = self._slab_shape
        return (*shape[:4], shape[-1]), np.dtype(self._dtype)

    def _slab_binding(self, session: ort.InferenceSession, output: str | None) -> ort.IOBinding:
        """A binding of ``session`` with ``cache`` (and ``output``, the same memory) on the current slab."""
        binding = session.io_binding()
        pointer = self.cache.data_ptr() + self._current * self._slab_bytes
        binding.bind_input("cache", self.device, 0, self._dtype, self._slab_shape, pointer)
        if output is not None:
            binding.bind_output(output, self.device, 0, self._dtype, self._slab_shape, pointer)
        return binding

    def _read_slots(self, n: int) -> np.ndarray:
        binding = self._slab_binding(self._reader, None)
        binding.bind_cpu_input("src", np.arange(n, dtype=np.int64))
        binding.bind_output("kv", "cpu")  # ONNX Runtime copies the n slots to the host
        self._reader.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]

    def _write_slots(self, kv: np.ndarray, start: int, n: int) -> None:
        binding = self._slab_binding(self._writer, "cache_out")
        binding.bind_cpu_input("dst", np.arange(start, n, dtype=np.int64).reshape(1, 1, 1, 1, -1, 1))
        binding.bind_cpu_input("kv", np.ascontiguousarray(kv[..., start:n, :]))
        self._writer.run_with_iobinding(binding)

    def _compact(self, path: np.ndarray) -> None:
        src, dst = self.length + path, self.length + np.arange(len(path), dtype=np.int64)
        binding = self._slab_binding(self._compactor, "cache_out")
        binding.bind_cpu_input("src", src)
        binding.bind_cpu_input("dst", dst.reshape(1, 1, 1, 1, -1, 1))
        self._compactor.run_with_iobinding(binding)


def check_fixed_shape(graph: GraphSpec, provider: str, cuda_graph: bool, fixed: bool, pad_to: int, slabs: int) -> None:
    """Refuse CUDA graphs / fixed-shape passes where they cannot work, with the fix."""
    if cuda_graph and provider != "cuda":
        raise SpecdecError(
            f"CUDA graphs are an option of provider 'cuda' (ONNX Runtime's CUDA EP), not {provider!r}; "
            "drop cuda_graph or use provider='cuda'."
        )
    if not fixed:
        return
    if not graph.capacity_bias:
        raise SpecdecError(
            f"this bundle's {graph.flavour!r} graph takes its attention bias only as wide as the tokens it attends "
            "to, so its decode passes cannot keep one shape (needed for CUDA graphs). Re-export the model with "
            "--flavour ort (e.g. --dtype fp16), or load it without cuda_graph."
        )
    if pad_to <= 0:
        raise SpecdecError("fixed-shape passes (CUDA graphs) pad every decode pass to pad_to rows: use pad_to > 0.")
    if slabs != 1:
        raise SpecdecError("fixed-shape passes (CUDA graphs) need the in-place cache of provider 'cuda'.")


class _FixedPass:
    """The one fixed-shape pass of an engine: [1, W] ids and positions, a [1, 1, W, capacity] bias and all W
    logits rows (W = ``pad_to``), hidden states and layer features if the graph has them, in buffers on the
    engine's device that are bound once, so that a captured CUDA graph finds them at the same addresses every
    step; each pass copies new values into them."""

    def __init__(self, engine: OrtGpuEngine):
        width, graph, device = engine.pad_to, engine.graph, engine.device
        self.engine = engine

        def buffer(shape, dtype):
            value = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device, 0)
            value.update_inplace(np.zeros(shape, dtype))
            return value

        self.inputs = {
            "input_ids": buffer((1, width), np.int64),
            "position_ids": buffer((1, width), np.int64),
            "attention_bias": buffer((1, 1, width, engine.capacity), np.float32),
        }
        self.outputs = {"logits": buffer((1, width, graph.vocab_size), np.float32)}
        if graph.has_hidden_states:
            self.outputs["hidden_states"] = buffer((1, width, graph.hidden_size), np.float32)
        if graph.feature_layers:  # EAGLE-3 heads read them
            self.outputs["layer_features"] = buffer(
                (1, width, len(graph.feature_layers) * graph.hidden_size), np.float32
            )
        self.bias = np.empty((1, 1, width, engine.capacity), np.float32)  # host side, refilled each pass
        self.binding = engine._bind_cache(0, 0)  # in place: one slab
        for name, value in self.inputs.items():
            self.binding.bind_ortvalue_input(name, value)
        # A shape value read on the host (it sizes the logits): constant, so the graph may bake it in.
        self.binding.bind_cpu_input("logits_to_keep", np.array([width], np.int64))
        for name, value in self.outputs.items():
            self.binding.bind_ortvalue_output(name, value)

    def run(self, step) -> tuple:
        """Run one padded pass (``step`` has W rows); returns logits [W, V], hidden states [W, H] and layer
        features [W, n*H], each of the last two None where the graph lacks it."""
        engine = self.engine
        step = widen_bias(step, engine.capacity, out=self.bias)
        self.inputs["input_ids"].update_inplace(step.ids)
        self.inputs["position_ids"].update_inplace(step.positions)
        self.inputs["attention_bias"].update_inplace(step.bias)
        engine.session.run_with_iobinding(self.binding, engine._graph_id)
        logits = self.outputs["logits"].numpy()[0]
        hidden, layers = (
            self.outputs[name].numpy()[0] if name in self.outputs else None
            for name in ("hidden_states", "layer_features")
        )
        return logits, hidden, layers
