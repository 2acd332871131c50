"""A search's next evaluations, made on a second thread while its own waits in the solver.

HiGHS releases Python's interpreter lock while it solves, so while a search's thread
waits in a branch and bound (Swin's at 16 GPUs: 11.6 s of an 80 s search on the 2-core
machine) a second thread can plan and predict the candidates the search will try next.
The search still decides everything itself and in its own order (what it prunes, which
micro-batch count or fallback comes next): it takes each evaluation it asks for from
the lookahead where that was made (waiting for one being made) or makes it itself. So its
rows are those of a search without one, and only their seconds change.

A :class:`Lookahead` starts an evaluation only while its owner's thread is inside
:func:`solving`, so the two threads compete for the interpreter only over the one
evaluation the second is finishing when a solve ends; what it makes that the search then
prunes was made on an otherwise idle core. Both threads read and fill the same caches
(graph memos, shared layouts, shared solves), whose entries are the same values whichever
thread makes them.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager

__all__ = ["Lookahead", "solving"]

_ACTIVE: contextvars.ContextVar[Lookahead | None] = contextvars.ContextVar(
    "jscaler_lookahead", default=None
)


@contextmanager
def solving() -> Iterator[None]:
    """Marks the calling thread as waiting in native code that releases the interpreter
    (the solver): a :class:`Lookahead` this thread owns makes evaluations meanwhile."""
    la = _ACTIVE.get()
    if la is None or la.owner != threading.get_ident():
        yield
        return
    la.waiting(True)
    try:
        yield
    finally:
        la.waiting(False)


class Lookahead[K: Hashable, V]:
    """``make(key)`` for the keys ``upcoming()`` names, on a second thread, while the
    owner is :func:`solving`; :meth:`get` returns ``make(key)`` either way.

    Use it as a context manager on the thread that owns it: the second thread runs in a
    copy of the owner's context (its shared caches included) and is joined on exit.
    ``upcoming()`` is called on the second thread and reads the owner's state (its best
    so far, its position): it names keys in the order the owner will probably ask for
    them, those the owner is sure not to ask for left out; a key already made or asked
    for is skipped. ``make`` must return the same value on either thread; an exception it
    raises there is raised to the owner by :meth:`get`.
    """

    def __init__(self, make: Callable[[K], V], upcoming: Callable[[], Iterable[K]]):
        self._make, self._upcoming = make, upcoming
        self._lock = threading.Condition()
        self._done: dict[K, tuple[bool, object]] = {}
        self._asked: set[K] = set()
        self._making: K | None = None
        self._waiting = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._token = None
        self.owner: int | None = None
        self.made_ahead = 0  # evaluations the owner took from the second thread

    def __enter__(self) -> Lookahead[K, V]:
        self.owner = threading.get_ident()
        self._token = _ACTIVE.set(self)
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._run,), name="jscaler-lookahead", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join()
        _ACTIVE.reset(self._token)

    def waiting(self, on: bool) -> None:
        """Whether the owner is now waiting in the solver (see :func:`solving`)."""
        with self._lock:
            self._waiting = on
            self._lock.notify_all()

    def get(self, key: K) -> V:
        """``make(key)``: the second thread's (waited for while it makes it), or made
        here."""
        with self._lock:
            self._asked.add(key)
            while self._making == key:
                self._lock.wait()
            found = self._done.pop(key, None)
        if found is None:
            return self._make(key)
        self.made_ahead += 1
        ok, value = found
        if not ok:
            raise value
        return value

    def _next(self) -> K | None:
        for key in self._upcoming():
            if key not in self._asked and key not in self._done:
                return key
        return None

    def _run(self) -> None:
        while True:
            with self._lock:
                key = None
                while not self._closed:
                    if self._waiting:
                        key = self._next()
                        if key is not None:
                            break
                    self._lock.wait()  # woken when the owner's waiting changes or it closes
                if self._closed:
                    return
                self._making = key
            try:
                found = (True, self._make(key))
            except BaseException as e:  # the owner's to see, if it asks for this key
                found = (False, e)
            with self._lock:
                self._done[key] = found
                self._making = None
                self._lock.notify_all()
