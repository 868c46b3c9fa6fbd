"""The Python API: load a bundle once, then generate or stream text from it.

    from specdec_edge import Pipeline
    pipe = Pipeline.load("bundles/smollm2")
    print(pipe.generate("Why is the sky blue?", max_new_tokens=64).text)
    for piece in pipe.stream([{"role": "user", "content": "Hi!"}]):
        print(piece, end="", flush=True)

Light: numpy, onnxruntime, tokenizers, jinja2 only (no torch, no transformers).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Hashable, Iterator
from pathlib import Path

from specdec_edge.api.engines import Engines, open_engines
from specdec_edge.api.generation import Decoder, Generation, closed_error
from specdec_edge.api.request import (
    DEFAULT_MAX_NEW_TOKENS,
    MAX_CHARS_PER_TOKEN,
    Admitted,
    TooLong,
    admit,
    call_request,
    check_stops,
    history_for,
    prefix_ids,
)
from specdec_edge.api.request import encode as encode_prompt
from specdec_edge.api.settings import LoadSettings, check_history_memory
from specdec_edge.api.step_costs import CHAIN_WIDTHS, WIDTHS
from specdec_edge.api.streaming import GenerationResult, Stream, text_pieces
from specdec_edge.bundle.hashes import check_hashes
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.bundle.schema import Manifest
from specdec_edge.errors import SpecdecError
from specdec_edge.exactness import Decision, decide, default_runs_plain, describe, trees_allowed
from specdec_edge.runtime.threads import check_threads
from specdec_edge.sampling import SamplingParams
from specdec_edge.speculative.features import FeatureTap
from specdec_edge.speculative.history import HistoryStore
from specdec_edge.speculative.loop import Call
from specdec_edge.speculative.methods import Resources, default_method, get_method
from specdec_edge.speculative.stats import Stats
from specdec_edge.tokenizer import Tokenizer

__all__ = [
    "LoadSettings", "Pipeline", "Admitted", "TooLong", "MAX_CHARS_PER_TOKEN", "check_history_memory", "check_stops"
]  # fmt: skip
log = logging.getLogger("specdec_edge")


def _while_open(method):
    """A ``Pipeline`` method that refuses to run once the pipeline is closed (``closed_error``)."""

    @functools.wraps(method)
    def checked(self, *args, **keywords):
        if self.closed:
            raise closed_error()
        return method(self, *args, **keywords)

    return checked


class Pipeline:
    """One method over a loaded bundle's engines (``engines.Engines``), with the bundle's tokenizer.

    ``Pipeline.load`` opens a bundle; ``Pipeline(tokenizer, Engines(target, ...), method)`` runs engines opened
    by hand. Calls from several threads take turns on the engines one decode step at a time
    (``specdec_edge/api/generation.py``): a stream that is read slowly or dropped never blocks the others.
    ``close()`` (or ``with Pipeline.load(...) as pipe:``) frees the engines. ``engines`` (the target, draft, heads,
    verdict, capacity) and ``decoder`` (the engine the loop drives, the proposer, the rule) are the parts it runs.
    """

    def __init__(self, tokenizer: Tokenizer, engines: Engines, method: str, k: int | None = None,
                 options: dict | None = None, *, allow_inexact: bool = False, history: HistoryStore | None = None,
                 reuse: bool = True):  # fmt: skip
        spec = get_method(method)
        k = _check_k(spec, spec.default_k if k is None else k, engines)
        self.tokenizer, self.engines, self.method, self.k = tokenizer, engines, method, k
        self.options, self.allow_inexact = dict(options or {}), allow_inexact
        self.history = history  # earlier calls' text, for the methods that draft from it (None: off)
        self.reuse = reuse  # the calls' default: keep the KV prefix shared with earlier contexts (``stream``'s reuse)
        self.exactness, self.decoder = _method_decoder(engines, spec, k, self.options, allow_inexact, tokenizer)

    @classmethod
    def load(
        cls, bundle: str | Path, settings: LoadSettings | None = None, *, method=None, k=None, **keywords
    ) -> Pipeline:
        """Load ``bundle`` with ``settings`` (``LoadSettings``: threads, provider, GPU options, KV reuse and the prompt
        cache, history, ...); keywords named as its fields (or ``pad_to``, ``cuda_graph``) set them too, the others
        are the method's options, checked against the registry (e.g. pld: ``max_ngram``; eagle: ``topk``; medusa:
        ``tree``).
        ``method``: one of ``speculative.methods.METHODS``; default: the bundle's (`export --default-method`), else
        "auto", which chooses every step by the step costs measured on this device (``speculative/auto.py``).
        ``k``: the deepest proposal (default: the method's). "medusa-typical" is LOSSY when sampling."""
        settings, options = (settings or LoadSettings()).with_keywords(keywords)
        tokenizer, engines, method, store = _open(Path(bundle), settings, method, options)
        allow, reuse = settings.allow_inexact, settings.reuse
        return cls(tokenizer, engines, method, k, options, allow_inexact=allow, history=store, reuse=reuse)

    @_while_open
    def with_method(self, method: str, k: int | None = None, allow_inexact: bool | None = None, **options) -> Pipeline:
        """A pipeline over the same engines with another method (for comparisons); calls of both take turns;
        ``k`` defaults to the method's own."""
        allow = self.allow_inexact if allow_inexact is None else allow_inexact
        shared = {"history": self.history, "reuse": self.reuse}
        return Pipeline(self.tokenizer, self.engines, method, k, options, allow_inexact=allow, **shared)

    def new_history(self) -> HistoryStore | None:
        """An empty history store as large as this pipeline's (None when history is off): one per client
        (the server keeps one per API key)."""
        return None if self.history is None else HistoryStore(self.history.limit_bytes)

    @_while_open
    def save_prefix(self, path: str | Path, prompt: str | list[dict]) -> Path:
        """Compute the KV cache of ``prompt`` (text, or chat messages through the template: e.g. a long system
        prompt) and write it to ``path`` (atomically), keyed by this bundle and the prompt's token ids, so that
        ``load_prefix`` makes a later process start with it: a call whose prompt starts with it prefills only the
        rest. Messages are rendered without the assistant's turn start, as they begin a longer conversation.
        Providers cpu, cuda and tensorrt (engines that take KV snapshots: ``Engine.can_snapshot``)."""
        return self.engines.save_prefix(self.decoder.engine, prefix_ids(self.tokenizer, prompt, self.engines), path)

    @_while_open
    def load_prefix(self, path: str | Path) -> int:
        """Load a ``save_prefix`` file into the engines (and the prompt cache); returns its token count. A file
        saved for another bundle (or another export of this one), or damaged, is refused with a SpecdecError."""
        return self.engines.load_prefix(self.decoder.engine, path)

    @_while_open
    def warm_up(self) -> float:
        """Compile and check now the runtime that prefills long prompts (``LoadSettings.prefill``: OpenVINO, or the
        bundle's prefill graph), which a first prompt of 64+ tokens would otherwise wait for (~4 s on a 2-core CPU).
        The caches are left empty; the output of every call is unchanged. Returns the seconds it took (0: nothing to
        do). ``serve`` calls it before it listens."""
        return self.engines.warm_up()

    def describe_exactness(self) -> str:
        """One line: what this device's exactness verdict lets run, and whether this method runs inexactly."""
        line = describe(self.engines.verdict, self.engines.target.graph.dtype)
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
        """Prompt ids: plain text as is, chat messages through the bundle's chat template (``request.encode``)."""
        return encode_prompt(self.tokenizer, prompt, self.engines.capacity)

    def admit(
        self, prompt: str | list[dict], max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS, stop=None
    ) -> Admitted:
        """``prompt`` tokenized once, ``stop`` checked, and the prompt with ``max_new_tokens`` new tokens (None: as
        many as fit after it) measured once against the KV cache (``request.admit``): an ``Admitted`` that ``stream``
        and ``generate`` run as it is. A ``TooLong`` (a SpecdecError) where they do not fit. The server admits each
        request before it queues it; ``stream`` and ``generate`` admit text and messages themselves."""
        return admit(self.tokenizer, prompt, max_new_tokens, stop, self.engines.capacity)

    @_while_open
    def stream(
        self,
        prompt: str | list[dict] | Admitted,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        *,
        stop=None,
        reuse: bool | None = None,
        history: bool | HistoryStore = True,
        owner: Hashable = None,
        **sampling,
    ) -> Stream:
        """Like ``generate`` but yields text pieces as tokens are accepted.

        Generation runs as the stream is read. ``stream.cancel()`` (any thread) or ``close()`` stops it and frees
        the engines at once; a stream dropped or read slowly never blocks other calls: after a short lease they take
        the engines, and it goes on later where it was (``api/generation.py``). Keywords: as for ``generate``."""
        params = SamplingParams(**sampling)
        request = call_request(self.tokenizer, prompt, max_new_tokens, stop, self.engines.capacity)
        result = GenerationResult("", [], Stats(), None)
        d, store, reuse = self.decoder, history_for(history, self.history), self.reuse if reuse is None else reuse
        call = Call(request.max_new_tokens, params, d.k, d.eos_ids, d.rule, bool(reuse), store)
        generation = Generation(d, list(request.ids), call, result.stats, owner)
        return Stream(_text(generation, self.tokenizer, list(request.stops), result), result, generation.cancel)

    def generate(
        self, prompt: str | list[dict] | Admitted, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **keywords
    ) -> GenerationResult:
        """Generate text after ``prompt`` (a string, chat messages [{'role', 'content'}, ...], or an ``Admitted`` that
        ``admit`` made, which brings its own ``max_new_tokens`` and ``stop``).

        ``temperature`` (0, greedy), ``top_k``, ``top_p``, ``seed``: how to sample (``SamplingParams``); the output
        equals the target's alone (greedy: the same tokens; sampling: the same distribution). Generation ends at
        eos, a ``stop`` string (or list; not included in the text), or ``max_new_tokens`` (default 128).
        ``reuse`` (default: the pipeline's, ``LoadSettings.reuse``, on unless turned off): the engines keep the last
        call's context, and a prompt that starts with part of it rolls the caches back to the common prefix and
        prefills only the rest (``stats.reused_tokens``; docs/DESIGN.md for when that equals a fresh prefill bit for
        bit); False prefills the whole prompt.
        ``history``: True drafts from (and adds this call to) the pipeline's history, a ``HistoryStore`` from (and
        to) that one, False from none. ``owner``: whose call this is (the server passes the API key's): a call
        reuses, restores and is timed against only its own owner's contexts (``Engines.claim``).
        """
        with self.stream(prompt, max_new_tokens, **keywords) as stream:
            for _ in stream:
                pass
        return stream.result


def _text(generation: Generation, tokenizer: Tokenizer, stops: list[str], result: GenerationResult) -> Iterator[str]:
    """The streamed text of one generation."""
    try:
        yield from text_pieces(generation, tokenizer, stops, result)
    finally:
        generation.close()


def _open(root: Path, settings: LoadSettings, method: str | None, options: dict) -> tuple:
    """The tokenizer, engines, method (the bundle's default where None) and history store of the bundle at
    ``root``, loaded with ``settings``; everything that can be refused is checked before the engines load."""
    manifest = read_manifest(root)
    check_hashes(root, manifest)  # once per file version; a damaged file is named before ONNX Runtime reads it
    cpu = check_threads(settings.threads, settings.spinning)
    _check_method(method or default_method(manifest.default_method), manifest, root, options)
    engines = open_engines(
        root, manifest, provider=settings.provider, cpu=cpu, gpu=settings.gpu, progress=settings.progress,
        prompt_cache_mb=settings.cache_mb(), prefill=settings.prefill,
    )  # fmt: skip
    if method is None:  # the default must run: plain where speculation would not be exact on this device
        method = "plain" if default_runs_plain(engines.verdict) else default_method(manifest.default_method)
    tokenizer = Tokenizer.from_bundle(root, manifest.tokenizer, settings.chat_template)
    return tokenizer, engines, method, settings.history_store()


def _check_k(spec, k, engines: Engines) -> int:
    """``k`` of the method ``spec``, refused (with what to do) where the engines lack what the method needs or ``k``
    is not a speculation length."""
    problem = spec.missing(engines.draft is not None, engines.heads)
    if problem:
        raise SpecdecError(problem)
    if spec.speculative and not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
        raise SpecdecError(f"k={k!r} is invalid: the speculation length must be an integer >= 1.")
    return k


def _check_method(method: str, manifest: Manifest, root: Path, options: dict) -> None:
    """Refuse a method the bundle cannot run, or a bad option, before the engines load."""
    spec = get_method(method)
    problem = spec.missing(manifest.draft is not None, list(manifest.heads), f"bundle {root}")
    if problem:
        raise SpecdecError(problem)
    spec.check_options(options)


def _method_decoder(
    engines: Engines, spec, k: int, options: dict, allow_inexact: bool, tokenizer
) -> tuple[Decision, Decoder]:
    """The exactness decision of the method ``spec`` on ``engines`` (``exactness.py``; refused, naming the
    fixes, where it would not be exact and ``allow_inexact`` is off) and its ``Decoder``."""
    verdict, dtype = engines.verdict, engines.target.graph.dtype
    decision = decide(verdict, dtype, speculative=spec.speculative, allow_inexact=allow_inexact)
    proposer_options, rule_options = spec.check_options(options)
    # The engine the decode loop drives: head methods read the target's features through a tap.
    engine = FeatureTap(engines.target) if spec.taps_features(engines.heads) else engines.target
    trees = trees_allowed(verdict, dtype, allow_inexact)

    def costs(proposers):  # auto's step costs of this device (cached, else measured now); chains' widths only
        return engines.step_costs(engine, proposers, WIDTHS if trees else CHAIN_WIDTHS)  # ... where trees are refused

    # history=True: the calls may pass a history store (``Generation`` passes its own to the proposers' prefill)
    resources = Resources(
        engine, engines.draft, engines.heads, trees=trees, costs=costs, history=True, table=engines.table
    )
    proposer = spec.build(resources, proposer_options)
    if proposer.branches:  # refused (naming the fixes) where trees are not exact
        decision = decide(verdict, dtype, speculative=True, branches=True, allow_inexact=allow_inexact)
    if decision.note:
        log.warning("method %s: %s", spec.name, decision.note) if decision.inexact else log.info("%s", decision.note)
    return decision, engines.decoder(engine, proposer, spec.acceptance(rule_options), k, tokenizer.eos_token_ids)
