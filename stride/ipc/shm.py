"""Numpy arrays over POSIX shared memory.

One :class:`SharedArray` is one segment holding one C-contiguous array. The creator owns the segment and
is the only one that unlinks it; an attacher maps the same memory (no copy: a write after attach is seen
by both) and only closes its mapping. No mapping is registered with Python's resource tracker, so a
process that exits cannot unlink, or warn about, a segment it does not own.

Each launch prefixes its segment names with ``stride-<launch_id>-`` (:meth:`IpcConfig.shm_name`), so
:func:`remove_launch_segments` can clear a crashed launch without knowing which segments it had made.
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]  # CPython's shm_open/shm_unlink (POSIX only)
import mmap
import os
from typing import Any

import numpy as np

SHM_DIR = "/dev/shm"


class SharedArray:
    """A numpy view over a named shared-memory segment. Use :meth:`create` or :meth:`attach`."""

    def __init__(self, name: str, buf: mmap.mmap, shape: tuple[int, ...], dtype: Any, owner: bool) -> None:
        self.name = name
        self.owner = owner
        self._buf: mmap.mmap | None = buf
        self.array: np.ndarray = np.ndarray(shape, dtype=np.dtype(dtype), buffer=buf)

    @staticmethod
    def _map(name: str, flags: int, nbytes: int | None) -> mmap.mmap:
        # shm_open directly, not multiprocessing.shared_memory: that one registers every mapping with a
        # resource tracker, which a spawned child shares with its parent and which then unlinks or warns
        # about segments the child never owned. Crash cleanup is remove_launch_segments' job instead.
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if nbytes is not None:
                os.ftruncate(fd, nbytes)
            size = os.fstat(fd).st_size
            return mmap.mmap(fd, size)
        finally:
            os.close(fd)

    @classmethod
    def create(cls, name: str, shape: tuple[int, ...], dtype: Any, fill: int | float | None = 0
               ) -> SharedArray:
        """Make a new segment (fails if ``name`` exists) and, unless ``fill`` is None, fill it."""
        nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
        buf = cls._map(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, nbytes)
        out = cls(name, buf, shape, dtype, owner=True)
        if fill is not None:
            out.array.fill(fill)
        return out

    @classmethod
    def attach(cls, name: str, shape: tuple[int, ...], dtype: Any) -> SharedArray:
        """Map an existing segment; the shape and dtype must fit in it."""
        buf = cls._map(name, os.O_RDWR, None)
        need = int(np.prod(shape)) * np.dtype(dtype).itemsize
        have = len(buf)
        if have < need:
            buf.close()
            raise ValueError(f"segment {name} has {have} bytes, layout needs {need}")
        return cls(name, buf, shape, dtype, owner=False)

    def close(self) -> None:
        """Drop this process's mapping; the owner also unlinks the segment. Safe to call twice."""
        if self._buf is None:
            return
        buf, self._buf = self._buf, None
        # The numpy view must go before the mapping can be released.
        self.array = np.empty(0, dtype=self.array.dtype)
        try:
            buf.close()
        except BufferError:  # someone still holds a view: the mapping goes when they do
            pass
        if self.owner:
            try:
                _posixshmem.shm_unlink("/" + self.name)
            except FileNotFoundError:
                pass

    def __enter__(self) -> SharedArray:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch_segments(prefix: str) -> list[str]:
    """Names of the segments in ``/dev/shm`` that start with ``prefix``."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def remove_launch_segments(prefix: str) -> list[str]:
    """Unlink every segment of a launch (after a crash, the launcher's last step). Returns what it removed."""
    if not prefix.startswith("stride-") or len(prefix) < len("stride-x-"):
        raise ValueError(f"refusing to remove segments with prefix {prefix!r}")
    removed = []
    for name in launch_segments(prefix):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed
