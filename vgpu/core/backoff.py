"""The one retry delay: start small, double after each failure up to a ceiling, reset on success.

Pure (no threads of its own): the informers' relists (:mod:`vgpu.kube.informer`) and the device
plugin's registration with kubelet (:mod:`vgpu.deviceplugin.server`) each hold one.
"""

from __future__ import annotations

import threading


class Backoff:
    """Delays ``initial_s``, ``initial_s * factor``, ... capped at ``max_s``; ``reset`` starts over.

    ``max_s == initial_s`` gives a fixed delay.
    """

    def __init__(self, initial_s: float = 0.5, max_s: float = 10.0, factor: float = 2.0) -> None:
        if initial_s < 0 or max_s < initial_s or factor < 1:
            raise ValueError(f"bad backoff: initial {initial_s}, max {max_s}, factor {factor}")
        self.initial_s = initial_s
        self.max_s = max_s
        self.factor = factor
        self.current_s = initial_s  # the delay the next failure waits

    def next(self) -> float:
        """The delay to wait after this failure; the one after it grows."""
        delay = self.current_s
        self.current_s = min(self.current_s * self.factor, self.max_s)
        return delay

    def reset(self) -> None:
        """A success: the next failure waits ``initial_s`` again."""
        self.current_s = self.initial_s

    def wait(self, stop: threading.Event) -> bool:
        """Wait the next delay, or less when ``stop`` is set; returns whether it was."""
        return stop.wait(self.next())
