"""ONNX Runtime sessions: execution providers, session options and host-output binding.

Every engine (and the head graphs) creates its sessions here, so provider checks and thread
settings are made in one place. A requested provider that is missing, or silently replaced by
the CPU, is an error that says what to install. Light: numpy and onnxruntime only.
"""

from __future__ import annotations

import importlib.metadata
import warnings

import numpy as np
import onnxruntime as ort

from specdec_edge.bundle.schema import GraphSpec
from specdec_edge.errors import BundleError, SpecdecError
from specdec_edge.runtime.base import ATTENTION_ROWS_KEY, BACKENDS
from specdec_edge.runtime.threads import OWN_SESSIONS, PROCESS_POOL

# provider name (``Pipeline.load(provider=...)``) -> ONNX Runtime execution provider
PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
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
    """Warn (once, at this module's import) when several ONNX Runtime packages are installed."""
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

    Every session of this package is made here: it joins the process-wide thread pool when one
    exists (``runtime/threads.py``).

    ``model_path``: a file, or ONNX bytes.
    """
    wanted = require_provider(provider)
    # CPU stays registered as the fallback for ops the accelerator lacks; the check below
    # makes sure the accelerator itself was not silently dropped.
    providers = [(wanted, provider_options or {})]
    if wanted != "CPUExecutionProvider":
        providers.append("CPUExecutionProvider")
    if PROCESS_POOL.exists and opts.use_per_session_threads:
        # ONNX Runtime refuses a session with its own pool once the process-wide one exists.
        opts.use_per_session_threads = False
        opts.intra_op_num_threads = opts.inter_op_num_threads = 0  # the pool's sizes apply (else a warning)
    try:
        model = model_path if isinstance(model_path, bytes) else str(model_path)
        session = ort.InferenceSession(model, sess_options=opts, providers=providers)
        OWN_SESSIONS.add(session)
    except Exception as e:  # onnxruntime raises its own pybind exception types
        if "EPContext" in str(e):
            raise SpecdecError(
                f"{model_path} is a prebuilt TensorRT engine (EPContext model); it runs only with "
                f"provider='tensorrt' on the GPU and TensorRT version it was built for, not with {wanted}. "
                "Load the bundle's ONNX graph instead, or rebuild with `specdec-edge build-engines BUNDLE` on "
                "this device."
            ) from None
        if isinstance(model_path, bytes):
            raise
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BundleError(
            f"ONNX Runtime could not load {model_path} ({reason[:300]}); the file may be damaged: run "
            "`specdec-edge verify BUNDLE` on its bundle, then re-copy or re-export the bundle."
        ) from None
    used = session.get_providers()[0]
    if used != wanted:
        raise SpecdecError(
            f"requested {wanted} but ONNX Runtime fell back to {used} (driver, CUDA or cuDNN libraries "
            "missing or mismatched?); fix the GPU setup or use provider='cpu'."
        )
    return session


def check_contract(session, graph: GraphSpec, model_path) -> None:
    """The manifest's graph contract (cache layers, shapes and dtype, vocabulary) against the graph's own
    inputs and outputs, before any buffer is sized by it: a mismatch is a ``BundleError``."""
    spec = graph.cache
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    element = "tensor(float16)" if spec.dtype == "float16" else "tensor(float)"
    have = sorted(n for n in inputs if n not in ("input_ids", "position_ids", "attention_bias", "logits_to_keep"))
    problem = want = None
    if len(have) != 2 * spec.num_layers:  # first, so that a damaged layer count builds no huge name list
        problem = f"{len(have)} cache inputs, the manifest says {spec.num_layers} layers"
    else:
        want = [spec.input_name(layer, kind) for layer in range(spec.num_layers) for kind in ("key", "value")]
        presents = [spec.output_name(layer, kind) for layer in range(spec.num_layers) for kind in ("key", "value")]
        if sorted(want) != have:
            problem = f"cache inputs {have[:2]}... != the manifest's {want[:2]}..."
        elif missing := [name for name in presents if name not in outputs]:
            problem = f"no cache output {missing[0]!r}"
    if problem is None:
        for name in want:
            shape, dims = inputs[name].shape, [spec.num_kv_heads, spec.capacity, spec.head_dim]
            if (
                inputs[name].type != element
                or len(shape) != 4
                or any(isinstance(d, int) and d != w for d, w in zip(shape[1:], dims))
            ):
                problem = f"{name} is {inputs[name].type} {shape}, the manifest says {element} [batch, {dims}]"
                break
    logits = outputs.get("logits")
    vocab = logits.shape[-1] if logits is not None and logits.shape else None
    if problem is None and (logits is None or (isinstance(vocab, int) and vocab != graph.vocab_size)):
        problem = f"logits {None if logits is None else logits.shape} != vocabulary {graph.vocab_size}"
    if problem is None and graph.has_hidden_states != ("hidden_states" in outputs):
        problem = f"hidden_states output {'missing' if graph.has_hidden_states else 'not in the manifest'}"
    features = outputs.get("layer_features")
    width = features.shape[-1] if features is not None and features.shape else None
    if problem is None and bool(graph.feature_layers) != (features is not None):
        problem = f"layer_features output {'missing' if graph.feature_layers else 'not in the manifest'}"
    elif problem is None and isinstance(width, int) and width != len(graph.feature_layers) * graph.hidden_size:
        problem = f"layer_features width {width} != {len(graph.feature_layers)} layers x {graph.hidden_size}"
    if problem:
        raise BundleError(
            f"{model_path} does not match its manifest ({problem}); the manifest or the graph is damaged: "
            "run `specdec-edge verify BUNDLE`, then re-copy or re-export the bundle."
        )


def attention_rows(session) -> int:
    """The fewest rows ``session``'s attention op sees (``base.ATTENTION_ROWS_KEY``): 2 where the graph pads a
    one-row pass's attention itself, else 1 (graphs exported before it, or that do not say)."""
    value = session.get_modelmeta().custom_metadata_map.get(ATTENTION_ROWS_KEY, "1")
    return int(value) if value.isdigit() and 1 <= int(value) <= 64 else 1


def session_options(threads: int | None = None, share_process: bool = False) -> ort.SessionOptions:
    """Options of a GPU-provider session (CPU sessions: ``threads.cpu_session_options``): full graph
    optimization, ``threads`` intra-op threads for CPU fallback ops (None: ONNX Runtime's choice);
    ``share_process`` when other sessions run in the same process."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        opts.intra_op_num_threads = int(threads)
    opts.inter_op_num_threads = 1
    if share_process:
        # Two spinning thread pools in one process slow each other by ~50 %.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def bind_cache(binding: ort.IOBinding, spec, cache: np.ndarray) -> list:
    """Bind each layer's key and value slice of ``cache`` ([layers, 2, batch, kv_heads, capacity, head_dim]) as both
    the graph's ``past_*`` input and ``present_*`` output (no copy: the graph writes new K/V in place); returns the
    OrtValues, which the caller keeps alive as long as the binding."""
    values = []
    for layer in range(spec.num_layers):
        for k, kind in enumerate(("key", "value")):
            value = ort.OrtValue.ortvalue_from_numpy(cache[layer, k])
            values.append(value)
            binding.bind_ortvalue_input(spec.input_name(layer, kind), value)
            binding.bind_ortvalue_output(spec.output_name(layer, kind), value)
    return values


def bind_host_outputs(binding: ort.IOBinding, buffers: dict, graph: GraphSpec, seq: int, keep: int) -> tuple:
    """Bind reused host buffers for one step's logits [1, keep, V] (and hidden states [1, seq, H], layer
    features [1, seq, n*H]) to ``binding``; ``buffers`` caches them per shape. ONNX Runtime writes (or copies
    from a device) into them. Returns (logits, hidden states or None, layer features or None)."""
    if (seq, keep) not in buffers:
        if len(buffers) > 64:  # prefill chunks of many sizes: keep the cache bounded
            buffers.clear()
        hidden = np.empty((1, seq, graph.hidden_size), np.float32) if graph.has_hidden_states else None
        width = len(graph.feature_layers) * graph.hidden_size
        layers = np.empty((1, seq, width), np.float32) if width else None
        buffers[seq, keep] = (np.empty((1, keep, graph.vocab_size), np.float32), hidden, layers)
    logits, hidden, layers = buffers[seq, keep]
    binding.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
    for name, array in (("hidden_states", hidden), ("layer_features", layers)):
        if array is not None:
            binding.bind_output(name, "cpu", 0, np.float32, array.shape, array.ctypes.data)
    return logits, hidden, layers


warn_on_package_conflict()
