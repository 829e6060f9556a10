"""The one HOST:PORT parser of the project's listen flags (``--monitor-listen``, ``--listen``,
``--metrics-listen``).

``HOST:PORT``; an IPv6 host in brackets (``[::1]:9394``), given back without them, as
``socket.bind`` takes it; an empty host (``:9394``) is every IPv4 address, ``0.0.0.0``; the port
ASCII digits from 0 (any free port) to 65535. Anything else is refused with a ``ConfigError``
naming the flag: an IPv6 address without brackets (``::1:9394`` could be host ``::1`` port 9394
or host ``::1:9394`` with no port), stray or unmatched brackets, a port out of range or with a
sign, spaces or non-ASCII digits.
"""

from __future__ import annotations

from vgpu.core.errors import ConfigError

ANY_HOST = "0.0.0.0"
MAX_PORT = 65535


def split_hostport(text: str, flag: str) -> tuple[str, int]:
    """(host, port) of ``text``; ``ConfigError`` naming ``flag`` and what to write instead."""

    def bad(why: str) -> ConfigError:
        return ConfigError(flag, "", f"{text!r} is not HOST:PORT ({why}): e.g. 0.0.0.0:9394 or [::1]:9394")

    host, sep, port = text.rpartition(":")
    if not sep:
        raise bad("no port")
    if not (port.isascii() and port.isdigit()):
        raise bad(f"port {port!r} is not a number")
    if int(port) > MAX_PORT:
        raise bad(f"port {port} is over {MAX_PORT}")
    if host.startswith("["):
        if not host.endswith("]") or len(host) == 2 or ":" not in host:
            raise bad("brackets hold an IPv6 address, as [::1]")
        host = host[1:-1]
        if "[" in host or "]" in host:
            raise bad("brackets hold an IPv6 address, as [::1]")
    elif "[" in host or "]" in host:
        raise bad("brackets hold an IPv6 address, as [::1]")
    elif ":" in host:
        raise bad("an IPv6 host goes in brackets, as [::1]:9394")
    if host != host.strip() or " " in host:
        raise bad("spaces in the host")
    return host or ANY_HOST, int(port)
