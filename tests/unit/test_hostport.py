"""The one HOST:PORT parser (vgpu/core/hostport.py) of ``--monitor-listen``, ``--listen`` and
``--metrics-listen``. The extender's and the monitor's parsers it replaced disagreed: the
extender took brackets off (``[::1]``) and any port number (``:99999``); the monitor kept the
brackets (which no socket binds) and refused ports over 65535. Neither refused an IPv6 address
without brackets, unmatched brackets, or non-ASCII digits."""

from __future__ import annotations

import pytest

from vgpu.core.errors import ConfigError
from vgpu.core.hostport import split_hostport


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.0.0.0:9394", ("0.0.0.0", 9394)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),  # 0: any free port
        ("node-1.example:65535", ("node-1.example", 65535)),
        (":9394", ("0.0.0.0", 9394)),  # an empty host: every IPv4 address, as both did
        ("[::1]:9394", ("::1", 9394)),  # the monitor kept "[::1]", which no socket binds
        ("[::]:9394", ("::", 9394)),
        ("[fe80::1%eth0]:80", ("fe80::1%eth0", 80)),
    ],
)
def test_a_host_and_port_are_split_an_ipv6_host_without_its_brackets(
    text: str, expected: tuple[str, int]
) -> None:
    assert split_hostport(text, "--listen") == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("9394", "no port"),
        ("0.0.0.0", "no port"),
        ("0.0.0.0:", "is not a number"),
        ("0.0.0.0:99999", "over 65535"),  # the extender took it and failed at bind
        ("0.0.0.0:65536", "over 65535"),
        ("0.0.0.0:+80", "is not a number"),
        ("0.0.0.0:-1", "is not a number"),
        ("0.0.0.0:８０", "is not a number"),  # full-width digits: str.isdigit() says yes
        ("::1:9394", "in brackets"),  # host ::1, or host ::1:9394 with no port?
        ("[::1:9394", "brackets"),  # the extender stripped the one bracket
        ("::1]:9394", "brackets"),
        ("[]:9394", "brackets"),
        ("[localhost]:9394", "brackets"),
        (" 0.0.0.0:9394", "spaces"),
    ],
)
def test_what_is_not_host_port_is_refused_naming_the_flag_and_an_example(text: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        split_hostport(text, "--monitor-listen")
    message = str(err.value)
    assert message.startswith("--monitor-listen: ") and why in message, message
    assert "0.0.0.0:9394" in message and "[::1]:9394" in message
