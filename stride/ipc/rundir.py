"""The private runtime directory of one launch: socket files live here, mode 0700, removed at shutdown.

The directory also names its launcher (``launcher.pid``), so a launch whose launcher was killed before it could
clean up is recognised by the next launch under the same root, which removes the directory and the launch's
shared-memory segments (:func:`sweep_stale_launches`)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from stride.config import IpcConfig, default_runtime_root
from stride.ipc.shm import remove_launch_segments

log = logging.getLogger(__name__)

OWNER_FILE = "launcher.pid"


def make_ipc_config(root: str | None = None) -> IpcConfig:
    """Create a fresh 0700 directory for a launch and the :class:`IpcConfig` that points into it."""
    launch_id = IpcConfig.new_launch_id()
    run_dir = tempfile.mkdtemp(prefix=f"stride-{launch_id}-", dir=root or default_runtime_root())
    os.chmod(run_dir, 0o700)  # mkdtemp already makes 0700; say it where a reader looks for it
    # ipc:// paths are limited to ~107 bytes by sockaddr_un; fail here rather than at bind time.
    longest = IpcConfig(run_dir=run_dir, launch_id=launch_id).address("tokenizer-999")
    if len(longest) - len("ipc://") > 100:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise ValueError(f"runtime directory path too long for unix sockets: {run_dir}")
    return IpcConfig(run_dir=os.path.abspath(run_dir), launch_id=launch_id)


def remove_run_dir(ipc: IpcConfig) -> None:
    """Remove the launch's runtime directory and every socket file in it."""
    shutil.rmtree(ipc.run_dir, ignore_errors=True)


def write_owner(ipc: IpcConfig, pid: int | None = None) -> None:
    """Record the launcher's pid in its runtime directory (for :func:`sweep_stale_launches`)."""
    Path(ipc.run_dir, OWNER_FILE).write_text(str(pid or os.getpid()))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    try:  # a killed launcher nobody has reaped yet is a zombie: dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def sweep_stale_launches(root: str, keep: str = "") -> list[str]:
    """Remove the runtime directory and shared-memory segments of every launch under ``root`` whose launcher is
    dead (killed before it could clean up). A directory that names no launcher is left alone: it may be one that
    is being created. Returns what was removed."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        parts = entry.name.split("-")
        if len(parts) < 3 or parts[0] != "stride" or not parts[1].isalnum() or entry.path == keep:
            continue
        try:
            pid = int(Path(entry.path, OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if _alive(pid):
            continue
        removed += [f"/dev/shm/{name}" for name in remove_launch_segments(f"stride-{parts[1]}-")]
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    if removed:
        log.warning("removed what killed launches left behind: %s", ", ".join(removed))
    return removed
