"""What a task's failure means, in one place: the machine's, the infrastructure's, or a record's.

A record's own failure comes back *per item* (a prompt that cannot be built, an engine
item's error, a judge's verdict) and ends that record. Anything *raised* while a task
works -- by the engine, the judge's pool, storage -- is the infrastructure's and never a
record's terminal state: the task fails with it, and the pool decides what that means as
it does for every task. A retryable failure is retried (then the shard is quarantined); a
machine's full disk (``is_machine_error``), a task id held with another spec
(``TaskConflict``) or a dead engine stops the run instead, so that a re-run resumes.

Imports nothing of the project: the runtime, the HTTP worker, the in-process pool and
the judging all read it.
"""

from __future__ import annotations

import errno

# Disk full, quota exceeded, read-only filesystem, I/O error: the machine's fault, not the
# shard's. Retrying cannot help and quarantining would blame the data: the run stops with
# the error instead (in-process: re-raised; over HTTP: 507), and resumes once it is fixed.
MACHINE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})


def is_machine_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in MACHINE_ERRNOS


class JudgePoolError(RuntimeError):
    """The judge pool could not judge a retry task's wave (it failed the wave, or the wave's
    scratch files could not be written or read): the task fails as a whole and is retried
    (its checkpoints keep every record's progress), as an infer task whose storage failed
    is; never a record's error, and never "the task's input is unusable" (422)."""


__all__ = ["MACHINE_ERRNOS", "JudgePoolError", "is_machine_error"]
