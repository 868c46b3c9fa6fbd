"""Checks of single values read from users, requests and manifests (shared by their validators)."""

from __future__ import annotations

import numpy as np


def is_int(x) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)
