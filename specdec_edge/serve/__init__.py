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


def run(pipe, *, host: str, port: int, model: str, log_level: str = "info", **settings) -> None:
    """Serve ``pipe`` on ``host:port`` until interrupted; ``settings`` go to ``app.create_app``."""
    check_extra()
    import uvicorn

    from specdec_edge.serve.app import create_app

    app = create_app(pipe, model=model, **settings)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
