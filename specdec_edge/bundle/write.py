"""Writing bundles (and other output folders) safely: an output that can be written, staging folders renamed
into place, races between writers, and full, read-only or unwritable file systems.

``prepare_out_dir`` checks ``--out`` before any long work (a real write); ``StagingDir`` stages a bundle beside
it, locked while its export runs, and ``commit`` renames it into place (refusing, without ``force``, an
output another writer filled meanwhile); ``remove_stale_staging`` removes the staging folders of killed
exports; ``disk_errors`` turns file-system errors into one line.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from specdec_edge.atomic import write_atomic
from specdec_edge.bundle.hashes import file_table
from specdec_edge.bundle.schema import MANIFEST, Manifest
from specdec_edge.errors import BundleError

try:
    import fcntl
except ImportError:  # Windows: no flock; stale staging folders are then left for the user to delete
    fcntl = None


def prepare_out_dir(out: Path, force: bool) -> None:
    """Refuse to overwrite a non-empty directory unless ``force``, and an output whose folder cannot be
    written (read-only file system, no permission): checked by a real write, before any long work."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise BundleError(f"--out {out} is a file; choose a directory path for the bundle.")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise BundleError(
            f"output directory {out} already exists and is not empty; "
            "pass --force to replace it or choose another --out."
        )
    check_writable(out.resolve().parent, f"--out {out}", "choose another --out")


def check_writable(folder: Path, what: str, fix: str) -> None:
    """Refuse, in one line naming ``what`` and the ``fix``, a ``folder`` (or the nearest existing folder above
    it) that cannot be written: read-only file system, no permission. Checked by a real write."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent  # the folders to be made are made in the nearest one that exists
    if not folder.is_dir():
        raise BundleError(f"{what}: {folder} is a file, not a folder; {fix}.")
    try:  # permission bits say little for root or on read-only mounts: try a write
        with tempfile.TemporaryFile(dir=folder, prefix=".specdec-probe-"):
            pass
    except OSError as e:
        raise BundleError(f"{what}: {disk_problem(e, folder)}; {fix}.") from None


def disk_problem(e: OSError, where: Path | str, need: int | None = None) -> str:
    """One line for a file system error while writing into ``where``: a full, read-only or unwritable file
    system (with the space ``need`` bytes would take, and what is free, for a full one)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        line = f"the file system of {where} is full ({e.strerror})"
        free = free_bytes(where)
        if need:
            line += f": the bundle needs about {need / 1e6:.1f} MB"
            line += f", {free / 1e6:.1f} MB are free" if free is not None else ""
        elif free is not None:
            line += f", {free / 1e6:.1f} MB free"
        return line
    if e.errno == errno.EROFS:
        return f"the file system of {where} is read-only ({e.strerror})"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"no permission to write in {where} ({e.strerror})"
    return f"cannot write in {where} ({e.strerror or e})"


DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


@contextlib.contextmanager
def disk_errors(out: Path, need: int | None = None):
    """Turn a full, read-only or unwritable file system met while writing ``out`` into one ``BundleError``
    line (for a full one, with the space ``need`` bytes take); other errors pass through."""
    try:
        yield
    except OSError as e:
        if e.errno not in DISK_ERRNOS:
            raise
        where = Path(out).resolve().parent
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        todo = "free some space or choose another --out" if full else "choose another --out"
        raise BundleError(f"could not write {out}: {disk_problem(e, where, need)}; {todo}.") from None


def free_bytes(where: Path | str) -> int | None:
    """Bytes free for this user in the file system of ``where`` (or of its nearest existing folder)."""
    path = Path(where)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


STALE_GRACE_S = 5.0  # a staging folder this young may belong to an export that is about to lock it


def _lock(path: Path):
    """An exclusive, non-blocking lock on the folder ``path`` held while the returned file descriptor is open
    (None where the platform has no ``flock``); ``BlockingIOError`` when another process holds it."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_stale_staging(out: Path) -> list[Path]:
    """Remove the ``.OUT.partial-*`` folders of earlier exports to ``out`` that were killed (``kill -9``,
    a power cut): those that no running export holds locked. Returns the folders removed."""
    out = Path(out)
    removed = []
    for path in out.parent.glob(f".{out.name}.partial-*"):
        try:
            if not path.is_dir() or path.is_symlink() or time.time() - path.stat().st_mtime < STALE_GRACE_S:
                continue
            fd = _lock(path)
        except OSError:  # locked by a running export, or gone meanwhile
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


class StagingDir:
    """A temp dir next to ``out``; ``commit`` writes the manifest and renames it into place.

    Used as a context manager: on any exception the staging dir is removed, so an
    interrupted or failed export leaves nothing behind. The staging dir is locked while it lives, so that
    later exports can tell the folders of killed ones (removed when a new one starts) from running ones.
    Without ``force``, ``commit`` refuses an ``out`` that another writer filled meanwhile.
    """

    def __init__(self, out: Path, force: bool = False):
        self.out = Path(out).resolve()
        self.force = force
        prepare_out_dir(self.out, force)
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=self.out.parent))
        except OSError as e:
            raise BundleError(f"--out {out}: {disk_problem(e, self.out.parent)}; choose another --out.") from None
        self._fd = _lock(self.path)
        remove_stale_staging(self.out)

    def __enter__(self) -> StagingDir:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.path.exists():
            shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def commit(self, manifest_without_files: dict) -> Path:
        data = dict(manifest_without_files)
        data["files"] = file_table(self.path)
        Manifest.from_json(data)  # the manifest must load before it is written
        write_atomic(self.path / MANIFEST, json.dumps(data, indent=2, sort_keys=False) + "\n")
        if not self.force:
            # rename(2) replaces an empty folder but refuses a non-empty one: a bundle that another export
            # (or anyone) wrote to ``out`` since this one started is kept, and this one fails.
            try:
                os.rename(self.path, self.out)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise
                raise BundleError(
                    f"{self.out} was written by another export (or someone) while this one ran, and is kept; "
                    "pass --force to replace it, or choose another --out."
                ) from None
        elif self.out.exists():
            # Swap: move the old bundle aside, move the new one in, then delete the old.
            trash = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
            os.replace(self.out, trash / "old")
            os.replace(self.path, self.out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self.path, self.out)
        return self.out
