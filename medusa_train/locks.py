"""Advisory locks that keep two runs out of the same files: ``train_heads.py``'s output_dir, distillation's
rows. A lock goes with the process that holds it (killed, it is released)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)


def try_lock(path: Path) -> tuple[IO[str] | None, str | None]:
    """Lock ``path`` (created where missing) for this process: ``(handle, None)``, the handle to keep open while the
    lock is needed (closing it releases the lock), or ``(None, pid)`` where another process holds it (the pid it
    wrote there, or "unknown"). Where the system has no ``fcntl`` (Windows), or the filesystem no locks (NFS without
    its lock daemon, Lustre mounted noflock), nothing is locked, with a warning: ``(None, None)``."""
    try:
        import fcntl
    except ImportError:
        return None, None
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # (no run holds it: every run was
            handle.close()  # refused, naming a finished one's pid)
            logger.warning("%s cannot be locked (%s): this filesystem takes no locks, so nothing keeps another run "
                           "out of the same files", path, err.strerror or err)
            return None, None
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        return None, holder
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle, None
