"""The extender worker's short request parser against gunicorn's own, request head by request head.

Whatever :func:`vgpu.extender.worker.parse_head` accepts, gunicorn's parser must accept too and
read the same way (method, path, query, the headers as the WSGI environ has them, the body's
length); what it declines goes to gunicorn's parser, so declining is always safe. Heads are built
from a grammar of valid and invalid pieces (names, values, lengths, targets, line endings) so
both outcomes are exercised.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from fuzz.references import gunicorn_reads
from vgpu.extender.worker import FAST_BODY_MAX, HEAD_MAX, parse_head

NAMES = st.sampled_from(
    [b"Host", b"Content-Type", b"content-type", b"X-Trace", b"x-trace", b"Accept", b"User-Agent",
     b"X_Under", b"X Space", b"Bad\x00", b"", b"X-Trace ", b" X-Lead", b"Transfer-Encoding",
     b"Connection", b"Expect", b"Upgrade", b"TE", b"Trailer", b"X-\xe9"]
)  # fmt: skip
VALUES = st.one_of(
    st.sampled_from(
        [
            b"v",
            b" spaced ",
            b"a,b",
            b"",
            b"*/*",
            b"chunked",
            b"close",
            b"keep-alive",
            b"Keep-Alive",
            b"100-continue",
            b"\t tab",
        ]
    ),
    st.binary(max_size=12),
)
LENGTHS = st.sampled_from(
    [b"0", b"2", b"17", b" 3 ", b"+2", b"-1", b"0x10", b"1_0", b"\xb2", b"", b"9" * 25,
     str(FAST_BODY_MAX).encode(), str(FAST_BODY_MAX + 1).encode()]
)  # fmt: skip
TARGETS = st.sampled_from(
    [b"/filter", b"/bind", b"/a/b?x=1&y=%20", b"/a%2Fb", b"/a b", b"*", b"http://h/x", b"/x#frag",
     b"/\xe9", b"", b"/q?", b"/p;a=b", b"/~u"]
)  # fmt: skip
METHODS = st.sampled_from([b"POST", b"GET", b"post", b"PUT", b"P0ST", b""])
VERSIONS = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"http/1.1", b"HTTP/1.1 "])


def mostly(plain: bytes, others: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """``plain`` three times in four, else any of ``others``: plain heads must come up often."""
    return st.integers(0, 3).flatmap(lambda i: st.just(plain) if i else others)


@st.composite
def heads(draw: st.DrawFn) -> bytes:
    method = draw(mostly(b"POST", METHODS))
    target = draw(mostly(b"/filter", TARGETS))
    line = method + b" " + target + b" " + draw(mostly(b"HTTP/1.1", VERSIONS))
    fields = [
        draw(mostly(b"X-Trace", NAMES)) + b":" + draw(mostly(b" v", VALUES))
        for _ in range(draw(st.integers(0, 3)))
    ]
    for _ in range(draw(st.sampled_from([1, 1, 1, 0, 2]))):  # Content-Length: once, or not, or twice
        name = draw(st.sampled_from([b"Content-Length", b"content-length"]))
        fields.insert(draw(st.integers(0, len(fields))), name + b": " + draw(mostly(b"2", LENGTHS)))
    if draw(st.integers(0, 5)) == 0:
        fields.insert(draw(st.integers(0, len(fields))), b" folded")
    return b"\r\n".join([line, *fields])


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads())
def test_what_the_short_parser_reads_gunicorn_reads_alike(head: bytes) -> None:
    ours = parse_head(head)
    if ours is None:
        return  # declined: gunicorn's parser reads it, whatever it is
    method, target, environ, length = ours
    theirs = gunicorn_reads(head, length)
    assert theirs is not None, "accepted a head gunicorn refuses"
    assert theirs == {"method": method, "target": target, "environ": environ, "length": length}


def test_the_grammar_reaches_both_outcomes() -> None:
    """The property above proves something only if the strategy yields heads the short parser
    accepts (and, for the grammar's worth, ones it declines): find one of each, or fail."""
    accepted = find(heads(), lambda h: parse_head(h) is not None, settings=settings(max_examples=2000))
    declined = find(heads(), lambda h: parse_head(h) is None, settings=settings(max_examples=2000))
    assert parse_head(accepted) is not None and parse_head(declined) is None


@pytest.mark.parametrize(
    "head",
    [
        b"POST /filter HTTP/1.1\r\nHost: 10.0.0.1:8443\r\nUser-Agent: Go-http-client/1.1\r\n"
        b"Content-Length: 5012\r\nContent-Type: application/json\r\nAccept-Encoding: gzip",
        b"POST /bind HTTP/1.1\r\nHost: h\r\ncontent-length: 0",
        b"POST /filter HTTP/1.1\r\nHost: h\r\nUser-Agent: python-requests/2.32\r\nAccept-Encoding: gzip\r\n"
        b"Accept: */*\r\nConnection: keep-alive\r\nContent-Length: 9\r\nContent-Type: application/json",
    ],
)
def test_plain_heads_are_accepted(head: bytes) -> None:
    """kube-scheduler's calls (the head Go's net/http client sends) and Python's take the short parser."""
    ours = parse_head(head)
    assert ours is not None
    assert ours[:2] == ("POST", head.split(b" ")[1].decode())
    assert gunicorn_reads(head, ours[3]) is not None


@pytest.mark.parametrize(
    ("head", "why"),
    [
        (b"POST /f HTTP/1.1\r\nHost: h", "no Content-Length"),
        (b"POST /f HTTP/1.1\r\nContent-Length: \xb2", "a digit that is not ASCII"),
        (b"POST /f HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1", "the length twice"),
        (b"POST /f HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked", "chunked coding"),
        (b"POST /f HTTP/1.1\r\nContent-Length: 1\r\nConnection: close", "the connection to close"),
        (b"POST /f HTTP/1.1\r\nContent-Length: 1\r\nX_A: 1", "an underscore gunicorn drops"),
        (b"POST /f HTTP/1.1\r\nContent-Length: 1\r\nX-A: 1\r\n  more", "a folded line"),
        (b"POST /a%20b HTTP/1.1\r\nContent-Length: 1", "a path to unquote"),
        (b"POST /f HTTP/1.1\r\nContent-Length: " + str(FAST_BODY_MAX + 1).encode(), "a large body"),
        (b"POST /f HTTP/1.1\r\nContent-Length: 1\r\nX-Long: " + b"v" * HEAD_MAX, "a long head"),
    ],
)
def test_what_is_not_plain_is_left_to_gunicorn(head: bytes, why: str) -> None:
    assert parse_head(head) is None, why


def test_the_heartbeat_is_written_at_most_once_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """gunicorn's event loop notifies the arbiter on every turn; the file write behind it is a
    system call per event on a busy extender, so the worker passes on one a second, well within the
    timeout the server sets."""
    from vgpu.extender import worker

    class Heartbeat:
        writes = 0

        def notify(self) -> None:
            self.writes += 1

    clock = [100.0]
    monkeypatch.setattr(worker.time, "monotonic", lambda: clock[0])
    w = worker.LingeringThreadWorker.__new__(worker.LingeringThreadWorker)
    w.tmp = Heartbeat()
    for _ in range(50):  # one busy second: many turns of the loop
        w.notify()
        clock[0] += 0.019
    assert w.tmp.writes == 1
    clock[0] += 0.1
    w.notify()
    assert w.tmp.writes == 2
