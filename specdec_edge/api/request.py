"""One call's request, checked once: its prompt tokenized (``Prompt``) and measured against the KV cache, its stop
strings and its length. ``Pipeline.stream`` and ``generate`` check through it; the server's budget tokenizes a
request once and passes the ``Prompt`` on. Light: no model code here.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec_edge.api.streaming import MAX_STOP_CHARS, MAX_STOPS
from specdec_edge.errors import SpecdecError
from specdec_edge.speculative.history_store import HistoryStore
from specdec_edge.tokenizer import Tokenizer

MAX_CHARS_PER_TOKEN = 64  # a prompt longer than this many characters per token of the KV cache cannot fit


@dataclass(frozen=True)
class Prompt:
    """A prompt's token ids (``Pipeline.prompt``): text as is, chat messages through the chat template. ``stream``
    and ``generate`` take it as they take text, without tokenizing it again."""

    ids: tuple[int, ...]


def encode(tokenizer: Tokenizer, prompt, capacity: int) -> list[int]:
    """Prompt ids: a ``Prompt``'s own, plain text as is, chat messages through the tokenizer's chat template.

    Text longer than ``MAX_CHARS_PER_TOKEN`` characters per token of the KV cache (``capacity``) cannot fit in it
    (tokenizers rarely make tokens that long): it is refused before it is tokenized."""
    if isinstance(prompt, Prompt):
        return list(prompt.ids)
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


def check_fits(ids: list[int], max_new_tokens: int, capacity: int) -> None:
    """Refuse a prompt and answer longer than the KV cache holds."""
    if len(ids) + max_new_tokens > capacity:
        raise SpecdecError(
            f"the prompt has {len(ids)} tokens and max_new_tokens is {max_new_tokens}: {len(ids) + max_new_tokens} "
            f"exceeds the KV cache capacity of {capacity} tokens; shorten the prompt (or the chat "
            "history), lower max_new_tokens, or re-export the bundle with a larger --capacity."
        )


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
