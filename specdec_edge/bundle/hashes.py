"""A bundle's checksums: the sha256 of its files, checked once per file version (``HashRecord``) or all again.

``check_hashes`` compares each file with its sha256 once per file version (a record in the user cache remembers
files that matched); ``verify_bundle`` re-hashes everything; ``manifest_digest`` keys what is measured per bundle.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from specdec_edge.atomic import write_atomic
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.bundle.schema import MANIFEST, Manifest
from specdec_edge.errors import BundleError
from specdec_edge.user_cache import cache_dir


def manifest_digest(root: Path | str) -> str:
    """sha256 of a bundle's manifest.json, which lists every file's sha256: the key of what is measured per bundle
    (step costs, exactness verdicts)."""
    return hashlib.sha256((Path(root) / MANIFEST).read_bytes()).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_table(root: Path) -> dict:
    """sha256 and size of every file under ``root`` except the manifest."""
    table = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(root).as_posix()
            table[rel] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return table


def verify_bundle(bundle: Path | str) -> list[str]:
    """Re-hash every file; return the files that do not match, each with the reason when it is not the hash:
    ``rel`` (hash), ``rel (missing)``, ``rel (size N, manifest says M)``, ``rel (not in manifest)``.
    Files that match are remembered in the hash record (``check_hashes``)."""
    root = Path(bundle)
    manifest = read_manifest(root, check_files=False)
    bad, ok = [], []
    for rel, entry in manifest.files.items():
        p = root / rel
        if not p.is_file():
            bad.append(f"{rel} (missing)")
        elif p.stat().st_size != entry["size"]:
            bad.append(f"{rel} (size {p.stat().st_size}, manifest says {entry['size']})")
        elif sha256_file(p) != entry["sha256"]:
            bad.append(rel)
        else:
            ok.append((p, entry["sha256"]))
    listed = set(manifest.files)
    for p in root.rglob("*"):
        if p.is_file() and p.name != MANIFEST and p.relative_to(root).as_posix() not in listed:
            bad.append(p.relative_to(root).as_posix() + " (not in manifest)")
    HashRecord().remember(ok)
    return bad


def check_hashes(bundle: Path | str, manifest: Manifest) -> None:
    """Hash every listed file that the hash record does not already vouch for (``HashRecord``), and
    raise a ``BundleError`` naming the first one that does not match its manifest sha256.

    The first load of a bundle reads it all once (about 0.5 s per 250 MB here); later loads only
    look at each file's size and modification time."""
    root = Path(bundle)
    record = HashRecord()
    checked = []
    for rel, entry in manifest.files.items():
        path = root / rel
        if record.vouches(path, entry["sha256"]):
            continue
        if sha256_file(path) != entry["sha256"]:
            raise BundleError(
                f"bundle file {rel} in {root} does not match its sha256 in the manifest: the bundle is "
                f"corrupted. Run `specdec-edge verify {root}` to list every damaged file, then re-copy or "
                "re-export the bundle."
            )
        checked.append((path, entry["sha256"]))
    record.remember(checked)


class HashRecord:
    """Which files already matched which sha256, keyed by path, size, modification time, inode, device and
    change time (ctime), in ``<user cache>/verified.json`` (see ``user_cache.py``). A file that changes gets a
    new ctime (which, unlike the modification time, no tool can set back), so it is hashed again. Files
    modified or changed in the last ``RACY_S`` seconds are not recorded (a change within the file system's
    timestamp granularity would go unseen). Unwritable caches are ignored."""

    RACY_S = 2.0
    MAX_ENTRIES = 4096

    def __init__(self, path: Path | None = None):
        self.path = path or cache_dir() / "verified.json"
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            entries = {}
        self.entries = entries if isinstance(entries, dict) else {}

    @staticmethod
    def _key(path: Path) -> tuple[str, list] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        # ctime too: an in-place change that restores the mtime (rsync --inplace -t, cp -p, tar) still moves it
        return str(path.resolve()), [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns]

    def vouches(self, path: Path, sha256: str) -> bool:
        key = self._key(path)
        return key is not None and self.entries.get(key[0]) == [*key[1], sha256]

    def remember(self, files: list[tuple[Path, str]]) -> None:
        now = time.time_ns()
        changed = False
        for path, sha256 in files:
            key = self._key(path)
            if key is not None and now - max(key[1][1], key[1][4]) > self.RACY_S * 1e9:
                self.entries[key[0]] = [*key[1], sha256]
                changed = True
        if not changed:
            return
        live = {p: v for p, v in self.entries.items() if os.path.exists(p)}
        keep = dict(list(live.items())[-self.MAX_ENTRIES :])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps(keep))
        except OSError:
            pass
