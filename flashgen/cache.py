"""The on-disk kernel cache: one folder per entry under ``$FLASHGEN_CACHE`` (default ``~/.cache/flashgen``).

An entry is built in a private staging folder and published by one atomic rename, so
a reader sees a whole entry or none: a build killed half-way, a full disk or two
processes building the same key never leave a half-written entry behind. An entry
that was damaged after it was published (a truncated file) is detected when it is
read, reported, and rebuilt. A folder that cannot hold the cache is refused with an
error naming ``FLASHGEN_CACHE``. A cache that is only read (prebuilt, mounted read-only)
needs no write access.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

#: The file that completes an entry: it is written last, inside the staging folder.
DONE = "entry.json"


class CacheError(RuntimeError):
    """The cache folder cannot be used; the message names FLASHGEN_CACHE."""


def root() -> Path:
    """The cache folder (not created)."""
    env = os.environ.get("FLASHGEN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flashgen"


def writable_root() -> Path:
    """The cache folder, created if needed; CacheError when it cannot take new entries."""
    path = root()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheError(_unusable(path, exc.strerror or str(exc))) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CacheError(_unusable(path, "not writable"))
    return path


def _unusable(path: Path, why: str) -> str:
    where = "FLASHGEN_CACHE" if os.environ.get("FLASHGEN_CACHE") else "the default cache folder (FLASHGEN_CACHE is unset)"
    return (f"the kernel cache folder {path} cannot be used ({why}); it is {where}: "
            "set FLASHGEN_CACHE to a writable folder")


def warn(msg: str) -> None:
    print(f"[flashgen] {msg}", file=sys.stderr, flush=True)


def read_entry(entry: Path, files: tuple[str, ...] = ()) -> dict | None:
    """The record of a published entry, or None when there is none; a damaged entry (unreadable record,
    a listed file missing or of the wrong size) is reported and removed so the caller rebuilds it."""
    record_path = entry / DONE
    try:
        record = json.loads(record_path.read_text())
        sizes = record["sizes"]
        for name in files:
            size = (entry / name).stat().st_size
            if size != sizes[name]:
                raise ValueError(f"{name} has {size} bytes, {sizes[name]} were written")
        return record
    except FileNotFoundError as exc:
        if not entry.exists():
            return None
        reason = f"{Path(exc.filename).name if exc.filename else 'a file'} is missing"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = str(exc)
    discard(entry, f"damaged cache entry {entry} ({reason}): rebuilding it")
    return None


def discard(entry: Path, why: str) -> None:
    """Remove a damaged entry (moved aside first, so a concurrent reader never sees it half-deleted)."""
    warn(why)
    aside = entry.with_name(f".{entry.name}.damaged-{os.getpid()}")
    with contextlib.suppress(OSError):
        os.rename(entry, aside)
        remove(aside)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@functools.lru_cache(maxsize=None)
def _umask() -> int:
    """The process's umask (read by setting it and putting it back: once, not per entry)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_record(staging: Path, record: dict, files: tuple[str, ...]) -> None:
    """Complete a staged entry: its record, with the size of each file so truncation is detected."""
    record = {**record, "sizes": {name: (staging / name).stat().st_size for name in files}}
    (staging / DONE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def staging(entry: Path) -> Iterator[Path]:
    """A private folder to build ``entry`` in; published by an atomic rename when the block completes.

    Another process that published the same entry first wins (its entry is as good as ours)."""
    parent = writable_root() if entry.parent == root() else entry.parent
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=parent))
    except OSError as exc:
        raise CacheError(_unusable(parent, exc.strerror or str(exc))) from None
    try:
        yield tmp
        if not (tmp / DONE).exists():
            raise RuntimeError(f"cache entry {entry.name} was staged without its record")
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's folder is private; an entry is as readable as any new folder
        try:
            os.rename(tmp, entry)
        except OSError:
            if (entry / DONE).exists():  # published by a concurrent build
                return
            discard(entry, f"replacing the incomplete cache entry {entry}")
            os.rename(tmp, entry)
    finally:
        if tmp.exists():
            remove(tmp)
