"""The OpenAI wire format: checking request bodies, and building responses, stream chunks and errors.

No web framework here: ``parse_request`` takes the decoded JSON body and returns a
``CompletionRequest`` or raises ``APIError`` (an HTTP status plus an OpenAI-style error object
naming the parameter and what to send instead). The builders turn a ``GenerationResult`` into the
objects the official clients parse; the speculative statistics travel in one namespaced extra
field, ``specdec_edge``, which those clients keep (``response.model_extra["specdec_edge"]``).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from specdec_edge.api.streaming import MAX_STOP_CHARS
from specdec_edge.serve.parameters import STREAM_OPTIONS, refused_field, refused_message_field
from specdec_edge.tokenizer import MAX_MESSAGES
from specdec_edge.values import is_int as _is_int

STATS_FIELD = "specdec_edge"
MAX_STOPS = 4  # as OpenAI's API
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what the cache holds


class APIError(Exception):
    """A request the server refuses: ``status`` and an OpenAI-style error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclass(frozen=True)
class CompletionRequest:
    """One checked request of either endpoint."""

    kind: str  # "chat" (/v1/chat/completions) | "completion" (/v1/completions)
    prompt: str | list[dict]  # completion: the text as is; chat: [{"role", "content": str}, ...]
    max_tokens: int | None  # None: the endpoint's default
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    def sampling(self) -> dict:
        """How to sample: keyword arguments of ``Pipeline.stream`` (the length and stops travel in the
        ``Admitted`` request)."""
        return {name: getattr(self, name) for name in ("temperature", "top_k", "top_p", "seed")}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(body: dict, name: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise bad(f"{name}={value!r} is invalid: use a number in {interval}.", name)
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < low or (high is not None and value > high):
        limit = f"between {low} and {high}" if high is not None else f">= {low}"
        raise bad(f"{name}={value!r} is invalid: use an integer {limit}.", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"{name}={value!r} is invalid: use true or false.", name)
    return value


def _text_content(content, where: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "\n".join(texts)
    raise bad(
        f"{where}.content must be a string or a list of text parts ({{'type': 'text', 'text': ...}}); "
        "images, audio and tool calls are not supported.",
        f"{where}.content",
    )


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {'role': ..., 'content': ...} objects.", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad(f"messages has {len(messages)} entries, more than the limit of {MAX_MESSAGES}.", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"{where} must be an object with 'role' and 'content'.", where)
        if (extra := refused_message_field(message)) is not None:
            raise bad(
                f"{where}.{extra} is not supported by this server: send role and content only (text).",
                f"{where}.{extra}",
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise bad(f"{where}.role must be a string such as 'system', 'user' or 'assistant'.", f"{where}.role")
        out.append({"role": role, "content": _text_content(message.get("content"), where)})
    return out


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad(
            "prompt must be a string (or a list of one string); token-id prompts and batches are not supported.",
            "prompt",
        )
    return prompt


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) for s in stops):
        raise bad(f"stop must be a string or a list of up to {MAX_STOPS} strings.", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        longest = max(len(s) for s in stops)
        raise bad(f"a stop string has {longest} characters, more than this server's limit of {MAX_STOP_CHARS}.", "stop")
    return tuple(s for s in stops if s)


def _refuse_unsupported(body: dict) -> None:
    """Every field is read, known to have no effect, or at its "off" value (``parameters.py``): never ignored."""
    if (refused := refused_field(body)) is not None:
        raise bad(refused[1], refused[0])


def parse_request(body, kind: str, model: str, capacity: int) -> CompletionRequest:
    """Check a decoded JSON body of /v1/chat/completions (``kind`` "chat") or /v1/completions.

    ``model`` is the id this server answers to; ``capacity`` the KV cache size, the most tokens
    (prompt + output) one request can have.
    """
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object.")
    name = body.get("model")
    if not isinstance(name, str):
        raise bad(f"model must be a string: this server serves {model!r}.", "model")
    if name != model:
        raise APIError(
            404,
            f"the model {name!r} does not exist here: this server serves {model!r} (GET /v1/models).",
            param="model",
            code="model_not_found",
        )
    _refuse_unsupported(body)
    prompt = _messages(body) if kind == "chat" else _prompt(body)
    max_tokens = _integer(body, "max_completion_tokens", 1)
    max_tokens = max_tokens if max_tokens is not None else _integer(body, "max_tokens", 1)
    if max_tokens is not None and max_tokens >= capacity:
        param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        raise bad(
            f"{param}={max_tokens} is too large: this model holds {capacity} tokens in all, prompt included; "
            f"use at most {capacity - 1} minus the prompt's length.",
            param,
        )
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad("stream_options is only allowed with stream=true.", "stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options must be an object such as {'include_usage': true}.", "stream_options")
    if unknown := sorted(k for k, v in (options or {}).items() if k not in STREAM_OPTIONS and v not in (None, False)):
        raise bad(f"stream_options.{unknown[0]} is not supported by this server; leave it out.", "stream_options")
    return CompletionRequest(
        kind=kind,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=_integer(body, "top_k", 0) or 0,  # not OpenAI's, but common among local servers (0: off)
        seed=_integer(body, "seed", 0, 2**63 - 1),
        stop=_stop(body),
        stream=stream,
        include_usage=_flag(options or {}, "include_usage"),
    )


# Responses


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_tokens(result) -> int:
    """Tokens the answer took: its text's tokens, plus the eos token that ended it."""
    return len(result.token_ids) + (result.finish_reason == "eos")


def speculative_stats(result, method: str) -> dict:
    """The namespaced extra field: how speculation went for this answer."""
    s = result.stats
    return {
        "method": method,
        "tokens_per_pass": round(s.tokens_per_pass, 4),
        "acceptance_rate": round(s.acceptance_rate, 4),
        "target_passes": s.steps,
        "draft_tokens_proposed": s.proposed,
        "draft_tokens_accepted": s.accepted,
        "tokens_per_second": round(s.tokens_per_s, 2),
        "prefill_seconds": round(s.prefill_s, 4),
        # prompt tokens whose KV cache was kept from the previous request, and those computed
        "reused_prompt_tokens": s.reused_tokens,
        "prefilled_prompt_tokens": s.prefilled_tokens,
        # which proposers ran (several for auto and pld-eagle), and how well each did
        "by_proposer": {
            name: {
                "target_passes": p.steps,
                "draft_tokens_proposed": p.proposed,
                "draft_tokens_accepted": p.accepted,
            }
            for name, p in sorted(s.by_proposer.items())
        },
    }


def completion_object(request: CompletionRequest, model: str, result, prompt_tokens: int, method: str) -> dict:
    """The whole answer of a non-streaming request."""
    finish = FINISH_REASONS[result.finish_reason]
    if request.kind == "chat":
        kind, choice = "chat.completion", {"message": {"role": "assistant", "content": result.text}}
    else:
        kind, choice = "text_completion", {"text": result.text}
    return {
        "id": new_id(request.kind),
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": finish}],
        "usage": usage(prompt_tokens, completion_tokens(result)),
        STATS_FIELD: speculative_stats(result, method),
    }


class ChunkWriter:
    """The stream chunks of one streaming request, in order: ``first``, ``piece`` per text piece,
    ``last`` (finish reason and stats), then ``usage`` when the client asked for it."""

    def __init__(self, request: CompletionRequest, model: str):
        self.request = request
        self.base = {
            "id": new_id(request.kind),
            "object": "chat.completion.chunk" if request.kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": model,
        }

    def _chunk(self, choice: dict, finish: str | None = None, **extra) -> dict:
        body = {**self.base, "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": finish}], **extra}
        if self.request.include_usage:
            body.setdefault("usage", None)
        return body

    def _text(self, text: str) -> dict:
        return {"delta": {"content": text}} if self.request.kind == "chat" else {"text": text}

    def first(self) -> dict | None:
        """Chat streams open with the assistant's role; completion streams have nothing to open with."""
        if self.request.kind != "chat":
            return None
        return self._chunk({"delta": {"role": "assistant", "content": ""}})

    def piece(self, text: str) -> dict:
        return self._chunk(self._text(text))

    def last(self, result, method: str) -> dict:
        empty = {"delta": {}} if self.request.kind == "chat" else {"text": ""}
        return self._chunk(
            empty, FINISH_REASONS[result.finish_reason], **{STATS_FIELD: speculative_stats(result, method)}
        )

    def usage(self, result, prompt_tokens: int) -> dict:
        return {**self.base, "choices": [], "usage": usage(prompt_tokens, completion_tokens(result))}
