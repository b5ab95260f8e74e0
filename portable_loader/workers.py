"""Former home of the prefetch engines, now in ``portable_loader.engine``; the names stay importable.

Example:
    >>> from portable_loader.workers import Producer, WorkerError   # same objects as in engine
"""

from portable_loader.engine import ProcessEngine, Producer, WorkerError, thread_engine

__all__ = ["Producer", "thread_engine", "ProcessEngine", "WorkerError"]
