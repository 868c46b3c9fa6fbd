"""The Python API: load a bundle once, then generate or stream text from it.

    from specdec_edge import Pipeline
    pipe = Pipeline.load("bundles/smollm2")
    print(pipe.generate("Why is the sky blue?", max_new_tokens=64).text)
    for piece in pipe.stream([{"role": "user", "content": "Hi!"}]):
        print(piece, end="", flush=True)

Light: numpy, onnxruntime, tokenizers, jinja2 only (no torch, no transformers).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

from specdec_edge.api.engines import Engines, open_engines
from specdec_edge.api.generation import Generation, closed_error
from specdec_edge.api.prompt_cache import DEFAULT_MB, load_prefix, save_prefix
from specdec_edge.api.streaming import MAX_STOP_CHARS, MAX_STOPS, GenerationResult, Stream, text_pieces
from specdec_edge.bundle.hashes import check_hashes
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.bundle.schema import Manifest
from specdec_edge.errors import SpecdecError
from specdec_edge.exactness import decide, default_runs_plain, describe, trees_allowed
from specdec_edge.progress import Progress
from specdec_edge.runtime.base import GpuOptions
from specdec_edge.runtime.threads import check_threads
from specdec_edge.sampling import SamplingParams
from specdec_edge.speculative.features import FeatureTap
from specdec_edge.speculative.history import DEFAULT_HISTORY_MB, HistorySlot, HistoryStore
from specdec_edge.speculative.methods import Resources, default_method, get_method
from specdec_edge.speculative.stats import Stats
from specdec_edge.tokenizer import Tokenizer

__all__ = ["Pipeline"]
log = logging.getLogger("specdec_edge")
MAX_CHARS_PER_TOKEN = 64  # a prompt longer than this many characters per token of the KV cache cannot fit


class Pipeline:
    """One method over a loaded bundle's engines (``engines.Engines``), with the bundle's tokenizer.

    ``Pipeline.load`` opens a bundle; ``Pipeline(tokenizer, Engines(target, ...), method)`` runs engines opened
    by hand. Calls from several threads take turns on the engines one decode step at a time
    (``specdec_edge/api/generation.py``): a stream that is read slowly or dropped never blocks the others.
    ``close()`` (or ``with Pipeline.load(...) as pipe:``) frees the engines.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        engines: Engines,
        method: str,
        k: int | None = None,
        options: dict | None = None,
        *,
        allow_inexact: bool = False,
        history: HistoryStore | None = None,
    ):
        spec = get_method(method)
        k = spec.default_k if k is None else k
        problem = spec.missing(engines.draft is not None, engines.heads)
        if problem:
            raise SpecdecError(problem)
        if spec.speculative and not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
            raise SpecdecError(f"k={k!r} is invalid: the speculation length must be an integer >= 1.")
        self.tokenizer, self.engines, self.method, self.k = tokenizer, engines, method, k
        self.options, self.allow_inexact = dict(options or {}), allow_inexact
        self.history = history  # earlier calls' text, for the methods that draft from it (None: off)
        self.exactness, self._decoder = _method_decoder(engines, spec, k, self.options, allow_inexact, tokenizer)
        if self.exactness.note:
            note = self.exactness.note
            log.warning("method %s: %s", method, note) if self.exactness.inexact else log.info("%s", note)

    @classmethod
    def load(
        cls,
        bundle: str | Path,
        *,
        method: str | None = None,
        k: int | None = None,
        threads: int | None = None,
        provider: str = "cpu",
        spinning: bool = True,
        allow_inexact: bool = False,
        pad_to: int | None = None,
        cuda_graph: bool = False,
        chat_template: str | None = None,
        progress: Progress | None = None,
        prompt_cache_mb: float | None = None,
        history: bool = True,
        history_mb: float = DEFAULT_HISTORY_MB,
        **options,
    ) -> Pipeline:
        """Load ``bundle``.

        ``method``: one of ``speculative.methods.METHODS`` (auto, plain, draft, pld, history, lookahead,
        eagle, medusa, medusa-typical, pld-eagle, eagle3, pld-eagle3); default: the one the bundle records
        (`export --default-method`), else "auto", which chooses every step among what the bundle can run by
        the step costs measured on this device (once per bundle, provider, device and threads;
        ``speculative/auto.py``). ``k`` is the speculation length (the deepest proposal; default:
        the method's, 6 for auto, 8 for history and 4 for the others). ``options`` are the method's options,
        checked against the registry (e.g. pld: ``max_ngram``, ``min_ngram``; lookahead: ``window``, ``ngram``,
        ``guesses``; eagle: ``topk``, ``nodes``, ``depth``; medusa: ``tree``; medusa-typical also
        ``epsilon``, ``delta``); head methods default to the tree settings the manifest records.
        "medusa-typical" is LOSSY when sampling (greedy stays exact).
        ``threads``: CPU threads (None: one per physical core). ``spinning`` (default): every CPU
        session of the process shares one spinning thread pool, the fastest measured; False gives
        each session a pool that sleeps between ops, leaving the CPU idle (``runtime/threads.py``).
        ``provider``: "cpu", "cuda" (ONNX Runtime CUDA EP), "tensorrt" (ONNX Runtime TensorRT EP) or
        "trt" / "trt-rtx" (TensorRT / TensorRT-RTX engines from `specdec-edge build-engines`); see
        ``runtime/factory.py``.
        ``allow_inexact``: permit speculation that the device's exactness verdict does not vouch for
        (``exactness.py``: a target that is not batch invariant on this device, or token trees on a quantized
        target whose tree rows round differently), whose output may then differ from plain decoding. The
        verdict is the export machine's on that machine; on any other device (CPU model or features,
        provider, GPU, ONNX Runtime version, threads) it is measured on first use, in seconds, and cached
        (``runtime/verdicts.py``).
        ``pad_to``: GPU providers pad every narrower pass to this many rows so that speculative and
        plain decoding round alike (default 32; 0 turns it off; see ``runtime/ort_gpu_engine.py``).
        ``cuda_graph`` (provider "cuda"): decode passes run as one fixed-shape pass that ONNX Runtime
        captures once as a CUDA graph and replays (bundles exported with the ``ort`` flavour by this version).
        ``chat_template``: a Jinja chat template that replaces the bundle's (``tokenizer.read_chat_template``
        reads one from a file); a base model's bundle has none, and then takes plain text only.
        ``progress``: called with a line before and after what takes seconds on first use on a device
        (measuring its exactness verdict or step costs); default None, silent (the commands print them).
        ``prompt_cache_mb``: host memory for snapshots of earlier contexts (default
        ``prompt_cache.DEFAULT_MB``; 0: none), restored when a call shares more with one of them than with the
        context the engines hold (``prompt_cache.py``; the ``cpu`` backend).
        ``history``: keep the prompts and outputs of earlier calls (at most ``history_mb`` MiB, the oldest
        dropped first) for the methods that draft from them (``auto``, ``history``;
        ``speculative/history.py``); False keeps nothing. The output is the same either way, only faster.
        """
        root = Path(bundle)
        manifest = read_manifest(root)
        check_hashes(root, manifest)  # once per file version; a damaged file is named before ONNX Runtime reads it
        cpu = check_threads(threads, spinning)
        _check_method(method or default_method(manifest.default_method), manifest, root, options)
        gpu = GpuOptions(pad_to, cuda_graph)
        cache_mb = check_cache_mb(prompt_cache_mb)
        engines = open_engines(
            root, manifest, provider=provider, cpu=cpu, gpu=gpu, progress=progress, prompt_cache_mb=cache_mb
        )
        if method is None:  # the default must run: plain where speculation would not be exact on this device
            method = "plain" if default_runs_plain(engines.verdict) else default_method(manifest.default_method)
        tokenizer = Tokenizer.from_bundle(root, manifest.tokenizer, chat_template)
        store = HistoryStore.of_mb(history_mb) if history else None
        return cls(tokenizer, engines, method, k, options, allow_inexact=allow_inexact, history=store)

    def with_method(self, method: str, k: int | None = None, allow_inexact: bool | None = None, **options) -> Pipeline:
        """A pipeline over the same engines with another method (for comparisons); calls of both take turns;
        ``k`` defaults to the method's own."""
        if self.closed:
            raise closed_error()
        allow = self.allow_inexact if allow_inexact is None else allow_inexact
        return Pipeline(self.tokenizer, self.engines, method, k, options, allow_inexact=allow, history=self.history)

    def new_history(self) -> HistoryStore | None:
        """An empty history store as large as this pipeline's (None when history is off): one per client
        (the server keeps one per API key)."""
        return None if self.history is None else HistoryStore(self.history.limit_bytes)

    # What tests and tools read of the engines and the method (None once closed).
    target = property(lambda self: self.engines.target)
    draft = property(lambda self: self.engines.draft)
    heads = property(lambda self: self.engines.heads)
    verdict = property(lambda self: self.engines.verdict)
    capacity = property(lambda self: self.engines.capacity)
    engine = property(lambda self: self._decoder.engine, doc="the engine the decode loop drives")
    proposer = property(lambda self: self._decoder.proposer)
    rule = property(lambda self: self._decoder.rule)
    history_slot = property(lambda self: self._decoder.history_slot, doc="the store the running call drafts from")

    def save_prefix(self, path: str | Path, prompt: str | list[dict]) -> Path:
        """Compute the KV cache of ``prompt`` (text, or chat messages through the template: e.g. a long system
        prompt) and write it to ``path`` (atomically), keyed by this bundle and the prompt's token ids, so that
        ``load_prefix`` makes a later process start with it: a call whose prompt starts with it prefills only the
        rest. Messages are rendered without the assistant's turn start, as they begin a longer conversation.
        Providers cpu, cuda and tensorrt (engines that take KV snapshots: ``Engine.can_snapshot``)."""
        if self.closed:
            raise closed_error()
        ids = self.encode(prompt)  # the checks; messages again without the generation prompt
        if not isinstance(prompt, str):
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=False)
            ids = self.tokenizer.encode(text, add_special_tokens=False) or ids
        return save_prefix(self.engines, self.engine, ids, path)

    def load_prefix(self, path: str | Path) -> int:
        """Load a ``save_prefix`` file into the engines (and the prompt cache); returns its token count. A file
        saved for another bundle (or another export of this one), or damaged, is refused with a SpecdecError."""
        if self.closed:
            raise closed_error()
        return load_prefix(self.engines, self.engine, path)

    def describe_exactness(self) -> str:
        """One line: what this device's exactness verdict lets run, and whether this method runs inexactly."""
        line = describe(self.verdict, self.target.graph.dtype)
        return line + (f"; {self.method}: {self.exactness.note}" if self.exactness.note else "")

    @property
    def closed(self) -> bool:
        return self.engines.closed

    def close(self) -> None:
        """Free the engines now (they are shared with the pipelines ``with_method`` made: those close too).

        A step running in another thread ends first; streams still open then end with finish_reason
        "cancelled", and later calls are an error. Safe to call twice, from any thread.
        """
        self.engines.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encode(self, prompt: str | list[dict]) -> list[int]:
        """Prompt ids: plain text as is, chat messages through the bundle's chat template.

        Text longer than ``MAX_CHARS_PER_TOKEN`` characters per token of the KV cache cannot fit in it
        (tokenizers rarely make tokens that long): it is refused before it is tokenized."""
        chars = len(prompt) if isinstance(prompt, str) else _content_chars(prompt)
        if chars > MAX_CHARS_PER_TOKEN * self.capacity:
            raise SpecdecError(
                f"the prompt has {chars} characters, more than the {MAX_CHARS_PER_TOKEN * self.capacity} that can "
                f"fit in the KV cache capacity of {self.capacity} tokens; shorten it."
            )
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(prompt), add_special_tokens=False)
        if not ids:
            raise SpecdecError("the prompt encodes to no tokens; give some text.")
        return ids

    def stream(
        self,
        prompt: str | list[dict],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        reuse: bool = True,
        history: bool | HistoryStore = True,
    ) -> Stream:
        """Like ``generate`` but yields text pieces as tokens are accepted.

        Generation runs as the stream is read. ``stream.cancel()`` (from any thread) or ``close()``
        stops it and frees the engines at once; a stream that is dropped or read slowly never blocks
        other calls: after a short lease they take the engines, and the stream, if read again, goes on
        where it was (``specdec_edge/api/generation.py``).
        ``reuse``: as for ``generate``. ``history``: True drafts from (and adds this call to) the pipeline's
        history, a ``HistoryStore`` from (and to) that one, False from none.
        """
        if self.closed:
            raise closed_error()
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SpecdecError(f"max_new_tokens={max_new_tokens!r} is invalid: use an integer >= 1.")
        stops = check_stops(stop)
        ids = self.encode(prompt)
        if len(ids) + max_new_tokens > self.capacity:
            raise SpecdecError(
                f"the prompt has {len(ids)} tokens and max_new_tokens is {max_new_tokens}: {len(ids) + max_new_tokens} "
                f"exceeds the KV cache capacity of {self.capacity} tokens; shorten the prompt (or the chat "
                "history), lower max_new_tokens, or re-export the bundle with a larger --capacity."
            )
        result = GenerationResult("", [], Stats(), None)
        store = self._history_for(history)
        generation = Generation(self._decoder, ids, params, max_new_tokens, result.stats, bool(reuse), store)
        return Stream(self._text(generation, stops, result), result, generation.cancel)

    def generate(
        self,
        prompt: str | list[dict],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        reuse: bool = True,
        history: bool | HistoryStore = True,
    ) -> GenerationResult:
        """Generate text after ``prompt`` (a string, or chat messages [{'role', 'content'}, ...]).

        temperature 0 is greedy; the output equals the target's alone (greedy: the same
        tokens; sampling: the same distribution). Generation ends at eos, a ``stop``
        string (not included in the text), or ``max_new_tokens``. ``history``: as for ``stream``.

        ``reuse`` (default): the engines keep the last call's context, and a prompt that starts with part of it
        (the next turn of a chat, the same system prompt) rolls the caches back to the common prefix and prefills
        only the rest (``stats.reused_tokens``); False prefills the whole prompt, as a first call does. Greedy
        output with reuse equals plain decoding's with reuse; whether it also equals a fresh prefill's bit for bit
        depends on the bundle (``info``: the verdict's ``reuse_matches_prefill``; docs/DESIGN.md).
        """
        stream = self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, reuse, history)
        with stream:
            for _ in stream:
                pass
        return stream.result

    def _history_for(self, history) -> HistoryStore | None:
        if isinstance(history, HistoryStore):
            return history
        if isinstance(history, bool):
            return self.history if history else None
        raise SpecdecError(f"history={_short(history)} is invalid: use True, False or a HistoryStore.")

    def _text(self, generation: Generation, stops: list[str], result: GenerationResult) -> Iterator[str]:
        """The streamed text of one generation."""
        try:
            yield from text_pieces(generation, self.tokenizer, stops, result)
        finally:
            generation.close()


def _check_method(method: str, manifest: Manifest, root: Path, options: dict) -> None:
    """Refuse a method the bundle cannot run, or a bad option, before the engines load."""
    spec = get_method(method)
    problem = spec.missing(manifest.draft is not None, list(manifest.heads), f"bundle {root}")
    if problem:
        raise SpecdecError(problem)
    spec.check_options(options)


def _method_decoder(engines: Engines, spec, k: int, options: dict, allow_inexact: bool, tokenizer) -> tuple:
    """The exactness decision of the method ``spec`` on ``engines`` (``exactness.py``; refused, naming the
    fixes, where it would not be exact and ``allow_inexact`` is off) and its ``Decoder``."""
    verdict, dtype = engines.verdict, engines.target.graph.dtype
    decision = decide(verdict, dtype, speculative=spec.speculative, allow_inexact=allow_inexact)
    proposer_options, rule_options = spec.check_options(options)
    # The engine the decode loop drives: head methods read the target's features through a tap.
    engine = FeatureTap(engines.target) if spec.taps_features(engines.heads) else engines.target
    trees = trees_allowed(verdict, dtype, allow_inexact)

    def costs(proposers):  # auto's step costs of this device (cached, else measured now)
        return engines.step_costs(engine, proposers)

    slot = HistorySlot()  # which history store the call running now drafts from (``generation.py`` sets it)
    resources = Resources(engine, engines.draft, engines.heads, trees=trees, costs=costs, history=slot)
    proposer = spec.build(resources, proposer_options)
    if proposer.branches:  # refused (naming the fixes) where trees are not exact
        decision = decide(verdict, dtype, speculative=True, branches=True, allow_inexact=allow_inexact)
    decoder = engines.decoder(engine, proposer, spec.acceptance(rule_options), k, tokenizer.eos_token_ids)
    decoder.history_slot = slot
    return decision, decoder


def check_cache_mb(value) -> float:
    """``prompt_cache_mb`` checked: None is the default, else a number of megabytes >= 0."""
    if value is None:
        return DEFAULT_MB
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 2**30:
        raise SpecdecError(f"prompt_cache_mb={value!r} is invalid: use a number of megabytes >= 0 (0 turns it off).")
    return float(value)


def _content_chars(messages) -> int:
    """Characters of the messages' contents (0 for a value that is not a list of messages: refused later)."""
    if not isinstance(messages, list):
        return 0
    return sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))


def check_stops(stop) -> list[str]:
    """``stop`` (None, a string or a sequence of strings) as a list, or an error naming the bad value."""
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return []
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise SpecdecError(f"stop={_short(stop)} is invalid: use a string or a list of strings.")
    if len(stops) > MAX_STOPS:
        raise SpecdecError(f"stop has {len(stops)} strings, more than the limit of {MAX_STOPS}; give fewer.")
    if longest := max(stops, key=len, default=""):
        if len(longest) > MAX_STOP_CHARS:
            raise SpecdecError(
                f"a stop string has {len(longest)} characters, more than the limit of {MAX_STOP_CHARS}; "
                "give a shorter one."
            )
    return list(stops)


def _short(value, most: int = 80) -> str:
    """``repr(value)``, cut to ``most`` characters (a message stays one short line)."""
    text = repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."
