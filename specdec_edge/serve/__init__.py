"""`specdec-edge serve`: an OpenAI-compatible HTTP server over one loaded ``Pipeline``.

A client of ``Pipeline`` only (it imports nothing from ``runtime/`` or ``speculative/``):
``protocol.py`` checks requests and builds the OpenAI objects, ``worker.py`` runs generations
in one thread in arrival order, ``metrics.py`` keeps the Prometheus metrics and ``app.py`` is
the Starlette app. Needs the ``serve`` extra (starlette, uvicorn, prometheus-client), which is
imported only when a server starts.
"""

from __future__ import annotations

import importlib.util

from specdec_edge.errors import SpecdecError

EXTRA = ("starlette", "uvicorn", "prometheus_client")


def check_extra() -> None:
    missing = [name for name in EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise SpecdecError(
            f"the server needs {', '.join(missing)}, which is not installed: pip install 'specdec-edge[serve]' "
            "(scripts/install.sh installs it)."
        )


def run(
    pipe, *, host: str, port: int, model: str, max_connections: int = 1024, log_level: str = "info", **settings
) -> None:
    """Serve ``pipe`` on ``host:port`` until interrupted; ``settings`` go to ``app.create_app``.
    ``max_connections``: open connections at most (``connections.connection_limits`` keeps it below the descriptor
    limit, which it raises)."""
    check_extra()
    import uvicorn

    from specdec_edge.serve.app import create_app
    from specdec_edge.serve.connections import (
        HEADER_TIMEOUT_S,
        connection_limits,
        guarded_protocol,
        quiet_accept_errors,
    )

    app = create_app(pipe, model=model, **settings)
    header_s = min(HEADER_TIMEOUT_S, settings.get("timeout_s", HEADER_TIMEOUT_S))
    max_connections, backlog = connection_limits(max_connections)
    protocol = guarded_protocol(max_connections=max_connections, header_timeout_s=header_s)
    quiet_accept_errors()
    uvicorn.run(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, http=protocol, backlog=backlog
    )
