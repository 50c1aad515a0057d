"""Old checkpoints deleted in the background: one thread at a time removes the directories a save
took out of sight (``axon4d.files.ckptfiles.publish``), so that no rank waits for a deletion of
16·W files; its failures are logged and kept for ``wait_deletions``, which the next save and the
process's exit call.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import threading

_log = logging.getLogger(__name__)
_deleting: threading.Thread | None = None  # the thread removing old checkpoints, one at a time
_deletion_failures: list[str] = []


def delete_in_background(doomed: list[str]) -> None:
    """Remove the directories ``doomed`` (hidden names, ``ckptfiles._discard``) in a thread of
    their own, so that no rank waits for a deletion of 16·W files. A failure is logged (logger
    ``axon4d.files.ckptdelete``, ERROR) and kept for ``wait_deletions``; the leftover is removed by
    the next save. The thread is not a daemon: the process waits for it at exit."""
    global _deleting
    wait_deletions()

    def remove() -> None:
        for d in doomed:
            try:
                shutil.rmtree(d)
            except OSError as e:
                message = f"could not delete the old checkpoint {d}: {type(e).__name__}: {e}"
                _log.error("%s; the next save removes what is left", message)
                _deletion_failures.append(message)

    _deleting = threading.Thread(target=remove, name="axon4d-ckpt-delete", daemon=False)
    _deleting.start()


def wait_deletions() -> list[str]:
    """Wait for the old checkpoints being deleted in the background (``delete_in_background``);
    return the failures since the last call (each also logged when it happened)."""
    global _deleting
    if _deleting is not None:
        _deleting.join()
        _deleting = None
    failures = list(_deletion_failures)
    _deletion_failures.clear()
    return failures


atexit.register(wait_deletions)
