"""Options shared by the commands: how a pipeline loads (one ``api.settings.LoadSettings``, built the same way by
`chat`, `generate`, `serve` and `bench`), -k, and `-o KEY=VALUE` method options typed from their text."""

from __future__ import annotations

import functools

import click

from specdec_edge.runtime.base import BACKENDS
from specdec_edge.runtime.ov_prefill import PREFILL_RUNTIMES

# -k/--k of chat, generate, serve and bench
K_OPTION = click.option(
    "-k",
    "--k",
    "k",
    type=click.IntRange(min=1),
    default=None,
    help="Speculation length: the deepest proposal a target pass verifies. Default: the method's (10 for auto, "
    "which verifies only the part worth its cost; 8 for history; 4 for the others).",
)


def file_option(*decls: str, help: str):
    """An option naming a file (not a folder), None when not given: --prompts, --json, --chat-template, ..."""
    return click.option(*decls, type=click.Path(dir_okay=False), default=None, help=help)


def load_options(threads_default: int | None = None) -> list:
    """The click options of ``LoadSettings`` that every command that loads a pipeline has (`chat`, `generate`,
    `serve`, `bench`): --threads, --spinning, --allow-inexact, --provider, --prefill."""
    return [
        click.option(
            "--threads",
            type=click.IntRange(1, 1024),
            default=threads_default,
            show_default=threads_default is not None,
            help="CPU threads" + (" (default: one per physical core)." if threads_default is None else "."),
        ),
        click.option(
            "--spinning/--no-spinning",
            default=True,
            show_default=True,
            help="Spinning: every model shares one process-wide thread pool that spins between ops (fastest). "
            "--no-spinning: a sleeping pool per model, leaving the CPU idle between ops (slower).",
        ),
        click.option(
            "--allow-inexact",
            is_flag=True,
            help="Allow speculation that this device's exactness verdict does not vouch for (a target that is not "
            "batch invariant here, or token trees on a quantized target; see `specdec-edge info`): the output "
            "may then differ from plain decoding.",
        ),
        click.option(
            "--provider",
            type=click.Choice(list(BACKENDS)),
            default="cpu",
            show_default=True,
            help="cpu; cuda or tensorrt: ONNX Runtime GPU providers (onnxruntime-gpu); trt: TensorRT engines "
            "built by `build-engines`.",
        ),
        click.option(
            "--prefill",
            type=click.Choice(list(PREFILL_RUNTIMES)),
            default="auto",
            show_default=True,
            help="Which runtime prefills the prompt: auto (with --provider cpu: OpenVINO where the openvino package "
            "is installed, or the bundle's prefill graph with fp32 activations, where one measured at least 1.1x "
            "faster on this CPU, once, cached; else the target graph in ONNX Runtime), openvino, fp32 or "
            "onnxruntime. Output stays identical between plain and speculative decoding either way.",
        ),
    ]


def settings_options(cls, options):
    """A decorator adding the click ``options``, whose values reach the command as one ``cls`` (a dataclass
    whose fields are the options' names): after the arguments the decorators outside this one put first. An
    option of the command's own whose name is a field (serve's --prompt-cache-mb, chat's --reuse) goes there
    too; a field with a default that the command has no option for keeps it. A field ``load`` gets a
    ``LoadSettings`` of the options named as its fields."""

    def decorate(f):
        @functools.wraps(f)
        def command(*args, **params):
            from specdec_edge.api.settings import LoadSettings

            fields = cls.__dataclass_fields__
            values = {name: params.pop(name) for name in fields if name in params}
            if "load" in fields:
                load = LoadSettings.__dataclass_fields__
                values["load"] = LoadSettings(**{name: params.pop(name) for name in load if name in params})
            return f(*args, cls(**values), **params)

        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def parse_value(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_options(values, *, per_method: bool = False) -> dict:
    """``["window=5"]`` -> ``{"window": 5}``; with ``per_method``, ``["pld.max_ngram=4"]`` -> ``{"pld": {...}}``."""
    out: dict = {}
    for item in values or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="-o/--option")
        if per_method:
            method, dot, key = key.partition(".")
            if not dot or not key:
                raise click.BadParameter(
                    f"{item!r} needs METHOD.KEY=VALUE, e.g. pld.max_ngram=4", param_hint="-o/--option"
                )
            out.setdefault(method, {})[key] = parse_value(value)
        else:
            out[key] = parse_value(value)
    return out
