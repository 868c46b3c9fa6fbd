"""TensorRT and TensorRT-RTX: the two NVIDIA libraries that run prebuilt engines, and where they differ.

Provider ``trt`` runs engines of TensorRT (module ``tensorrt``; data-center GPUs, Jetson), provider
``trt-rtx`` engines of TensorRT-RTX (module ``tensorrt_rtx``; ``pip install 'specdec-edge[trt-rtx]'``),
TensorRT for RTX workstations and desktop apps. An engine runs only under the library and version
that built it. TensorRT-RTX has TensorRT's API with these documented differences, followed here:

* Ahead-of-time, hardware-agnostic build: an engine is built for a list of compute capabilities
  (``IBuilderConfig.set_compute_capability``; ``CURRENT`` = the GPU of this machine), also on a
  machine without a GPU. Kernels are compiled just in time when the engine runs.
* A runtime cache (``IRuntimeConfig.set_runtime_cache``) keeps those JIT-compiled kernels across
  runs; it is stored per engine under ``<user cache>/trt-rtx/`` (``user_cache.cache_dir``).
* Strongly typed networks only: no FP16/INT8 builder flags and no implicit (calibrated) INT8;
  precision comes from the graph's own types, quantization only as explicit Q/DQ nodes. Our
  portable fp16/fp32 graphs need neither.
* Dynamic-shape kernels are specialized per input shape unless told not to. Every pass here has a
  new attention-bias width, so specialization would compile again and again, and a pass could
  change kernels (and rounding) between steps: the engine runs with specialization ``NONE``.
* No ONNX Runtime EPContext models (ONNX Runtime's TensorRT EP links full TensorRT).
* Support matrix: compute capability 7.5 to 12.x (Turing to Blackwell RTX, GB10); Hopper (9.0,
  H100/H200) is not listed, so the build refuses it there.

Version-specific code of both libraries lives in this module; both are imported only when used.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from specdec_edge.atomic import write_atomic
from specdec_edge.errors import BundleError, SpecdecError


@dataclass(frozen=True)
class TrtLibrary:
    backend: str  # provider and build-engines backend
    name: str  # the sidecar's "library"
    module: str  # the Python module
    title: str  # in messages
    engine_kind: str  # manifest ``engines[].kind``
    suffix: str  # engine file suffix
    install: str  # how to get it


TENSORRT = TrtLibrary(
    "trt",
    "tensorrt",
    "tensorrt",
    "TensorRT",
    "tensorrt",
    ".plan",
    "pip install tensorrt (x86/SBSA), or on Jetson use JetPack's python3-libnvinfer (see docs/JETSON.md)",
)
TENSORRT_RTX = TrtLibrary(
    "trt-rtx",
    "tensorrt-rtx",
    "tensorrt_rtx",
    "TensorRT-RTX",
    "tensorrt-rtx",
    ".rtx.plan",
    "pip install 'specdec-edge[trt-rtx]' (the tensorrt-rtx wheels, for RTX GPUs)",
)
LIBRARIES = {lib.backend: lib for lib in (TENSORRT, TENSORRT_RTX)}
# The one table of prebuilt engines: `build-engines` backend (the provider that runs it) -> (engine kind in the
# manifest, file suffix, library). The ``tensorrt`` backend is ONNX Runtime's EPContext model, which embeds a
# full TensorRT engine.
ENGINE_KINDS = {
    "trt": (TENSORRT.engine_kind, TENSORRT.suffix, TENSORRT),
    "tensorrt": ("ort-epcontext", ".epctx.onnx", TENSORRT),
    "trt-rtx": (TENSORRT_RTX.engine_kind, TENSORRT_RTX.suffix, TENSORRT_RTX),
}
KIND_LIBRARY = {kind: library for kind, _, library in ENGINE_KINDS.values()}  # manifest kind -> its library
KIND_BACKEND = {kind: backend for backend, (kind, _, _) in ENGINE_KINDS.items()}  # manifest kind -> backend
# TensorRT-RTX 1.7's build targets (its ComputeCapability enum), for messages where the module is absent
RTX_COMPUTE_CAPABILITIES = ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1")


def installed(lib: TrtLibrary) -> bool:
    return importlib.util.find_spec(lib.module) is not None


def import_library(lib: TrtLibrary):
    """The library's Python module, or an error that says how to install it."""
    try:
        return importlib.import_module(lib.module)
    except ImportError:
        raise SpecdecError(
            f"the `{lib.module}` Python package ({lib.title}) is not installed: {lib.install}; or use provider 'cuda'."
        ) from None


# ---- TensorRT-RTX: build targets, engine validity, execution contexts with a runtime cache
def rtx_compute_capabilities(trt) -> tuple[str, ...]:
    """The compute capabilities this TensorRT-RTX can build for, e.g. ("7.5", ..., "12.0")."""
    names = [n for n in trt.ComputeCapability.__members__ if n.startswith("SM")]
    return tuple(f"{n[2:-1]}.{n[-1]}" for n in names)


def set_rtx_targets(trt, config, compute_capabilities: list[str] | None) -> None:
    """Build for ``compute_capabilities`` (ahead of time, no GPU needed), or for this machine's GPU (None)."""
    targets = [trt.ComputeCapability.CURRENT]
    if compute_capabilities:
        supported = rtx_compute_capabilities(trt)
        unknown = [cc for cc in compute_capabilities if cc not in supported]
        if unknown:
            raise SpecdecError(
                f"TensorRT-RTX {trt.__version__} cannot build for compute capability {', '.join(unknown)}; "
                f"it supports {', '.join(supported)}."
            )
        targets = [getattr(trt.ComputeCapability, "SM" + cc.replace(".", "")) for cc in compute_capabilities]
    config.num_compute_capabilities = len(targets)
    for i, target in enumerate(targets):
        config.set_compute_capability(target, i)


def check_rtx_engine(trt, runtime, plan: bytes, name: str, rebuild: str) -> None:
    """Raise BundleError unless TensorRT-RTX says the serialized engine can run on this machine."""
    validity, diagnostics = runtime.get_engine_validity(plan)
    if validity != trt.EngineValidity.INVALID:
        return
    reasons = [
        n.lower().replace("_", " ")
        for n, flag in trt.EngineInvalidityDiagnostics.__members__.items()
        if int(diagnostics) & int(flag)  # a bit mask of these flags
    ]
    raise BundleError(
        f"TensorRT-RTX {trt.__version__} cannot run {name} here ({', '.join(reasons) or 'no reason given'}); {rebuild}."
    )


def rtx_context(trt, engine, cache_path: Path):
    """An execution context with generic dynamic-shape kernels and a runtime cache loaded from ``cache_path``.

    Returns ``(context, save)``: ``save()`` writes the cache (the kernels compiled so far) back.
    """
    config = engine.create_runtime_config()
    config.dynamic_shapes_kernel_specialization_strategy = trt.DynamicShapesKernelSpecializationStrategy.NONE
    cache = config.create_runtime_cache()
    if cache_path.is_file():
        cache.deserialize(cache_path.read_bytes())  # False (ignored) when made by another GPU or version
    config.set_runtime_cache(cache)
    context = engine.create_execution_context(config)

    def save() -> None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cache_path, bytes(cache.serialize()))

    return context, save
