"""A service's CPU priority, for processes that share cores with the trainers (``bagpipe run`` puts every
process of a job on one machine).

``idle`` moves every thread of the process into Linux's ``SCHED_IDLE`` class: it runs on the cores the
other processes leave idle, and when it wakes it does not preempt a running one. Bagpipe's embedding
servers can take that place. A trainer prefetches rows batches ahead of its compute and needs a
write-back to be durable only before a later plan reads those rows again, so a server that answers a
little later costs it nothing. A server that preempts a trainer in the middle of its step holds back
every trainer, since they all-reduce after each step. ``SCHED_IDLE`` does not starve a thread either:
when every core is busy it still gets a small share of them (weight 3, where a thread at nice 0 has
1024). See bench/README.md, "Embedding servers at idle priority", for what it changes.
"""

from __future__ import annotations

import os

PRIORITIES = ("normal", "idle")
# Linux's scheduling classes, which os offers only where the platform has them
_CLASSES = hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_setscheduler")


def apply(priority: str) -> str:
    """Gives every thread of this process ``priority`` (threads started later inherit it from the thread
    that starts them); returns one line saying what was done, or why it could not be."""
    if priority not in PRIORITIES:
        raise ValueError(f"cpu priority: one of {', '.join(PRIORITIES)}, got {priority!r}")
    if priority == "normal":
        return "CPU priority normal"
    if not _CLASSES:
        return "CPU priority idle is not available on this platform (no SCHED_IDLE): running at normal"
    tasks = "/proc/self/task"
    tids = [int(t) for t in os.listdir(tasks)] if os.path.isdir(tasks) else [0]
    done = 0
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:  # (a thread that ended meanwhile)
            continue
        except OSError as e:
            return f"CPU priority idle: not permitted here ({e.strerror}): {done} of {len(tids)} threads idle"
        done += 1
    threads = f"{done} thread{'' if done == 1 else 's'}"
    return f"CPU priority idle: SCHED_IDLE on {threads}, and on every thread started later"


def policy_of(tid: int) -> str:
    """``idle`` or ``normal`` (any other class) for thread or process ``tid`` (0: the calling thread);
    ``normal`` where the platform has no scheduling classes to read."""
    if not _CLASSES:
        return "normal"
    return "idle" if os.sched_getscheduler(tid) == os.SCHED_IDLE else "normal"


def normal_for_this_thread() -> str | None:
    """Moves the calling thread, and the threads it starts from now on, back to the normal class: a service
    at idle priority still answers its liveness and metrics at once, whatever the trainers do (a scrape
    starved past its timeout reads as a failed process). None when it was normal already, else what was
    done, or why it could not be."""
    if not _CLASSES or os.sched_getscheduler(0) != os.SCHED_IDLE:
        return None
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError as e:
        return f"not permitted to leave SCHED_IDLE ({e.strerror}): answers wait for idle cores"
    return "SCHED_OTHER (the rest of the process stays idle)"
