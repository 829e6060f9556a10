"""Waiting for a condition: one loop for every test."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def poll(
    check: Callable[[], Any],
    timeout: float = 5.0,
    every: float = 0.01,
    ignore: tuple[type[BaseException], ...] = (),
) -> Any:
    """``check()`` until it returns a true value or ``timeout`` seconds pass; what it returned last.

    On time-out that is the last false value (or the last exception of ``ignore`` it raised), so a
    caller can assert on it with its own message. Exceptions of ``ignore`` count as not yet.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            last = check()
        except ignore as err:
            last = err
        if last and not isinstance(last, BaseException):
            return last
        if time.monotonic() >= deadline:
            return last
        time.sleep(every)


def wait_for(
    check: Callable[[], Any],
    what: str,
    timeout: float = 5.0,
    every: float = 0.01,
    ignore: tuple[type[BaseException], ...] = (),
) -> Any:
    """:func:`poll`, and an ``AssertionError`` naming ``what`` (and the last value) on time-out;
    otherwise the true value ``check()`` returned."""
    last = poll(check, timeout, every, ignore)
    if last and not isinstance(last, BaseException):
        return last
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})")
