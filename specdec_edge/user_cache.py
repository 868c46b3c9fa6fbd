"""Where specdec-edge keeps what it makes once per machine: the default bundle, measured step costs, the record of
files already hashed (``bundle.HashRecord``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$SPECDEC_EDGE_CACHE``, else ``$XDG_CACHE_HOME/specdec-edge``, else ``~/.cache/specdec-edge``."""
    root = os.environ.get("SPECDEC_EDGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "specdec-edge"
    )
    return Path(root)
