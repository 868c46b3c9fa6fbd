"""TensorRT engines: prebuilt-engine lookup, sidecar checks, and an engine over the TensorRT API.

``specdec-edge build-engines BUNDLE`` (``export/trt_build.py``) writes engines into
``trt/<gpu>_<tensorrt version>/`` and lists them in the manifest under ``engines``::

    {"kind": "tensorrt" | "ort-epcontext", "role": "target", "file": "trt/.../target.plan",
     "sidecar": "trt/.../target.plan.json"}

Each sidecar records the TensorRT version, the GPU's compute capability, precision, the
optimization profile and the source graph's sha256. A serialized engine runs only under the
TensorRT version that built it, on the compute capability it was built for (or, with a
hardware-compatibility level, on Ampere and newer); a mismatch is an error that says to rebuild.

``TrtEngine`` needs the ``tensorrt`` and ``cuda-python`` packages (``from cuda.bindings import
runtime``, or ``from cuda import cudart`` in older releases, as the TensorRT samples use). Both
are imported when an engine is opened, never at module import.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np

from specdec_edge.bundle import MANIFEST, GraphSpec
from specdec_edge.errors import BundleError, SpecdecError
from specdec_edge.runtime.base import PAD_TO, CacheLength, pad_step
from specdec_edge.runtime.ort_engine import StepOutput

REBUILD = "rebuild with `specdec-edge build-engines BUNDLE` on this device"
SIDECAR_FORMAT = 1


def import_tensorrt():
    try:
        import tensorrt
    except ImportError:
        raise SpecdecError(
            "the `tensorrt` Python package is not installed; pip install tensorrt (x86/SBSA), or on Jetson use "
            "JetPack's python3-libnvinfer (see docs/JETSON.md); or use provider 'cuda'."
        ) from None
    return tensorrt


def import_cudart():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            raise SpecdecError(
                "provider 'trt' needs cuda-python for device memory: pip install cuda-python "
                "(the major version matching your CUDA), or use provider 'tensorrt'/'cuda'."
            ) from None
    return cudart


def gpu_info() -> dict:
    """``{"name", "compute_capability"}`` of GPU 0 (choose it with CUDA_VISIBLE_DEVICES), from cuda-python or
    nvidia-smi."""
    try:
        cudart = import_cudart()
        props = cuda_check(cudart, cudart.cudaGetDeviceProperties(0))
        name = props.name.decode(errors="replace").rstrip("\0") if isinstance(props.name, bytes) else str(props.name)
        return {"name": name, "compute_capability": f"{props.major}.{props.minor}"}
    except SpecdecError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        out = None
    if out is None or out.returncode != 0 or "," not in out.stdout:
        raise SpecdecError("no NVIDIA GPU found (neither cuda-python nor nvidia-smi could query one); "
                           "TensorRT engines need one. Use provider 'cpu'.")
    name, cc = (part.strip() for part in out.stdout.strip().splitlines()[0].rsplit(",", 1))
    return {"name": name, "compute_capability": cc}


def engine_dir_name(gpu_name: str, trt_version: str) -> str:
    """``trt/<gpu>_<tensorrt version>`` folder name, e.g. ``nvidia-h200_10.13.3``."""
    return f"{re.sub(r'[^a-z0-9.]+', '-', gpu_name.lower()).strip('-')}_{trt_version}"


def check_sidecar(sidecar: dict, *, trt_version: str, compute_capability: str, source_sha256: str | None) -> None:
    """Raise BundleError unless an engine with ``sidecar`` can run here."""
    name = sidecar.get("file", "engine")
    if sidecar.get("format") != SIDECAR_FORMAT:
        raise BundleError(f"{name}: unknown engine sidecar format {sidecar.get('format')!r}; {REBUILD}.")
    if sidecar.get("tensorrt_version") != trt_version:
        raise BundleError(f"{name} was built with TensorRT {sidecar.get('tensorrt_version')}, this machine has "
                          f"TensorRT {trt_version}; TensorRT engines only load in the version that built them: "
                          f"{REBUILD}.")
    built = sidecar.get("compute_capability")
    level = sidecar.get("hardware_compatibility", "none")
    if level == "ampere_plus":
        if tuple(int(x) for x in compute_capability.split(".")) < (8, 0):
            raise BundleError(f"{name} is hardware-compatible with Ampere and newer (compute capability >= 8.0); "
                              f"this GPU has {compute_capability}: {REBUILD}.")
    elif built != compute_capability:
        raise BundleError(f"{name} was built for compute capability {built} ({sidecar.get('gpu', '?')}); this GPU "
                          f"has {compute_capability}: {REBUILD} (or build with --hardware-compatible on Ampere+).")
    if source_sha256 is not None and sidecar.get("source_sha256") != source_sha256:
        raise BundleError(f"{name} was built from another version of its ONNX graph (sha256 differs); {REBUILD}.")


def bundle_engines(root: Path) -> list[dict]:
    """The ``engines`` list of a bundle's manifest (empty when none were built)."""
    return json.loads((Path(root) / MANIFEST).read_text()).get("engines", [])


def source_sha256(root: Path, graph: GraphSpec) -> str | None:
    files = json.loads((Path(root) / MANIFEST).read_text()).get("files", {})
    return files.get(graph.path, {}).get("sha256")


def find_prebuilt(root: Path, role: str, kind: str, graph: GraphSpec | None = None, *,
                  required: bool = False) -> dict | None:
    """The bundle's engine of ``kind`` for ``role`` that can run on this machine.

    None when the bundle has none (or this machine cannot be queried) and not ``required``;
    with ``required``, the first incompatibility is raised as an error saying to rebuild.
    """
    root = Path(root)
    candidates = [e for e in bundle_engines(root) if e.get("role") == role and e.get("kind") == kind]
    if not candidates:
        if required:
            raise BundleError(f"bundle {root} has no {kind} engine for the {role} model; build one with "
                              f"`specdec-edge build-engines {root}` on this device.")
        return None
    try:
        here = {"trt_version": import_tensorrt().__version__, "compute_capability": gpu_info()["compute_capability"]}
    except SpecdecError:
        if required:
            raise
        return None
    error = None
    for entry in candidates:
        sidecar = dict(json.loads((root / entry["sidecar"]).read_text()), file=entry["file"])
        try:
            check_sidecar(sidecar, **here, source_sha256=source_sha256(root, graph) if graph else None)
        except BundleError as e:
            error = error or e
            continue
        return {**entry, "sidecar_data": sidecar}
    if required:
        raise error
    return None


def engine_cache_dir(root: Path, graph: GraphSpec) -> Path:
    """Per-user TensorRT EP engine cache for one graph (the bundle itself may be read-only)."""
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec-edge" / "trt-ep"
    return base / (source_sha256(root, graph) or re.sub(r"\W+", "-", str(Path(root).resolve())))[:16]


def cuda_check(cudart, result):
    """Unwrap a cuda-python call's ``(error, *values)``; raise on a CUDA error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        raise SpecdecError(f"CUDA call failed: {cudart.cudaGetErrorName(err)[1]!r}; check the GPU and driver.")
    return values[0] if len(values) == 1 else values


class TrtEngine(CacheLength):
    """One serialized TensorRT engine with device KV buffers, run with ``execute_async_v3`` (batch 1).

    The cache is two device slabs ``[layers, 2, 1, kv_heads, capacity, head_dim]`` that ping-pong
    (TensorRT does not promise in-place updates of aliased inputs/outputs). Compaction after a tree
    step is one strided ``cudaMemcpy2DAsync`` per moved slot covering every layer, K and V.
    """

    def __init__(self, plan_path: Path, graph: GraphSpec, sidecar: dict, pad_to: int | None = None):
        trt, self._cudart = import_tensorrt(), import_cudart()
        cudart = self._cudart
        self.graph = graph
        cuda_check(cudart, cudart.cudaSetDevice(0))
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = self._runtime.deserialize_cuda_engine(Path(plan_path).read_bytes())
        if self._engine is None:
            raise BundleError(f"TensorRT could not deserialize {plan_path}; {REBUILD}.")
        self._context = self._engine.create_execution_context()
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
        self._inputs = {"input_ids": self._malloc(8 * top), "position_ids": self._malloc(8 * top),
                        "attention_bias": self._malloc(4 * top * spec.capacity)}
        self._outputs = {"logits": self._malloc(4 * top * vocab)}
        if graph.has_hidden_states:
            self._outputs["hidden_states"] = self._malloc(4 * top * graph.hidden_size)
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
    def from_bundle(cls, root: Path, role: str, graph: GraphSpec, pad_to: int | None = None) -> "TrtEngine":
        entry = find_prebuilt(root, role, "tensorrt", graph, required=True)
        return cls(Path(root) / entry["file"], graph, entry["sidecar_data"], pad_to)

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
        cuda_check(self._cudart, self._cudart.cudaMemcpyAsync(self._inputs[name], array.ctypes.data, array.nbytes,
                                                               kind, self._stream))
        self._context.set_input_shape(name, array.shape)
        self._context.set_tensor_address(name, self._inputs[name])

    def run(self, input_ids, position_ids=None, attention_bias=None, logits_to_keep=None) -> StepOutput:
        step = self.step_inputs(input_ids, position_ids, attention_bias, logits_to_keep)
        seq, keep = step.ids.shape[1], step.keep
        if seq > self._max_seq:
            raise SpecdecError(f"this step has {seq} new tokens; the engine takes at most {self._max_seq} per pass: "
                               "rebuild the engine with a larger --max-verify.")
        if seq < self.pad_to <= self.capacity - self.length:  # one shape for every pass: see cuda_engine
            step = pad_step(step, self.pad_to, self.length)
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
            raise SpecdecError("TensorRT execution failed (see the TensorRT log above); " + REBUILD + ".")
        self._current = dst
        logits = self._download("logits", (step.keep, self.vocab_size))
        hidden = None
        if self.graph.has_hidden_states:
            hidden = self._download("hidden_states", (step.ids.shape[1], self.graph.hidden_size))
        cuda_check(self._cudart, self._cudart.cudaStreamSynchronize(self._stream))
        return StepOutput(logits[:keep], None if hidden is None else hidden[:seq])

    def _download(self, name: str, shape: tuple) -> np.ndarray:
        out = np.empty(shape, dtype=np.float32)
        kind = self._cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        cuda_check(self._cudart, self._cudart.cudaMemcpyAsync(out.ctypes.data, self._outputs[name], out.nbytes,
                                                               kind, self._stream))
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
                cuda_check(cudart, cudart.cudaMemcpy2DAsync(dst, pitch, src, pitch, self._row, height, kind,
                                                            self._stream))
        cuda_check(cudart, cudart.cudaStreamSynchronize(self._stream))
