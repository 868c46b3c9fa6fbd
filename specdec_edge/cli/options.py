"""`-o KEY=VALUE` method options on the command line, typed from their text."""

from __future__ import annotations

import click

# -k/--k of chat, generate, serve and bench
K_OPTION = click.option(
    "-k",
    "--k",
    "k",
    type=click.IntRange(min=1),
    default=None,
    help="Speculation length: the deepest proposal a target pass verifies. Default: the method's (6 for auto, "
    "which verifies only the part worth its cost; 8 for history; 4 for the others).",
)


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
