"""Prefill through OpenVINO: the target graph's prefill passes run by OpenVINO's CPU plugin, every other pass by
ONNX Runtime, over the one KV cache.

Why: on an AVX-512 CPU, OpenVINO's kernels run our own exported graph (the same ``model.onnx``, read by its ONNX
frontend: ``MatMulNBits``, ``GroupQueryAttention`` and all) 1.3-1.7x faster than ONNX Runtime for passes of 64 to
a few hundred rows (docs/lab/prefill-and-passes.md), while a one-row decode pass is far slower there (each pass
would copy the whole cache in and out). So only prefill goes through it.

Exactness: a prefill needs determinism, not the rounding of decode passes. Every call, plain or speculative,
prefills through the same path (``runtime.base.prefill``), so their outputs stay identical; the K/V it writes
differ from ONNX Runtime's in the last bits, so a cache reused from decode passes is not bit-identical to a fresh
prefill (the verdict, measured with this path attached, says so; output with reuse equals plain decoding's with
reuse). OpenVINO runs at fp32 precision (``INFERENCE_PRECISION_HINT``: not its bf16 default on CPUs with bf16),
its 4-bit layers with int8 activations as ONNX Runtime's do; agreement with the fp32 model is measured beside the
speed in docs/PERFORMANCE.md.

``prefill`` (``LoadSettings.prefill``, ``--prefill``): ``onnxruntime`` (every pass in ONNX Runtime), ``openvino``
(prefill here; an error if OpenVINO is missing or cannot compile the graph) or ``auto`` (here when the provider
is the CPU, OpenVINO is installed and compiles the graph, and its prefill measured faster on this device: once per
device and bundle, cached, ``runtime/prefill_choice.py``; else ONNX Runtime). Passes of fewer than ``MIN_ROWS``
rows stay in ONNX Runtime (OpenVINO gains nothing there): which runtime prefills a call depends only on how many
tokens it prefills and on the device's cached choice, never on a call's timing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import numpy as np

from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import StepInputs, StepOutput

# "fp32": the bundle's prefill graph in ONNX Runtime (runtime/graph_prefill.py)
PREFILL_RUNTIMES = ("auto", "onnxruntime", "openvino", "fp32")
# OpenVINO's passes cost little per row and much per call (it reads the cache buffers in): longer chunks, and
# passes of fewer rows than MIN_ROWS stay in ONNX Runtime (measured ~1.0x at 16 rows, 1.3x at 64, 1.7x at 256).
OPENVINO_CHUNK = 1024
MIN_ROWS = 64
# ONNX Runtime's and OpenVINO's K/V of the gguf bundle differ by 0.05-0.07 (each is 0.04-0.06 from the fp32 model's:
# two roundings of int8 activations); a wrong function differs by far more (the compiled-model cache: 1e24).
CHECK_TOLERANCE = 0.2
INSTALL = "pip install 'specdec-edge[openvino]'"


class OpenVinoPrefill:
    """A bundle's target graph compiled by OpenVINO (on first use: ~2 s) that runs prefill passes into an engine's
    cache. Its compiled-model cache (``CACHE_DIR``) is not used: models read back from it computed wrong K/V here
    (OpenVINO 2026.4, docs/lab/prefill-and-passes.md)."""

    chunk = OPENVINO_CHUNK
    min_rows = MIN_ROWS
    # Its first pass is checked against ONNX Runtime's on the same rows (``OrtEngine.prefill_run``: the relative
    # error of the K/V under CHECK_TOLERANCE); ``required`` (``prefill`` "openvino"): a failure is an error, else
    # the engine prefills in ONNX Runtime from then on.
    checked = False
    check_holds_per_device = False  # compiled anew in each process: its first pass there is checked
    required = False

    def __init__(self, model_path: str | Path, graph, threads: int | None = None):
        try:  # the package's version now (the device identity needs it); the module itself when compiling
            self.version = importlib.metadata.version("openvino")
        except importlib.metadata.PackageNotFoundError:
            raise SpecdecError(
                f"prefill 'openvino' needs the openvino package, which is not installed: {INSTALL}; "
                "or prefill with ONNX Runtime (--prefill onnxruntime)."
            ) from None
        self.model_path, self.graph, self.threads = Path(model_path), graph, threads
        self.name, self.label = "openvino", f"openvino {self.version}"  # in the choice's records, in reports
        self.setting = f"+openvino-prefill-{self.version}"  # in device identities (``prefill_setting``)
        self.compiled = self.request = None
        self._extra: list[str] = []

    def compile(self) -> None:
        """Compile the graph (once); a graph OpenVINO cannot compile is a ``SpecdecError`` naming the way out."""
        if self.compiled is not None:
            return
        config = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
        if self.threads:
            config["INFERENCE_NUM_THREADS"] = int(self.threads)
        try:
            import openvino

            compiled = openvino.Core().compile_model(str(self.model_path), "CPU", config)
        except Exception as e:  # OpenVINO raises RuntimeError subclasses of its own for unsupported graphs
            raise SpecdecError(
                f"OpenVINO cannot compile {self.model_path.name} for prefill ({' '.join(str(e).split())[:300]}); "
                "prefill with ONNX Runtime (--prefill onnxruntime)."
            ) from None
        names = {name for out in compiled.outputs for name in out.get_names()}
        self._extra = [name for name in ("hidden_states", "layer_features") if name in names]
        self.compiled, self.request = compiled, compiled.create_infer_request()

    def run(self, cache: np.ndarray, past: int, step: StepInputs) -> StepOutput:
        """One pass of ``step`` after ``past`` committed slots of ``cache`` ([layers, 2, 1, kv_heads, capacity,
        head_dim], the engine's): the new K/V land in slots past..past+S-1, as an ONNX Runtime pass writes them."""
        self.compile()
        spec, seq = self.graph.cache, step.ids.shape[1]
        feeds = {
            "input_ids": step.ids,
            "position_ids": step.positions,
            "attention_bias": step.bias,
            "logits_to_keep": np.array([step.keep], dtype=np.int64),
        }
        for layer in range(spec.num_layers):
            for k, kind in enumerate(("key", "value")):
                feeds[spec.input_name(layer, kind)] = cache[layer, k]
        try:
            result = self.request.infer(feeds, share_inputs=True)
        except Exception as e:  # OpenVINO's own RuntimeError subclasses
            raise SpecdecError(
                f"OpenVINO failed a prefill pass ({' '.join(str(e).split())[:300]}); prefill with ONNX Runtime "
                "(--prefill onnxruntime)."
            ) from None
        presents = [
            [result[self.compiled.output(spec.output_name(layer, kind))] for kind in ("key", "value")]
            for layer in range(spec.num_layers)
        ]
        want = cache.shape[2:4]  # (batch, kv_heads)
        if any(p.shape[:2] != want or p.shape[2] < past + seq for pair in presents for p in pair):
            raise SpecdecError(
                f"OpenVINO returned K/V of shape {presents[0][0].shape} for a pass of {seq} rows after {past}: it "
                "does not run this graph as ONNX Runtime does; prefill with ONNX Runtime (--prefill onnxruntime)."
            )
        for layer, pair in enumerate(presents):  # checked first: nothing is written from a bad pass
            for k, present in enumerate(pair):
                cache[layer, k, :, :, past : past + seq] = present[:, :, past : past + seq]
        logits = result[self.compiled.output("logits")]
        extra = {name: result[self.compiled.output(name)][0, :seq] for name in self._extra}
        return StepOutput(logits[0, : step.keep], extra.get("hidden_states"), extra.get("layer_features"))


def open_prefill(choice: str, provider: str, model_path: Path, graph, threads: int | None):
    """The ``OpenVinoPrefill`` that ``choice`` asks for on ``provider`` (module docstring), or None: another runtime.
    "openvino" compiles now (its errors surface at load); "auto" when a prompt first needs it, and where that fails
    its engine goes on prefilling in ONNX Runtime (``OrtEngine.prefill_run``)."""
    if choice not in PREFILL_RUNTIMES:
        raise SpecdecError(f"unknown prefill runtime {choice!r}; choose one of {', '.join(PREFILL_RUNTIMES)}.")
    if choice in ("onnxruntime", "fp32") or (choice == "auto" and provider != "cpu"):
        return None
    if provider != "cpu":
        raise SpecdecError(
            f"prefill 'openvino' runs on the CPU, beside provider 'cpu'; with provider {provider!r} use "
            "--prefill onnxruntime (or auto)."
        )
    if choice == "auto" and importlib.util.find_spec("openvino") is None:
        return None
    prefiller = OpenVinoPrefill(model_path, graph, threads)
    if choice == "openvino":
        prefiller.required = True
        prefiller.compile()
    return prefiller


def check_against(prefiller_kv: np.ndarray, onnxruntime_kv: np.ndarray, who: str = "OpenVINO's prefill") -> None:
    """Refuse a prefiller (``who``) whose K/V (``[layers, 2, 1, kv_heads, S, head_dim]``) are not ONNX Runtime's to
    within ``CHECK_TOLERANCE`` relative error: a conversion that computes another function (OpenVINO's compiled-model
    cache did, here), not the rounding of another kernel (the gguf bundle: 0.05-0.07; fp32: ~1e-6)."""
    a, b = prefiller_kv.astype(np.float64), onnxruntime_kv.astype(np.float64)
    error = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    if not np.isfinite(error) or error > CHECK_TOLERANCE:
        raise SpecdecError(
            f"{who} of this graph disagrees with ONNX Runtime's (relative error {error:.3g} of the K/V, "
            f"more than {CHECK_TOLERANCE}); prefill with ONNX Runtime (--prefill onnxruntime)."
        )


def prefill_name(engine) -> str:
    """Which runtime prefills ``engine``'s cache: "openvino <version>", "fp32 ..." (the bundle's prefill graph) or
    "onnxruntime" (reports, `info`)."""
    prefiller = getattr(engine, "prefiller", None)
    return "onnxruntime" if prefiller is None else prefiller.label


def prefill_setting(engine) -> str:
    """The part of the device identity (``runtime/device.py``) that says another runtime prefills: verdicts and step
    costs measured with another prefill runtime are cached apart from ONNX Runtime's."""
    prefiller = getattr(engine, "prefiller", None)
    return "" if prefiller is None else prefiller.setting
