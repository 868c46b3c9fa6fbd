"""Tokenizer for the light runtime: `tokenizers` + jinja2 chat templates, no transformers.

``Tokenizer`` wraps a ``tokenizer.json`` and renders chat templates the way Hugging Face
does (sandboxed jinja2, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``strftime_now``, a non-escaping ``tojson``), so a bundle produces the same prompt ids as
``transformers`` would. Base models have no chat template: ``plain_text`` turns messages into
the text such a model continues, and ``read_chat_template`` loads a template a user supplies
(``--chat-template FILE``). ``IncrementalDecoder`` streams text token by token without
re-decoding everything and without splitting multi-byte characters.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from specdec_edge.errors import BundleError, SpecdecError

_INCOMPLETE = "\ufffd"  # what a decoder emits for bytes that are not (yet) valid UTF-8
_PROBE = "specdec-edge checks this template"  # a user message that a working template writes out
MAX_MESSAGES = 4096  # messages of one conversation (each takes a few tokens of the KV cache at least)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


MAX_TEMPLATE_CHARS = 1 << 20  # what one `*` (or `**`) in a chat template may make: a string, list or number


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with `*` and `**` bounded: ``'x' * 10**12`` or ``9 ** 9 ** 9`` in a
    template is an error, not a process that runs out of memory or time."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_TEMPLATE_CHARS:
                    raise OverflowError(f"a repetition of {len(seq) * n} items (the limit is {MAX_TEMPLATE_CHARS})")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if abs(left) > 1 and right * max(abs(left), 2).bit_length() > 8 * MAX_TEMPLATE_CHARS:
                raise OverflowError(f"{left} ** {right} is too large a number")
        return super().call_binop(context, operator, left, right)


def _compile_template(source: str) -> jinja2.Template:
    env = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _template_failure(e: BaseException) -> str:
    """What went wrong in a chat template, in a few words: Jinja's message, or the Python error's type and
    message, with the template line where Jinja knows it."""
    if isinstance(e, RecursionError):
        return "it recurses without end (RecursionError)"
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    if isinstance(e, jinja2.exceptions.TemplateError) and not isinstance(e, jinja2.exceptions.TemplateSyntaxError):
        return text or type(e).__name__
    line = f" at line {e.lineno}" if getattr(e, "lineno", None) else ""
    return f"{type(e).__name__}{line}: {text}" if text else f"{type(e).__name__}{line}"


def render_template(source: str, where: str, context: dict) -> str:
    """``source`` compiled and rendered with ``context``; any failure of either (a syntax error, an error it
    raises, a division by zero, a wrong type, a range or repetition too large, endless recursion) is one
    ``SpecdecError`` naming ``where`` (e.g. "the chat template in chat.jinja")."""
    try:
        return _compile_template(source).render(context)
    except Exception as e:  # a template is a program: any error of it is the template's
        raise SpecdecError(f"{where} failed ({_template_failure(e)}); fix the template.") from None


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise SpecdecError(
            "messages must be a non-empty list of {'role': ..., 'content': ...} dicts, "
            f"got {type(messages).__name__}."
        )
    if len(messages) > MAX_MESSAGES:
        raise SpecdecError(f"there are {len(messages)} messages, more than the limit of {MAX_MESSAGES}.")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise SpecdecError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}.")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise SpecdecError(f"messages[{i}] needs a string {key!r}, got {message.get(key)!r}.")


def plain_text(messages: list[dict]) -> str:
    """Messages as the plain text a base model (no chat template) continues.

    Every message that is not the assistant's starts a new paragraph (a blank line before it,
    unless it is the first); an assistant message is appended as it is, because it was generated
    as the continuation of the text before it. ``[user "Q1", assistant " A1", user "Q2"]`` becomes
    ``"Q1 A1\n\nQ2"``. Roles are not written: a base model knows no roles.
    """
    _check_messages(messages)
    text = ""
    for m in messages:
        if m["role"] == "assistant" or not text:
            text += m["content"]
        else:
            text += "\n\n" + m["content"]
    return text


def read_chat_template(path: str | Path) -> str:
    """The chat template in ``path``: a Jinja file, or a JSON file with a ``chat_template`` string
    (``tokenizer_config.json``, ``chat_template.json``). Checked by rendering one user message."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(
            f"cannot read the chat template file {path} ({e.__class__.__name__}); give a Jinja file."
        ) from None
    if path.suffix == ".json":
        try:
            text = json.loads(text).get("chat_template")
        except (json.JSONDecodeError, AttributeError):
            text = None
        if not isinstance(text, str):
            raise SpecdecError(
                f'{path} has no "chat_template" string; give a Jinja template file or a tokenizer_config.json '
                "that holds one."
            )
    probe = {"messages": [{"role": "user", "content": _PROBE}], "add_generation_prompt": True}
    rendered = render_template(text, f"the chat template in {path}", probe)
    if _PROBE not in rendered:
        raise SpecdecError(f"the chat template in {path} does not write the messages' content; check the template.")
    return text


def _reraise_interrupt(exc: BaseException) -> None:
    """Let Ctrl-C and exits through: only the native library's own errors are turned into messages."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        raise exc


def _native_reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _check_text(text) -> None:
    """Text the tokenizer can take: a str that is valid Unicode (no unpaired surrogates)."""
    if not isinstance(text, str):
        raise SpecdecError(f"the prompt must be a string, got {type(text).__name__}.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SpecdecError(
            f"the prompt has an unpaired surrogate (U+{ord(text[e.start]):04X}) at character {e.start}, which is not "
            "valid Unicode; fix the text (e.g. decode its bytes with errors='replace')."
        ) from None


class Tokenizer:
    """Encode, decode and chat-format text for one model family."""

    def __init__(
        self,
        tokenizer_file: str | Path,
        *,
        chat_template: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool = False,
        special_tokens: dict | None = None,
    ):
        path = Path(tokenizer_file)
        if not path.is_file():
            raise BundleError(f"tokenizer file {path} not found: re-export the bundle or pass a tokenizer.json.")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except BaseException as exc:  # the Rust side raises a bare Exception, or a PanicException
            _reraise_interrupt(exc)
            raise BundleError(
                f"tokenizer file {path} could not be read ({_native_reason(exc)}): re-export the bundle."
            ) from None
        self.path = path
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.add_bos_token = add_bos_token
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_bundle(cls, bundle_dir: str | Path, spec, chat_template: str | None = None) -> Tokenizer:
        """Build from a bundle directory and its manifest's ``TokenizerSpec``; ``chat_template``
        replaces the bundle's own (e.g. one given to a base model's bundle)."""
        return cls(
            Path(bundle_dir) / spec.file,
            chat_template=chat_template or spec.chat_template,
            bos_token_id=spec.bos_token_id,
            eos_token_ids=spec.eos_token_ids,
            add_bos_token=spec.add_bos_token,
            special_tokens=spec.special_tokens,
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; prepends BOS when the model wants it and the
        tokenizer's own post-processor did not add it."""
        _check_text(text)
        ids = self._native("encode", self._tok.encode, text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._native("decode", self._tok.decode, [int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def _native(self, what: str, call, *args, **kwargs):
        """``call(*args, **kwargs)`` of the Rust tokenizer; its errors (a bare Exception, or a
        ``PanicException``, a BaseException that passes ``except Exception``) become one SpecdecError."""
        try:
            return call(*args, **kwargs)
        except BaseException as exc:
            _reraise_interrupt(exc)
            raise SpecdecError(
                f"the tokenizer ({self.path}) failed to {what} this text ({_native_reason(exc)}); the tokenizer.json "
                "may be broken (e.g. a pre-tokenizer regex that backtracks without end): re-export the bundle."
            ) from None

    @property
    def has_chat_template(self) -> bool:
        """False for base models: chat messages then need ``plain_text`` or a template of one's own."""
        return self.chat_template is not None

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise SpecdecError(
                "this model has no chat template (a base model): pass a plain prompt instead of chat messages, "
                "or give a template with --chat-template FILE (export, chat, generate; Pipeline.load(chat_template=))."
            )
        try:
            return _compile_template(self.chat_template)
        except Exception as e:
            failure = _template_failure(e)
            raise SpecdecError(f"the model's chat template failed ({failure}); fix the template.") from None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{'role', 'content'}, ...]) to the model's prompt text."""
        template = self._template
        _check_messages(messages)
        try:
            context = {"tools": None, "documents": None, **self.special_tokens}
            return template.render(context, messages=messages, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # any error of the template (a program) is the template's
            raise SpecdecError(
                f"the model's chat template failed on these messages ({_template_failure(e)}); fix the template "
                "(--chat-template FILE) or the messages."
            ) from None

    def is_eos(self, token_id: int) -> bool:
        return int(token_id) in self.eos_token_ids

    def decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A fresh streaming decoder for one generation."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Turn a stream of token ids into a stream of text.

    Keeps a small window ``ids[prefix:]``: the text of ``ids[prefix:read]`` was already
    emitted, and decoding the window with that prefix gives tokens the context they need
    (e.g. leading-space rules). New text is emitted only when the window's text does not
    end in U+FFFD, i.e. no multi-byte character is cut in half. Each ``add`` decodes just
    the window, so the cost per call is proportional to the new tokens (amortised).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # the window: everything before it was emitted and dropped
        self._read = 0  # window ids [0, read) are emitted; [read, end) are pending

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return only the text that became final."""
        self._ids.extend(int(t) for t in token_ids)
        if len(self._ids) == self._read:
            return ""
        prefix_text = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        if len(text) <= len(prefix_text) or text.endswith(_INCOMPLETE):
            return ""
        return self._advance(text, prefix_text)

    def flush(self, complete_only: bool = False) -> str:
        """Return whatever is still held back; an incomplete character at the end comes out as U+FFFD,
        or, with ``complete_only``, is left out (the generation was cut inside it)."""
        if len(self._ids) == self._read:
            return ""
        prefix_text = self._decode(self._ids[: self._read])
        text = self._advance(self._decode(self._ids), prefix_text)
        return text.rstrip(_INCOMPLETE) if complete_only else text

    def _advance(self, text: str, prefix_text: str) -> str:
        # The pending ids become the next window's prefix.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return text[len(prefix_text) :]
