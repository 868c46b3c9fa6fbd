"""One way to replace a file: write a temporary file beside it, then rename it into place.

A reader (another process, a crash halfway) sees the old file or the whole new one, never a part.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path


def write_atomic(
    path: str | Path, data: str | bytes | None = None, *, write: Callable[[Path], None] | None = None, suffix=".tmp"
) -> None:
    """Write ``data`` (or call ``write(temp_path)``) to a temporary file beside ``path``, then rename it onto
    ``path``. ``suffix``: the temporary file's ending (``np.savez`` wants ``.npz``). On any error the temporary
    file is removed and the error raised; the caller decides whether a cache that cannot be written matters."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}{suffix}")
    try:
        if write is not None:
            write(tmp)
        else:
            tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
