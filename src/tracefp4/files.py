"""Durable file writes: a reader sees either no file or the whole file, never a partial one; and the
one guarded read of a file a run wrote (a regular file, links not followed)."""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path
from typing import Any


def read_regular(path: str | os.PathLike[str], error: type[Exception], *, missing: str = "missing") -> bytes:
    """The bytes of ``path``, a regular file (links are not followed); ``error`` naming the path when it
    is absent (``missing`` says what that means to the caller) or not a regular file. The type is
    checked before the open, so a FIFO or device cannot block the read."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: not a regular file (links are not followed)")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    # Makes renames and creations inside ``path`` durable; without it a crash can lose the
    # directory entry of a file whose data was already fsynced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write to a unique temporary name beside ``path``, fsync, rename over ``path``, fsync the folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike[str], payload: Any, *, sort_keys: bool = True) -> None:
    """:func:`atomic_write_bytes` of ``payload`` as indented JSON (non-JSON values as ``str``)."""
    text = json.dumps(payload, indent=2, sort_keys=sort_keys, default=str, allow_nan=False) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))
