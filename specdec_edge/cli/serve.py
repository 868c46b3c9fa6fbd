"""`serve`: the OpenAI-compatible HTTP server, thin over ``specdec_edge.serve`` (light imports only)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import click

from specdec_edge.api.prompt_cache import DEFAULT_MB
from specdec_edge.api.settings import check_history_memory
from specdec_edge.cli.run import CONTEXT, PipelineChoice, history_options, load, pipeline_options


def describe_reuse(pipe) -> str:
    """One line for the start-up banner: what is kept between requests (``LoadSettings``: reuse, prompt_cache_mb)."""
    if not pipe.reuse:
        return "off: every request prefills its whole prompt"
    cache = pipe.engines.prompt_cache
    if cache is None:
        return "the last request's context is kept; no prompt cache"
    if not pipe.engines.target.can_snapshot:
        return (
            f"the last request's context is kept; no prompt cache on provider {pipe.engines.target.__class__.__name__}"
        )
    return f"the last request's context is kept, and up to {cache.limit / 2**20:g} MB of earlier ones in host memory"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@click.command(context_settings=CONTEXT)
@pipeline_options
@history_options
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on. 127.0.0.1 answers this machine only; 0.0.0.0 every network (then use --api-key).",
)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option(
    "--api-key",
    "api_keys",
    envvar="SPECDEC_API_KEY",
    multiple=True,
    help="Require 'Authorization: Bearer KEY' on every route but /health. Repeatable: each key is a client with "
    "its own history (never shared between keys). Also read from $SPECDEC_API_KEY (keys separated by spaces), "
    "which keeps the keys out of the process list.",
)
@click.option(
    "--max-queue",
    type=click.IntRange(1, 4096),
    default=16,
    show_default=True,
    help="Requests that may wait while one is generated; more are answered 429 with a Retry-After header.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(0, 86400, min_open=True),
    default=600.0,
    show_default=True,
    help="Seconds a request may take, time in the queue included; then it is cancelled with a 504 error.",
)
@click.option(
    "--max-body-bytes",
    type=click.IntRange(1024, 64 << 20),
    default=1 << 20,
    show_default=True,
    help="Larger request bodies are refused with 413.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(8, 1 << 20),
    default=1024,
    show_default=True,
    help="Open connections at most (kept below the open-files limit, which the server raises to its hard limit). "
    "Beyond it, a new connection replaces the one waiting longest for a request's bytes, or gets 503.",
)
@click.option("--model-name", default=None, help="The model id clients send (default: the bundle folder's name).")
@click.option(
    "--reuse/--no-reuse",
    default=True,
    show_default=True,
    help="A request keeps the KV prefix it shares with the previous one (a system prompt, the next turn) instead "
    "of prefilling it again.",
)
@click.option(
    "--prompt-cache-mb",
    type=click.FloatRange(0, 2**20),
    default=DEFAULT_MB,
    show_default=True,
    help="Host memory for snapshots of earlier requests' KV caches (several conversations or system prompts in "
    "turn: a request that shares more with one of them restores it instead of prefilling). 0 turns it off.",
)
def serve(choice: PipelineChoice, model_name, api_keys, **server):
    """Serve a bundle over an OpenAI-compatible HTTP API (needs the `serve` extra).

    POST /v1/chat/completions and /v1/completions (streaming or not), GET /v1/models,
    /health and /metrics (Prometheus). One pipeline answers the requests in order.

    \b
    Examples:
      specdec-edge serve bundles/smollm2
      specdec-edge serve bundles/smollm2 --method pld --port 8080 --max-queue 4 --timeout 120
      SPECDEC_API_KEY=secret specdec-edge serve bundles/smollm2 --host 0.0.0.0 --port 8000
    \b
    Then, from Python (pip install openai):
      from openai import OpenAI
      client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret")
      client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}])
    """
    from specdec_edge.serve import check_extra, run

    check_extra()
    from specdec_edge.runtime.ov_prefill import prefill_name
    from specdec_edge.serve.connections import HEADER_TIMEOUT_S, connection_limits

    api_keys = tuple(key for key in api_keys if key)
    settings = choice.load  # with --reuse, --prompt-cache-mb, --history and --history-mb
    if settings.history:  # one store per key: all of them must fit, before the bundle loads
        check_history_memory(settings.history_mb, max(1, len(api_keys)), flag="--history-mb")
    pipe = load(choice)
    warm = pipe.warm_up()  # a first long prompt would wait for the prefill runtime's compile
    runtime = prefill_name(pipe.engines.target)  # "onnxruntime" where one that failed under auto was dropped
    if warm and runtime != "onnxruntime":
        click.echo(f"specdec-edge: prefill runtime ({runtime}) ready in {warm:.1f} s", err=True)
    model = model_name or Path(choice.bundle).resolve().name
    host = server["host"]  # with port, max_queue, timeout_s and max_body_bytes: run's keywords
    if not is_loopback(host) and not api_keys:
        click.secho(
            f"warning: listening on {host} without --api-key: anyone who can reach this port can use the model"
            + (" (and share one history: see --no-history)." if settings.history else "."),
            fg="yellow",
            err=True,
        )
    click.echo(f"Serving {model!r} ({pipe.method}) on http://{host}:{server['port']}/v1 (Ctrl-C stops).")
    click.echo(f"Exactness on this device: {pipe.describe_exactness()}.")
    click.echo(f"KV reuse: {describe_reuse(pipe)} (--no-reuse, --prompt-cache-mb).")
    server["max_connections"], asked = connection_limits(server["max_connections"])[0], server["max_connections"]
    fewer = (
        f" (the open-files limit leaves fewer than --max-connections {asked})"
        if server["max_connections"] < asked
        else ""
    )
    click.echo(
        f"Connections: at most {server['max_connections']} open{fewer}; headers within "
        f"{min(HEADER_TIMEOUT_S, server['timeout_s']):g} s, a request within --timeout of its first byte."
    )
    if settings.history:
        clients = f"each of the {len(api_keys)} API keys" if len(api_keys) > 1 else "the one client"
        click.echo(f"History: up to {settings.history_mb:g} MiB for {clients} (--no-history turns it off).")
    run(pipe, model=model, api_key=api_keys, **server)
