"""The private runtime directory of one launch: socket files live here, mode 0700, removed at shutdown."""

from __future__ import annotations

import os
import shutil
import tempfile

from stride.config import IpcConfig, default_runtime_root


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
