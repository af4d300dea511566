"""Numpy arrays over POSIX shared memory.

One :class:`SharedArray` is one segment holding one C-contiguous array. The creator owns the segment and
is the only one that unlinks it; an attacher maps the same memory (no copy: a write after attach is seen
by both) and only closes its mapping. Attachers are never registered with Python's resource tracker, so
an attaching process that exits cannot unlink, or warn about, a segment it does not own.

Each launch prefixes its segment names with ``stride-<launch_id>-`` (:meth:`IpcConfig.shm_name`), so
:func:`remove_launch_segments` can clear a crashed launch without knowing which segments it had made.
"""

from __future__ import annotations

import os
import sys
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

SHM_DIR = "/dev/shm"


class SharedArray:
    """A numpy view over a named shared-memory segment. Use :meth:`create` or :meth:`attach`."""

    def __init__(self, shm: shared_memory.SharedMemory, shape: tuple[int, ...], dtype: Any,
                 owner: bool) -> None:
        self._shm: shared_memory.SharedMemory | None = shm
        self.name = shm.name
        self.owner = owner
        self.array: np.ndarray = np.ndarray(shape, dtype=np.dtype(dtype), buffer=shm.buf)

    @classmethod
    def create(cls, name: str, shape: tuple[int, ...], dtype: Any, fill: int | float | None = 0
               ) -> SharedArray:
        """Make a new segment (fails if ``name`` exists) and, unless ``fill`` is None, fill it."""
        nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
        shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        out = cls(shm, shape, dtype, owner=True)
        if fill is not None:
            out.array.fill(fill)
        return out

    @classmethod
    def attach(cls, name: str, shape: tuple[int, ...], dtype: Any) -> SharedArray:
        """Map an existing segment; the shape and dtype must fit in it."""
        if sys.version_info >= (3, 13):
            shm = shared_memory.SharedMemory(name=name, create=False, track=False)  # type: ignore[call-arg]
        else:
            shm = shared_memory.SharedMemory(name=name, create=False)
            # 3.11/3.12 register attachers too; the tracker would unlink the owner's segment at our exit.
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        need = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if shm.size < need:
            shm.close()
            raise ValueError(f"segment {name} has {shm.size} bytes, layout needs {need}")
        return cls(shm, shape, dtype, owner=False)

    def close(self) -> None:
        """Drop this process's mapping; the owner also unlinks the segment. Safe to call twice."""
        if self._shm is None:
            return
        shm, self._shm = self._shm, None
        # The numpy view must go before the mapping can be released.
        self.array = np.empty(0, dtype=self.array.dtype)
        shm.close()
        if self.owner:
            try:
                shm.unlink()
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
