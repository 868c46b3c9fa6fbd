"""How a bundle is loaded: one settings object, built the same way by ``chat``, ``generate``, ``serve``, ``bench``
and the Python API (``Pipeline.load(bundle, settings=LoadSettings(...))``, or today's keywords, which fill one).

    settings = LoadSettings(threads=4, provider="cpu", reuse=True, prompt_cache_mb=64)
    pipe = Pipeline.load("bundles/smollm2", settings, method="pld", max_ngram=4)

Light: the standard library and the runtime's small option types only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from specdec_edge.api.prompt_cache import DEFAULT_MB
from specdec_edge.errors import SpecdecError
from specdec_edge.progress import Progress
from specdec_edge.runtime.base import DEFAULT_GPU, GpuOptions, available_memory
from specdec_edge.speculative.history import DEFAULT_HISTORY_MB, HistoryStore

GPU_KEYWORDS = ("pad_to", "cuda_graph")  # ``Pipeline.load``'s keywords for the fields of ``GpuOptions``


@dataclass(frozen=True)
class LoadSettings:
    """What loading a bundle needs besides the method.

    ``threads``: CPU threads (None: one per physical core). ``spinning`` (default): every CPU session of the
    process shares one spinning thread pool, the fastest measured; False gives each session a pool that sleeps
    between ops, leaving the CPU idle (``runtime/threads.py``).
    ``provider``: "cpu", "cuda" (ONNX Runtime CUDA EP), "tensorrt" (ONNX Runtime TensorRT EP) or "trt" / "trt-rtx"
    (TensorRT / TensorRT-RTX engines from `specdec-edge build-engines`); see ``runtime/factory.py``.
    ``gpu``: ``pad_to``, GPU providers pad every narrower pass to this many rows so that speculative and plain
    decoding round alike (default 32; 0 turns it off; ``runtime/ort_gpu_engine.py``); ``cuda_graph`` (provider
    "cuda"): decode passes run as one fixed-shape pass that ONNX Runtime captures once as a CUDA graph and replays.
    ``allow_inexact``: permit speculation that the device's exactness verdict does not vouch for (``exactness.py``:
    a target that is not batch invariant on this device, or token trees on a quantized target whose tree rows round
    differently), whose output may then differ from plain decoding. The verdict is the export machine's on that
    machine; on any other device (CPU model or features, provider, GPU, ONNX Runtime version, threads) it is
    measured on first use, in seconds, and cached (``runtime/verdicts.py``).
    ``reuse`` (default): the calls' default for KV prefix reuse (``Pipeline.stream``'s ``reuse``, which a call may
    still set): the engines keep the last call's context, and a call prefills only what its prompt does not share
    with it (or with a snapshot of the prompt cache); False: every call prefills its whole prompt (`chat`/`serve
    --no-reuse`; `bench --reuse` turns it on, for second turns only).
    ``prompt_cache_mb``: host memory for snapshots of earlier contexts (None: ``prompt_cache.DEFAULT_MB``; 0: none),
    restored when a call shares more with one of them than with the context the engines hold (``prompt_cache.py``);
    prefix files work with 0 too.
    ``history``: keep the prompts and outputs of earlier calls (at most ``history_mb`` MiB, the oldest dropped
    first) for the methods that draft from them (``auto``, ``history``; ``speculative/history.py``); False keeps
    nothing. The output is the same either way, only faster.
    ``chat_template``: a Jinja chat template that replaces the bundle's (``tokenizer.read_chat_template`` reads one
    from a file); a base model's bundle has none, and then takes plain text only.
    ``prefill``: which runtime runs the target's prefill passes (``runtime/prefill_choice.py``): "auto" (default:
    where the provider is "cpu", the fastest of OpenVINO (where the openvino package is installed and compiles the
    graph; ``runtime/ov_prefill.py``) and the bundle's prefill graph (its 4-bit layers with fp32 activations, where
    the bundle has one; ``runtime/graph_prefill.py``) if it measured at least 1.1x the target graph's speed on this
    device, once, cached (OpenVINO: 1.3-1.7x on an AVX-512 CPU, 0.85x on an AVX2 one, where the prefill graph ran
    1.09x); else the target graph in ONNX Runtime), "openvino" or "fp32" (an error where it cannot), or
    "onnxruntime".
    Every call, plain or speculative, prefills alike, so speculation stays exact either way.
    ``progress``: called with a line before and after what takes seconds on first use on a device (measuring its
    exactness verdict or step costs); None, silent (the commands print them).
    """

    threads: int | None = None
    spinning: bool = True
    provider: str = "cpu"
    gpu: GpuOptions = DEFAULT_GPU
    allow_inexact: bool = False
    reuse: bool = True
    prompt_cache_mb: float | None = None
    history: bool = True
    history_mb: float = DEFAULT_HISTORY_MB
    chat_template: str | None = None
    prefill: str = "auto"
    progress: Progress | None = None

    def with_keywords(self, keywords: dict) -> tuple[LoadSettings, dict]:
        """These settings with the ones ``keywords`` name (a field, or ``pad_to``/``cuda_graph`` of ``gpu``), and
        the keywords left over (the method's options)."""
        names = {f.name for f in fields(self)} - {"gpu"}
        own = {name: keywords[name] for name in names if name in keywords}
        gpu = {name: keywords[name] for name in GPU_KEYWORDS if name in keywords}
        rest = {name: value for name, value in keywords.items() if name not in own and name not in gpu}
        settings = replace(self, **own, **({"gpu": replace(self.gpu, **gpu)} if gpu else {}))
        return settings, rest

    def cache_mb(self) -> float:
        """``prompt_cache_mb`` checked: None is the default, else a number of megabytes >= 0."""
        value = self.prompt_cache_mb
        if value is None:
            return DEFAULT_MB
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 2**30:
            raise SpecdecError(
                f"prompt_cache_mb={value!r} is invalid: use a number of megabytes >= 0 (0 turns it off)."
            )
        return float(value)

    def history_store(self) -> HistoryStore | None:
        """The pipeline's history store (None: history off), checked to fit in memory first."""
        if not self.history:
            return None
        store = HistoryStore.of_mb(self.history_mb)
        check_history_memory(self.history_mb)
        return store


def check_history_memory(history_mb: float, stores: int = 1, *, flag: str = "history_mb") -> None:
    """Refuse, in one line and before anything is allocated, ``stores`` history stores of ``history_mb`` MiB each
    (the server keeps one per API key) that would not fit in the memory available now. ``flag``: how the size was
    given (the keyword, or the command line's ``--history-mb``), named in the error."""
    need = HistoryStore.bytes_of(history_mb) * stores
    memory = available_memory()
    if memory and need > memory:
        each = f" for each of {stores} API keys" if stores > 1 else ""
        off = "history=False" if flag == "history_mb" else "--no-history"
        raise SpecdecError(
            f"{flag} {history_mb:g} MiB{each} needs {need / 2**30:.1f} GiB of memory, more than the "
            f"{memory / 2**30:.1f} GiB available; give a smaller {flag} (or {off})."
        )
