"""How the long-running commands (``vgpu extender``, ``device-plugin``, ``monitor``,
``dra-plugin``) log: one line per record in one format, and without urllib3's own retry warnings.

The kubernetes client retries a refused or broken connection itself (three times), and urllib3
logs a WARNING for each try (``Retrying (Retry(total=2, ...)) after connection broken by ...``)
before our code logs the one line that names the call, the server and the cause
(:func:`vgpu.kube.replies.wrap`). Those are left out unless the level is DEBUG.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIETED = ("urllib3.connectionpool",)


def configure(level: str = "INFO") -> None:
    """The root logger at ``level`` (a name: DEBUG, INFO, ...) in :data:`FORMAT`; urllib3's
    connection pool at ERROR unless ``level`` is DEBUG."""
    logging.basicConfig(level=level.upper(), format=FORMAT)
    if logging.getLevelName(level.upper()) != logging.DEBUG:
        for name in QUIETED:
            logging.getLogger(name).setLevel(logging.ERROR)
