"""gunicorn's ``gthread`` worker, keeping a busy connection in the thread that served it.

In ``gthread`` a kept-alive connection goes back to the main thread's poller after each answer;
its next request wakes the main thread, which hands the connection to a pool thread again. That
costs two thread hand-offs and the main thread's share of the GIL per request. kube-scheduler
sends the next ``filter`` on the connection it just used, a few milliseconds after the answer,
and waits for it before it looks at the next pod, so those hand-offs sit on the scheduling path.

:class:`LingeringThreadWorker` lets the thread that answered wait up to :data:`LINGER_S` for the
connection's next request and serve it itself; a connection that stays quiet goes back to the
poller as before. Waiting costs no CPU (the thread sleeps in ``poll``), only a pool thread for
that long. Measured with bench/bench_scheduler.py (docs/scheduling.md#speed).
"""

from __future__ import annotations

import select
from typing import Any

from gunicorn.workers.gthread import ThreadWorker

LINGER_S = 0.01


def _readable_within(conn: Any, timeout_s: float) -> bool:
    """Whether the next request's bytes are there already (buffered) or arrive within timeout_s."""
    unreader = getattr(conn.parser, "unreader", None)
    buf = getattr(unreader, "buf", None)
    if buf is not None and buf.getvalue():
        return True
    pending = getattr(conn.sock, "pending", None)  # TLS records decrypted but not yet read
    if pending is not None and pending():
        return True
    try:
        poller = select.poll()
        poller.register(conn.sock.fileno(), select.POLLIN)
        return bool(poller.poll(timeout_s * 1000))
    except (OSError, ValueError):  # closed under us: gthread's own path deals with it
        return False


class LingeringThreadWorker(ThreadWorker):  # type: ignore[misc]
    linger_s = LINGER_S

    def handle(self, conn: Any) -> Any:
        keep = super().handle(conn)
        while (
            keep is True
            and self.alive
            and not getattr(conn, "is_http2", False)
            and _readable_within(conn, self.linger_s)
        ):
            keep = super().handle(conn)
        return keep
