"""Which request fields the server reads, which it accepts without use, and which it refuses.

A field that would change the answer and is not implemented is never ignored: a client that sends
``ignore_eos`` or a grammar and gets a 200 believes it was applied. So every field of a request body is
one of:

- ``IMPLEMENTED``: read by ``protocol.parse_request``;
- ``NO_EFFECT``: bookkeeping, caching or scheduling hints that cannot change the text (``user``, ``store``,
  llama.cpp's ``cache_prompt``, Ollama's ``keep_alive``, ...): accepted, not used;
- ``OFF_VALUES``: not implemented, accepted only at the value that means "off" (what clients send by
  default: ``n: 1``, ``ignore_eos: false``, ``min_p: 0``, ...), refused otherwise;
- anything else: refused as unknown, with the parameter named.

``null`` is the same as leaving a field out. The same holds for each message's fields and
``stream_options``'s.
"""

from __future__ import annotations

IMPLEMENTED = frozenset(
    {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
     "stop", "stream", "stream_options"}
)  # fmt: skip

NO_EFFECT = frozenset(
    {
        "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",  # OpenAI
        "prediction",  # OpenAI's predicted outputs change how fast an answer comes, never the answer
        "parallel_tool_calls",  # only with tools, which are refused
        "request_id", "priority", "cache_salt",  # vLLM
        "cache_prompt", "id_slot", "timings_per_token", "t_max_prompt_ms",  # llama.cpp
        "keep_alive",  # Ollama
    }
)  # fmt: skip

# Not implemented; accepted at these values only (compared by type: true is not 1). Where the server does implement
# the same thing under another name, the error says so (``INSTEAD``).
OFF_VALUES = {
    # OpenAI
    "n": (1,),
    "best_of": (1,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "echo": (False,),
    "suffix": ("",),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),  # without tools, both mean: answer in text
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "audio": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    # vLLM
    "repetition_penalty": (1,),
    "length_penalty": (1,),
    "min_p": (0,),
    "min_tokens": (0,),
    "ignore_eos": (False,),
    "stop_token_ids": ([],),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "use_beam_search": (False,),
    "prompt_logprobs": (),
    "truncate_prompt_tokens": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "structured_outputs": (),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "add_special_tokens": (),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "documents": (),
    "logits_processors": (),
    "return_tokens_as_token_ids": (False,),
    # llama.cpp
    "n_predict": (),
    "typical_p": (1,),
    "repeat_penalty": (1,),
    "repeat_last_n": (),
    "dynatemp_range": (0,),
    "dynatemp_exponent": (1,),
    "mirostat": (0,),
    "mirostat_tau": (),
    "mirostat_eta": (),
    "dry_multiplier": (0,),
    "xtc_probability": (0,),
    "grammar": ("",),
    "json_schema": (),
    "n_probs": (0,),
    "min_keep": (0,),
    "n_keep": (),
    "samplers": (),
    "post_sampling_probs": (False,),
    "return_tokens": (False,),
    "lora": ([],),
    "image_data": ([],),
    # Ollama
    "num_predict": (),
    "num_ctx": (),
    "tfs_z": (1,),
    "format": ("",),
    "options": ({},),
    "think": (False,),
    "raw": (False,),
    "template": (),
    "system": (),
    "context": ([],),
}

INSTEAD = {
    "n_predict": "max_tokens",
    "num_predict": "max_tokens",
    "repeat_penalty": "no penalty (the answer is the model's own)",
    "grammar": "no constraint",
    "json_schema": "no constraint",
}

# A message's fields: role and content are read; these come back from the official clients' own response objects
# (message.model_dump()) and are accepted empty; any other, or these with a value, is refused.
MESSAGE_FIELDS = frozenset({"role", "content"})
MESSAGE_EMPTY_OK = frozenset({"refusal", "annotations", "audio", "function_call", "tool_calls", "reasoning_content"})
STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})  # the latter: padding only


def same(value, off) -> bool:
    """``value == off`` with types kept apart (true is not 1, 1.0 is 1), through lists and objects."""
    if isinstance(value, bool) or isinstance(off, bool):
        return isinstance(value, bool) and isinstance(off, bool) and value == off
    if isinstance(value, (int, float)) and isinstance(off, (int, float)):
        return value == off
    if isinstance(value, dict) and isinstance(off, dict):
        return value.keys() == off.keys() and all(same(value[k], off[k]) for k in value)
    if isinstance(value, list) and isinstance(off, list):
        return len(value) == len(off) and all(same(v, o) for v, o in zip(value, off))
    return type(value) is type(off) and value == off


def refused_field(body: dict) -> tuple[str, str] | None:
    """(name, why) of the first top-level field the server must refuse, or None."""
    for name, value in body.items():
        if value is None or name in IMPLEMENTED or name in NO_EFFECT:
            continue
        if name not in OFF_VALUES:
            return name, (
                f"{name} is not a parameter this server knows; leave it out (a server that ignored it could "
                "answer other than you asked)."
            )
        if not any(same(value, off) for off in OFF_VALUES[name]):
            instead = f" (use {INSTEAD[name]})" if name in INSTEAD else ""
            return name, f"{name}={_short(value)} is not supported by this server{instead}; leave it out."
    return None


def refused_message_field(message: dict) -> str | None:
    """The first field of a chat message the server must refuse, or None."""
    for name, value in message.items():
        if name in MESSAGE_FIELDS or value is None or (name in MESSAGE_EMPTY_OK and value in ([], "", {})):
            continue
        return name
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
