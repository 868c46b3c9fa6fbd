"""Backend selection: which engine runs a bundle graph, and how each is configured.

``provider`` (``Pipeline.load(provider=...)``, ``--provider``) picks one backend:

=============  ==========================================================  ======================
provider       engine                                                      needs
=============  ==========================================================  ======================
``cpu``        ``OrtEngine``: ONNX Runtime CPU EP, numpy-backed cache      ``onnxruntime``
``cuda``       ``DeviceEngine``: ONNX Runtime CUDA EP, cache on the GPU    ``onnxruntime-gpu``
``tensorrt``   ``DeviceEngine``: ONNX Runtime TensorRT EP (portable graph) ``onnxruntime-gpu`` +
                                                                           TensorRT libraries
``trt``        ``TrtEngine``: TensorRT directly, a prebuilt engine from    ``tensorrt``,
               ``specdec-edge build-engines``                              ``cuda-python``
=============  ==========================================================  ======================

Every engine offers the same interface to the decode loop (``run``/``commit``/``rollback``/
``reset``/``length``/``capacity``/``vocab_size``). A requested ONNX Runtime provider that is
missing, or silently replaced by the CPU, is an error that says what to install.

Light: numpy and onnxruntime only; the GPU engines are imported when chosen.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from pathlib import Path

import onnxruntime as ort

from specdec_edge.bundle import GraphSpec
from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import PAD_TO

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
BACKENDS = (*PROVIDERS, "trt")
# The largest S of one pass: prefill chunks (speculative.loop.PREFILL_CHUNK; a test keeps them equal)
# or a verified tree, whichever is larger.
PREFILL_CHUNK = 256
MAX_VERIFY = 64
ORT_PACKAGES = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino", "onnxruntime-qnn")


def installed_ort_packages() -> list[str]:
    """The ONNX Runtime distributions installed in this environment (they share one import name)."""
    found = []
    for name in ORT_PACKAGES:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


def ort_package_conflict(packages: list[str] | None = None) -> str | None:
    """A warning text when more than one ONNX Runtime package is installed, else None.

    ``onnxruntime`` and ``onnxruntime-gpu`` both install the ``onnxruntime`` module; whichever
    was installed last wins file by file, so the CUDA provider may be missing or broken.
    """
    packages = installed_ort_packages() if packages is None else packages
    if len(packages) < 2:
        return None
    keep = "onnxruntime-gpu" if "onnxruntime-gpu" in packages else packages[-1]
    drop = " ".join(p for p in packages if p != keep)
    return (
        f"several ONNX Runtime packages are installed ({', '.join(packages)}); they overwrite each other's "
        f"`onnxruntime` module and the GPU providers may be missing. Fix: pip uninstall -y {drop} {keep} && "
        f"pip install {keep}"
    )


def warn_on_package_conflict() -> None:
    message = ort_package_conflict()
    if message:
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def require_provider(provider: str) -> str:
    """The ONNX Runtime EP name for ``provider``, or an error saying what to install."""
    if provider not in PROVIDERS:
        raise SpecdecError(f"unknown provider {provider!r}; choose one of {', '.join(BACKENDS)}.")
    wanted = PROVIDERS[provider]
    available = ort.get_available_providers()
    if wanted not in available:
        hint = "pip uninstall onnxruntime && pip install onnxruntime-gpu"
        if provider == "cpu":
            hint = "reinstall onnxruntime"
        raise SpecdecError(
            f"{wanted} is not available in this onnxruntime build (available: {', '.join(available)}); "
            f"install the matching onnxruntime package ({hint}), or use provider='cpu'."
        )
    return wanted


def create_session(model_path, opts: ort.SessionOptions, provider: str, provider_options: dict | None = None):
    """An InferenceSession on ``provider`` (CPU kept as fallback for single ops); checks what was used.

    ``model_path``: a file, or ONNX bytes.
    """
    wanted = require_provider(provider)
    # CPU stays registered as the fallback for ops the accelerator lacks; the check below
    # makes sure the accelerator itself was not silently dropped.
    providers = [(wanted, provider_options or {})]
    if wanted != "CPUExecutionProvider":
        providers.append("CPUExecutionProvider")
    try:
        model = model_path if isinstance(model_path, bytes) else str(model_path)
        session = ort.InferenceSession(model, sess_options=opts, providers=providers)
    except Exception as e:  # onnxruntime raises its own pybind exception types
        if "EPContext" in str(e):
            raise SpecdecError(
                f"{model_path} is a prebuilt TensorRT engine (EPContext model); it runs only with "
                f"provider='tensorrt' on the GPU and TensorRT version it was built for, not with {wanted}. "
                "Load the bundle's ONNX graph instead, or rebuild with `specdec-edge build-engines BUNDLE` on "
                "this device."
            ) from None
        raise
    used = session.get_providers()[0]
    if used != wanted:
        raise SpecdecError(
            f"requested {wanted} but ONNX Runtime fell back to {used} (driver, CUDA or cuDNN libraries "
            "missing or mismatched?); fix the GPU setup or use provider='cpu'."
        )
    return session


def max_pass_tokens(graph: GraphSpec, max_verify: int = MAX_VERIFY) -> int:
    """The largest S one pass may have: a prefill chunk or a verified tree, capped by the cache."""
    return min(graph.cache.capacity, max(PREFILL_CHUNK, max_verify))


def tensorrt_profiles(graph: GraphSpec, max_verify: int = MAX_VERIFY) -> dict[str, tuple]:
    """One optimization profile: input name -> (min, opt, max) shape, batch 1.

    S (new tokens) spans 1..max_pass_tokens, optimized for a padded decode pass (PAD_TO rows); the bias width
    (past + S) spans 1..capacity. The cache buffers are fixed at the exported capacity.
    ``logits_to_keep`` is a shape *value* input (it sizes the logits): see ``shape_value_ranges``.
    """
    cache = graph.cache
    top = max_pass_tokens(graph, max_verify)
    opt_s = min(PAD_TO, top)  # GPU engines pad every decode pass to PAD_TO rows (runtime/base.pad_step)
    opt_t = max(opt_s, cache.capacity // 2)
    profiles = {
        "input_ids": ((1, 1), (1, opt_s), (1, top)),
        "position_ids": ((1, 1), (1, opt_s), (1, top)),
        "attention_bias": ((1, 1, 1, 1), (1, 1, opt_s, opt_t), (1, 1, top, cache.capacity)),
    }
    kv = (1, cache.num_kv_heads, cache.capacity, cache.head_dim)
    for layer in range(cache.num_layers):
        for kind in ("key", "value"):
            profiles[cache.input_name(layer, kind)] = (kv, kv, kv)
    return profiles


def shape_value_ranges(graph: GraphSpec, max_verify: int = MAX_VERIFY) -> dict[str, tuple]:
    """Inputs whose *values* are shapes for TensorRT: name -> (min, opt, max) values."""
    top = max_pass_tokens(graph, max_verify)
    return {"logits_to_keep": ((1,), (min(PAD_TO, top),), (top,))}


def _profile_string(profiles: dict, which: int) -> str:
    return ",".join(f"{name}:{'x'.join(str(d) for d in shapes[which])}" for name, shapes in profiles.items())


def tensorrt_ep_options(graph: GraphSpec, cache_dir: str | Path, *, max_verify: int = MAX_VERIFY,
                        fp16: bool | None = None) -> dict[str, str]:
    """ONNX Runtime TensorRT EP options for ``graph``: explicit profile, precision, engine cache.

    fp16 defaults to the graph's precision (an fp32 graph stays fp32, so it matches CPU results).
    """
    if graph.flavour != "portable":
        raise SpecdecError(
            f"the {graph.flavour!r} graph uses ONNX Runtime's fused ops that TensorRT cannot run; "
            "export with --flavour portable (and --dtype fp16) for provider 'tensorrt' or 'trt'."
        )
    profiles = tensorrt_profiles(graph, max_verify)
    cache_dir = Path(cache_dir)
    return {
        "device_id": "0",  # GPU engines use device 0: choose the GPU with CUDA_VISIBLE_DEVICES
        "trt_fp16_enable": "1" if (graph.dtype == "fp16" if fp16 is None else fp16) else "0",
        "trt_engine_cache_enable": "1",
        "trt_engine_cache_path": str(cache_dir),
        "trt_timing_cache_enable": "1",
        "trt_timing_cache_path": str(cache_dir),
        "trt_profile_min_shapes": _profile_string(profiles, 0),
        "trt_profile_opt_shapes": _profile_string(profiles, 1),
        "trt_profile_max_shapes": _profile_string(profiles, 2),
    }


def open_engine(root: Path, graph: GraphSpec, *, provider: str = "cpu", threads: int | None = None,
                share_process: bool = False, role: str = "target", pad_to: int | None = None):
    """The engine of ``provider`` over one bundle graph (see the table in this module's docstring).

    ``pad_to``: GPU engines pad narrower passes to this many rows so that speculative and plain
    decoding round alike (``cuda_engine``; default 32, 0 = off); the CPU engine needs no padding.
    """
    if provider not in BACKENDS:
        raise SpecdecError(f"unknown provider {provider!r}; choose one of {', '.join(BACKENDS)}.")
    if provider == "cpu":
        from specdec_edge.runtime.ort_engine import OrtEngine

        return OrtEngine(root / graph.path, graph, provider=provider, threads=threads, share_process=share_process)
    if provider == "trt":
        from specdec_edge.runtime.trt import TrtEngine

        return TrtEngine.from_bundle(root, role, graph, pad_to)
    from specdec_edge.runtime.cuda_engine import DeviceEngine

    return DeviceEngine.from_bundle(root, role, graph, provider=provider, threads=threads, share_process=share_process,
                                    pad_to=pad_to)
