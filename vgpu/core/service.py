"""A named background loop: one daemon thread, a stop Event, and a stop that joins it.

The extender's sync loops, the device plugin's reporter, watcher, health and sweep loops, the
arbiter and the informers all run this way. ``Service(name, body)`` runs ``body(stop)`` until it
returns (it should return soon after ``stop`` is set); ``Service.every(name, interval_s, step)``
calls ``step()`` every ``interval_s`` and logs, rather than dies of, a failing step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Service:
    """``body(stop)`` on a daemon thread named ``name``; ``stop()`` sets ``stop`` and joins it.

    Several services may share one ``stop`` Event (pass it in): setting it ends them all.
    """

    def __init__(
        self, name: str, body: Callable[[threading.Event], None], stop: threading.Event | None = None
    ) -> None:
        self.name = name
        self.body = body
        self.stopping = stop if stop is not None else threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def every(
        cls,
        name: str,
        interval_s: float,
        step: Callable[[], None],
        stop: threading.Event | None = None,
        logger: logging.Logger | None = None,
    ) -> Service:
        """Call ``step()`` every ``interval_s`` (first after one interval) until stopped."""
        logger = logger or log

        def body(stopping: threading.Event) -> None:
            while not stopping.wait(interval_s):
                try:
                    step()
                except Exception:  # the loop must outlive any one failing step
                    logger.exception("%s failed; continuing", name)

        return cls(name, body, stop)

    def start(self) -> Service:
        """Start the thread (once: a running service is left as it is)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self.body, args=(self.stopping,), name=self.name, daemon=True
            )
            self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float | None = 5.0) -> None:
        """Set the stop Event and wait up to ``timeout_s`` for the thread (None: no wait)."""
        self.stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None and timeout_s is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
