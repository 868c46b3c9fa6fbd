"""From accepted tokens to streamed text: detokenization, eos, stop strings, and the ``Stream`` object.

``text_pieces`` turns the decode loop's steps into text pieces while filling in a
``GenerationResult``; ``StopFilter`` holds back text that may be the start of a stop string;
``Stream`` is what ``Pipeline.stream`` returns. Light: no model code here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from specdec_edge.speculative.loop import Emitted
from specdec_edge.speculative.stats import Stats
from specdec_edge.tokenizer import Tokenizer


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens: without a final eos; up to the one that completes a stop string
    stats: Stats
    finish_reason: str | None  # "eos" | "length" | "stop" | "cancelled"; None while streaming


# Bounds on stop strings (Pipeline.generate/stream, `generate --stop`, the server's `stop`), so that one
# request cannot make the check of every token slow: at most MAX_STOPS strings of MAX_STOP_CHARS characters.
MAX_STOPS = 16
MAX_STOP_CHARS = 1000


def _failure(s: str) -> list[int]:
    """KMP failure function: ``f[i]`` is the length of the longest proper prefix of ``s[: i + 1]`` that is
    also its suffix."""
    f, q = [0] * len(s), 0
    for i in range(1, len(s)):
        while q and s[i] != s[q]:
            q = f[q - 1]
        if s[i] == s[q]:
            q += 1
        f[i] = q
    return f


class StopFilter:
    """Holds back text that could be the start of a stop string, and cuts at the first one found.

    Linear in the text fed: each stop string keeps its matched-prefix length (Knuth-Morris-Pratt), so a
    token costs time in proportion to its characters, whatever the length of the stop strings; the text
    held back is the longest matched prefix."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # per stop: how many of its first characters the text ends with
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return ``(text safe to emit, stop string found)``."""
        found = False
        for j, (stop, fail) in enumerate(zip(self.stops, self._fail)):
            q = self._matched[j]
            for c in text:
                while q and stop[q] != c:
                    q = fail[q - 1]
                if stop[q] == c:
                    q += 1
                if q == len(stop):
                    found = True
                    break
            self._matched[j] = q
        text = self.held + text
        if found:  # every stop string found lies within the held text and the new text: cut at the first
            self.held, self._matched = "", [0] * len(self.stops)
            return text[: min(i for i in (text.find(s) for s in self.stops) if i >= 0)], True
        keep = max(self._matched, default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        text, self.held = self.held, ""
        self._matched = [0] * len(self.stops)
        return text


def text_pieces(
    steps: Iterator[Emitted], tokenizer: Tokenizer, stops: Sequence[str], result: GenerationResult
) -> Iterator[str]:
    """The text of each step of ``steps``, ending at eos, the first stop string, or the loop's own end.

    Tokens are taken one at a time, so a stop string ends ``result.token_ids`` where it ends;
    ``result`` (text, token ids, finish reason) is complete when the iterator is exhausted. The text
    holds whole characters only: one cut by ``max_new_tokens`` or a cancel is left out.
    """
    decoder = tokenizer.decoder()
    stop_filter = StopFilter(stops)
    for step in steps:
        text, stopped = "", False
        for token in step.tokens:
            if tokenizer.is_eos(token):
                break
            result.token_ids.append(token)
            piece, stopped = stop_filter.feed(decoder.add([token]))
            text += piece
            if stopped:
                break
        if step.finish_reason is not None and not stopped:
            # Cut by the length limit or a cancel, a character may lack its last bytes: leave it out
            # of the text (its tokens stay in token_ids) rather than end in U+FFFD.
            piece, stopped = stop_filter.feed(decoder.flush(complete_only=step.finish_reason != "eos"))
            text += piece + ("" if stopped else stop_filter.flush())
        if text:
            result.text += text
            yield text
        if stopped or step.finish_reason is not None:
            result.finish_reason = "stop" if stopped else step.finish_reason
            return


class Stream:
    """Text pieces as tokens are accepted; ``result`` is complete once iteration ends.

    ``cancel()`` (safe from any thread) or ``close()`` stops generation and frees the pipeline at
    once; a stream that is simply dropped, or read slowly, never blocks other calls either (see
    ``specdec_edge/api/generation.py``). Several threads may read one stream; they take turns.
    """

    def __init__(self, pieces: Iterator[str], result: GenerationResult, cancel: Callable[[], None]):
        self.result = result
        self._pieces = pieces
        self._cancel = cancel
        self._reading = threading.Lock()  # one reader at a time (a generator cannot run in two threads)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        with self._reading:
            return next(self._pieces)

    def cancel(self) -> None:
        """Stop generation (from any thread): iteration ends at the next piece, finish_reason "cancelled"."""
        self._cancel()

    def close(self) -> None:
        """Stop generation and end the stream; from another thread while it is being read, like ``cancel``."""
        self._cancel()
        if not self._reading.acquire(blocking=False):
            return  # being read now: the reader's next piece ends it
        try:
            self._pieces.close()
        finally:
            self._reading.release()
        if self.result.finish_reason is None:
            self.result.finish_reason = "cancelled"

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
