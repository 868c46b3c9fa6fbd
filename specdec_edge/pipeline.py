"""The Python API: load a bundle once, then generate or stream text from it.

    from specdec_edge import Pipeline
    pipe = Pipeline.load("bundles/smollm2")
    print(pipe.generate("Why is the sky blue?", max_new_tokens=64).text)
    for piece in pipe.stream([{"role": "user", "content": "Hi!"}]):
        print(piece, end="", flush=True)

Light: numpy, onnxruntime, tokenizers, jinja2 only (no torch, no transformers).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec_edge.bundle import read_manifest
from specdec_edge.errors import SpecdecError
from specdec_edge.runtime import OrtEngine, open_engine
from specdec_edge.sampling import SamplingParams, make_rng
from specdec_edge.speculative.heads import EagleProposer, FeatureTap, MedusaProposer, load_head_graphs
from specdec_edge.speculative.loop import decode
from specdec_edge.speculative.lookahead import LookaheadProposer
from specdec_edge.speculative.lookup import PromptLookupProposer
from specdec_edge.speculative.proposers import DraftModelProposer, EmptyProposer, FirstOfProposer
from specdec_edge.speculative.stats import Stats
from specdec_edge.tokenizer import Tokenizer

METHODS = ("plain", "draft", "pld", "lookahead", "eagle", "medusa", "medusa-typical", "pld-eagle")
PLD_OPTIONS = ("max_ngram", "min_ngram")
# Methods whose output, when sampling, does not follow the target's distribution (greedy stays exact).
LOSSY_METHODS = ("medusa-typical",)
TYPICAL_OPTIONS = ("epsilon", "delta")  # medusa-typical's acceptance options (the rest go to the proposer)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens: without a final eos; up to the one that completes a stop string
    stats: Stats
    finish_reason: str | None  # "eos" | "length" | "stop" | "cancelled"; None while streaming


class StopFilter:
    """Holds back text that could be the start of a stop string, and cuts at the first one found."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return ``(text safe to emit, stop string found)``."""
        text = self.held + text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return text[: min(hits)], True
        keep = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


class Stream:
    """Text pieces as tokens are accepted; ``result`` is complete once iteration ends.

    ``close()`` (from the iterating thread) or ``cancel()`` (from any thread) stops
    generation; either way the pipeline is free for the next call.
    """

    def __init__(self, pipeline: "Pipeline", prompt_ids: list[int], stops: Sequence[str], params: SamplingParams,
                 max_new_tokens: int):
        self.result = GenerationResult("", [], Stats(), None)
        self._cancel = threading.Event()
        self._pieces = pipeline._pieces(prompt_ids, stops, params, max_new_tokens, self.result, self._cancel)

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def cancel(self) -> None:
        self._cancel.set()

    def close(self) -> None:
        self._pieces.close()
        if self.result.finish_reason is None:
            self.result.finish_reason = "cancelled"

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_proposer(method: str, draft: OrtEngine | None, options: dict, target: OrtEngine | None = None,
                  heads: dict | None = None):
    """The proposer object of one method (see speculative/); head methods also need the target and its heads."""
    if method == "plain":
        return EmptyProposer()
    if method == "draft":
        return DraftModelProposer(draft)
    if method == "pld":
        return PromptLookupProposer(**options)
    if method == "lookahead":
        return LookaheadProposer(**options)
    if method == "pld-eagle":  # prompt lookup when an n-gram of 2+ tokens repeats, else EAGLE
        pld = PromptLookupProposer(**{"min_ngram": 2, **{k: v for k, v in options.items() if k in PLD_OPTIONS}})
        eagle = make_proposer("eagle", draft, {k: v for k, v in options.items() if k not in PLD_OPTIONS}, target, heads)
        return FirstOfProposer(pld, eagle)
    if method in ("eagle", "medusa", "medusa-typical"):
        kind = method.split("-")[0]
        if kind not in (heads or {}):
            raise SpecdecError(f"this bundle has no {kind} heads; train them with `specdec-edge train-draft "
                               f"--method {kind}` and export with --heads, or use method 'pld'.")
        proposer = EagleProposer if kind == "eagle" else MedusaProposer
        options = {**heads[kind].defaults, **{k: v for k, v in options.items() if k not in TYPICAL_OPTIONS}}
        return proposer(heads[kind], FeatureTap(target), **options)
    raise SpecdecError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}.")


def check_method(method: str, has_draft: bool, bundle: Path | None = None) -> None:
    """Refuse an unknown method, or "draft" without a draft model, with what to use instead."""
    if method not in METHODS:
        raise SpecdecError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}.")
    if method == "draft" and not has_draft:
        where = f"bundle {bundle}" if bundle else "this bundle"
        raise SpecdecError(f"{where} has no draft model; use method 'pld' or 'plain', or export with --draft.")


def typical_options(options: dict) -> dict:
    """medusa-typical's ``epsilon`` and ``delta`` from the method options, checked: positive numbers."""
    out = {}
    for key in TYPICAL_OPTIONS:
        if key in options:
            try:
                out[key] = float(options[key])
            except (TypeError, ValueError):
                out[key] = float("nan")
            if not out[key] > 0:
                raise SpecdecError(f"medusa-typical option {key}={options[key]!r} is invalid: use a number > 0 "
                                   "(defaults: epsilon=0.09, delta=0.3).")
    return out


class Pipeline:
    """A loaded bundle: target engine, proposer and tokenizer. Calls are serialized by a lock."""

    def __init__(self, tokenizer: Tokenizer, target: OrtEngine, draft: OrtEngine | None, method: str, k: int,
                 options: dict | None = None, lock: threading.Lock | None = None, heads: dict | None = None,
                 allow_inexact: bool = False):
        check_method(method, draft is not None)
        if method != "plain" and not (isinstance(k, int) and k >= 1):
            raise SpecdecError(f"k={k!r} is invalid: the speculation length must be an integer >= 1.")
        graph = getattr(target, "graph", None)
        if method != "plain" and not getattr(graph, "batch_invariant", True) and not allow_inexact:
            raise SpecdecError(
                f"this bundle's {graph.dtype} target quantizes activations per pass, so verifying several tokens "
                "at once can change its output: speculative decoding would not be exact. Use an fp32/fp16 "
                "bundle, method 'plain', or allow_inexact=True (--allow-inexact) to accept the difference."
            )
        self.allow_inexact = allow_inexact
        self.tokenizer = tokenizer
        self.target = target
        self.draft = draft
        self.method = method
        self.k = k
        self.options = dict(options or {})
        self.heads = heads or {}
        self.typical = typical_options(self.options) if method in LOSSY_METHODS else None
        try:
            self.proposer = make_proposer(method, draft, self.options, target, self.heads)
        except TypeError as e:
            raise SpecdecError(f"bad option for method {method!r}: {e}") from None
        self.capacity = min(e.capacity for e in (target, draft) if e is not None)
        self._lock = lock or threading.Lock()

    @classmethod
    def load(cls, bundle: str | Path, *, method: str | None = None, k: int = 4, threads: int | None = None,
             provider: str = "cpu", allow_inexact: bool = False, pad_to: int | None = None,
             **options) -> "Pipeline":
        """Load ``bundle``.

        ``method``: "draft" (default when the bundle has a draft model), "pld" (prompt
        lookup), "lookahead", "eagle", "medusa", "pld-eagle", "medusa-typical" or "plain". ``k`` is the
        speculation length (the deepest proposal); ``options`` go to the method's proposer (pld:
        ``max_ngram``, ``min_ngram``; lookahead: ``window``, ``ngram``, ``guesses``; eagle:
        ``topk``, ``nodes``, ``depth``; medusa: ``tree``; defaults: the tree settings the bundle's
        manifest records). "pld-eagle" proposes by prompt lookup where an n-gram of 2+ tokens
        repeats (``min_ngram``, ``max_ngram``) and by EAGLE elsewhere; a bundle with trained heads
        defaults to the method its manifest names (pld-eagle with EAGLE heads). "medusa-typical" is
        Medusa with typical acceptance (options ``epsilon``, ``delta``): LOSSY when sampling --
        more accepted tokens, but the output no longer follows the target's distribution; greedy
        stays exact.
        ``provider``: "cpu", "cuda" (ONNX Runtime CUDA EP), "tensorrt" (ONNX Runtime TensorRT EP) or
        "trt" (TensorRT engines from `specdec-edge build-engines`); see ``runtime/providers.py``.
        ``allow_inexact``: permit speculation on int8/int4 bundles, whose batched verification
        can change the output (see GraphSpec.batch_invariant).
        ``pad_to``: GPU providers pad every narrower pass to this many rows so that speculative and
        plain decoding round alike (default 32; 0 turns it off; see ``runtime/cuda_engine.py``).
        """
        root = Path(bundle)
        manifest = read_manifest(root)
        heads = manifest.heads or {}
        method = method or heads.get("default") or ("draft" if manifest.draft is not None else "plain")
        check_method(method, manifest.draft is not None, root)  # before the engines load
        share = manifest.draft is not None or bool(heads)  # several sessions in one process: no spinning pools
        target = open_engine(root, manifest.target.graph, provider=provider, threads=threads, share_process=share,
                             pad_to=pad_to)
        draft = None
        if manifest.draft is not None:
            draft = open_engine(root, manifest.draft.graph, provider=provider, threads=threads, share_process=True,
                                role="draft", pad_to=pad_to)
        return cls(Tokenizer.from_bundle(root, manifest.tokenizer), target, draft, method, k, options,
                   heads=load_head_graphs(root, heads, threads), allow_inexact=allow_inexact)

    def with_method(self, method: str, k: int | None = None, allow_inexact: bool | None = None,
                    **options) -> "Pipeline":
        """A pipeline over the same engines and lock with another method (for comparisons)."""
        return Pipeline(self.tokenizer, self.target, self.draft, method, self.k if k is None else k, options,
                        self._lock, self.heads, self.allow_inexact if allow_inexact is None else allow_inexact)

    def encode(self, prompt: str | list[dict]) -> list[int]:
        """Prompt ids: plain text as is, chat messages through the bundle's chat template."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(prompt), add_special_tokens=False)
        if not ids:
            raise SpecdecError("the prompt encodes to no tokens; give some text.")
        return ids

    def stream(self, prompt: str | list[dict], max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop: str | Sequence[str] | None = None) -> Stream:
        """Like ``generate`` but yields text pieces as tokens are accepted."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        ids = self.encode(prompt)
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
            raise SpecdecError(f"max_new_tokens={max_new_tokens!r} is invalid: use an integer >= 1.")
        if len(ids) + max_new_tokens > self.capacity:
            raise SpecdecError(
                f"the prompt has {len(ids)} tokens and max_new_tokens is {max_new_tokens}: {len(ids) + max_new_tokens} "
                f"exceeds the KV cache capacity of {self.capacity} tokens; shorten the prompt (or the chat "
                "history), lower max_new_tokens, or re-export the bundle with a larger --capacity."
            )
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        return Stream(self, ids, stops, params, max_new_tokens)

    def generate(self, prompt: str | list[dict], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: str | Sequence[str] | None = None) -> GenerationResult:
        """Generate text after ``prompt`` (a string, or chat messages [{'role', 'content'}, ...]).

        temperature 0 is greedy; the output equals the target's alone (greedy: the same
        tokens; sampling: the same distribution). Generation ends at eos, a ``stop``
        string (not included in the text), or ``max_new_tokens``.
        """
        stream = self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop)
        for _ in stream:
            pass
        return stream.result

    def _pieces(self, prompt_ids: list[int], stops: Sequence[str], params: SamplingParams, max_new_tokens: int,
                result: GenerationResult, cancel: threading.Event) -> Iterator[str]:
        with self._lock:
            decoder = self.tokenizer.decoder()
            stop_filter = StopFilter(stops)
            target = getattr(self.proposer, "tap", self.target)  # head methods read the target's features
            steps = decode(target, self.proposer, prompt_ids, max_new_tokens=max_new_tokens, params=params,
                           k=0 if self.method == "plain" else self.k, eos_ids=self.tokenizer.eos_token_ids,
                           rng=make_rng(params.seed), stats=result.stats, cancel=cancel, typical=self.typical)
            try:
                for chunk in steps:
                    text, stopped = "", False
                    for token in chunk.tokens:  # one at a time, so a stop string ends token_ids where it ends
                        if self.tokenizer.is_eos(token):
                            break
                        result.token_ids.append(token)
                        piece, stopped = stop_filter.feed(decoder.add([token]))
                        text += piece
                        if stopped:
                            break
                    if chunk.finish_reason is not None and not stopped:
                        piece, stopped = stop_filter.feed(decoder.flush())
                        text += piece + ("" if stopped else stop_filter.flush())
                    if text:
                        result.text += text
                        yield text
                    if stopped or chunk.finish_reason is not None:
                        result.finish_reason = "stop" if stopped else chunk.finish_reason
                        return
            finally:
                steps.close()
