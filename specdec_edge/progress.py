"""The one hook through which the package reports work that takes a while: measuring this device's step costs
(``api/step_costs.py``) or its exactness verdict (``runtime/verdicts.py``), seconds each, once per device.

A ``Progress`` takes one line. The Python API is silent unless it is given one
(``Pipeline.load(progress=print)``); the commands pass ``to_stderr``. Light: the standard library only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

Progress = Callable[[str], None]


def report(progress: Progress | None, line: str) -> None:
    """Hand ``line`` to ``progress``; nothing when there is none."""
    if progress is not None:
        progress(line)


def to_stderr(line: str) -> None:
    """What the commands report with: the line on stderr, at once."""
    print(line, file=sys.stderr, flush=True)
