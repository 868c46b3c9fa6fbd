"""One call's request, admitted once (``admit`` -> ``Admitted``): its prompt tokenized, its stop strings checked,
and the prompt with its answer's length measured against the KV cache. ``Pipeline.stream`` and ``generate`` admit
text and chat messages themselves; the server admits a request before it queues it and passes the ``Admitted`` on,
which the pipeline runs as it is: no second tokenization, no second check. Light: no model code here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from specdec_edge.api.streaming import MAX_STOP_CHARS, MAX_STOPS
from specdec_edge.errors import SpecdecError
from specdec_edge.speculative.history_store import HistoryStore
from specdec_edge.tokenizer import Tokenizer

MAX_CHARS_PER_TOKEN = 64  # a prompt longer than this many characters per token of the KV cache cannot fit


class _Unnamed(int):
    """The ``max_new_tokens`` of a call that names none (``DEFAULT_MAX_NEW_TOKENS``, told apart by identity): 128 for
    text and messages; an ``Admitted`` request brings its own."""


DEFAULT_MAX_NEW_TOKENS = _Unnamed(128)


@dataclass(frozen=True)
class Admitted:
    """A request ``admit`` let in (``Pipeline.admit``): the prompt's ids, at most ``max_new_tokens`` new tokens and
    the stop strings; the ids and ``max_new_tokens`` together fit in a KV cache of ``capacity`` tokens. ``stream``
    and ``generate`` take it as they take text, and check none of it again."""

    ids: tuple[int, ...]
    max_new_tokens: int
    stops: tuple[str, ...]
    capacity: int

    def at_most(self, max_new_tokens: int) -> Admitted:
        """This request with at most ``max_new_tokens`` new tokens (a shorter answer still fits: nothing to check)."""
        return replace(self, max_new_tokens=min(self.max_new_tokens, max_new_tokens))


class TooLong(SpecdecError):
    """A prompt and answer longer than the KV cache holds. ``max_new_tokens`` None: the answer's length was left to
    what fits, and the prompt alone leaves no room for one new token. The numbers are attributes, so that a caller
    (the server) can word the refusal its own way."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int | None, capacity: int):
        self.prompt_tokens, self.max_new_tokens, self.capacity = prompt_tokens, max_new_tokens, capacity
        fix = "shorten the prompt (or the chat history)"
        if max_new_tokens is None:
            message = (
                f"the prompt has {prompt_tokens} tokens: it leaves no room for an answer in the KV cache capacity of "
                f"{capacity} tokens; {fix}, or re-export the bundle with a larger --capacity."
            )
        else:
            message = (
                f"the prompt has {prompt_tokens} tokens and max_new_tokens is {max_new_tokens}: "
                f"{prompt_tokens + max_new_tokens} exceeds the KV cache capacity of {capacity} tokens; {fix}, lower "
                "max_new_tokens, or re-export the bundle with a larger --capacity."
            )
        super().__init__(message)

    def __reduce__(self):  # pickled with its numbers, not its message
        return TooLong, (self.prompt_tokens, self.max_new_tokens, self.capacity)


def admit(tokenizer: Tokenizer, prompt, max_new_tokens: int | None, stop, capacity: int) -> Admitted:
    """``prompt`` (plain text as is, chat messages through the tokenizer's chat template) tokenized once, ``stop``
    checked (``check_stops``), and the prompt with ``max_new_tokens`` new tokens (None: as many as fit after it)
    measured against a KV cache of ``capacity`` tokens: the ``Admitted``, or a SpecdecError saying what to change
    (``TooLong`` where they do not fit)."""
    if max_new_tokens is not None:
        check_max_new_tokens(max_new_tokens)
    stops = check_stops(stop)
    ids = encode(tokenizer, prompt, capacity)
    room = capacity - len(ids)
    if room < (1 if max_new_tokens is None else max_new_tokens):
        raise TooLong(len(ids), max_new_tokens, capacity)
    return Admitted(tuple(ids), room if max_new_tokens is None else int(max_new_tokens), tuple(stops), capacity)


def call_request(tokenizer: Tokenizer, prompt, max_new_tokens: int | None, stop, capacity: int) -> Admitted:
    """A call's request (``Pipeline.stream``): text or messages admitted now, once, with at most ``max_new_tokens``
    new tokens (a call names an integer; only ``admit`` takes None, all that fits), or an ``Admitted`` as it is: its
    own length and stops, nothing checked again."""
    if not isinstance(prompt, Admitted):
        if max_new_tokens is None:
            check_max_new_tokens(max_new_tokens)  # refused, as every length that is not an integer >= 1
        return admit(tokenizer, prompt, max_new_tokens, stop, capacity)
    if max_new_tokens is not DEFAULT_MAX_NEW_TOKENS or stop is not None:
        raise SpecdecError(
            "an admitted request brings its own max_new_tokens and stop (Pipeline.admit): leave them out of this call."
        )
    if prompt.capacity > capacity:  # admitted by a pipeline with a larger cache
        raise SpecdecError(
            f"this request was admitted for a KV cache of {prompt.capacity} tokens, more than this pipeline's "
            f"{capacity}: admit it with the pipeline that runs it (Pipeline.admit)."
        )
    return prompt


def encode(tokenizer: Tokenizer, prompt, capacity: int) -> list[int]:
    """Prompt ids: plain text as is, chat messages through the tokenizer's chat template.

    Text longer than ``MAX_CHARS_PER_TOKEN`` characters per token of the KV cache (``capacity``) cannot fit in it
    (tokenizers rarely make tokens that long): it is refused before it is tokenized."""
    chars = len(prompt) if isinstance(prompt, str) else _content_chars(prompt)
    if chars > MAX_CHARS_PER_TOKEN * capacity:
        raise SpecdecError(
            f"the prompt has {chars} characters, more than the {MAX_CHARS_PER_TOKEN * capacity} that can "
            f"fit in the KV cache capacity of {capacity} tokens; shorten it."
        )
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        ids = tokenizer.encode(tokenizer.apply_chat_template(prompt), add_special_tokens=False)
    if not ids:
        raise SpecdecError("the prompt encodes to no tokens; give some text.")
    return ids


def check_max_new_tokens(max_new_tokens) -> None:
    """Refuse a ``max_new_tokens`` that is not a positive integer."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SpecdecError(f"max_new_tokens={max_new_tokens!r} is invalid: use an integer >= 1.")


def prefix_ids(tokenizer: Tokenizer, prompt, engines) -> list[int]:
    """The ids of a prefix to save (``Pipeline.save_prefix``): checked as a prompt; chat messages rendered without
    the assistant's turn start, as they begin a longer conversation."""
    ids = encode(tokenizer, prompt, engines.capacity)
    if not isinstance(prompt, str):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=False)
        ids = tokenizer.encode(text, add_special_tokens=False) or ids
    return ids


def history_for(history, default: HistoryStore | None) -> HistoryStore | None:
    """The store a call drafts from: its own ``HistoryStore``, the pipeline's (``default``) for True, none for
    False; anything else is refused."""
    if isinstance(history, HistoryStore):
        return history
    if isinstance(history, bool):
        return default if history else None
    raise SpecdecError(f"history={short(history)} is invalid: use True, False or a HistoryStore.")


def check_stops(stop) -> list[str]:
    """``stop`` (None, a string or a sequence of strings) as a list, or an error naming the bad value."""
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return []
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise SpecdecError(f"stop={short(stop)} is invalid: use a string or a list of strings.")
    if len(stops) > MAX_STOPS:
        raise SpecdecError(f"stop has {len(stops)} strings, more than the limit of {MAX_STOPS}; give fewer.")
    if longest := max(stops, key=len, default=""):
        if len(longest) > MAX_STOP_CHARS:
            raise SpecdecError(
                f"a stop string has {len(longest)} characters, more than the limit of {MAX_STOP_CHARS}; "
                "give a shorter one."
            )
    return list(stops)


def _content_chars(messages) -> int:
    """Characters of the messages' contents (0 for a value that is not a list of messages: refused later)."""
    if not isinstance(messages, list):
        return 0
    return sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))


def short(value, most: int = 80) -> str:
    """``repr(value)``, cut to ``most`` characters (a message stays one short line)."""
    text = repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."
