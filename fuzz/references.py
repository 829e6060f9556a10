"""What a parser of ours is compared against: the reading of the library it stands in for.

Shared by the fuzz harness ``worker_head`` (fuzz/properties.py) and the property test
tests/unit/test_worker_parser.py; it imports neither (the tests import ``fuzz``, never the reverse).
"""

from __future__ import annotations

from typing import Any

from gunicorn.config import Config
from gunicorn.http.parser import RequestParser

_CFG = Config()


def gunicorn_reads(head: bytes, body_size: int) -> dict[str, Any] | None:
    """What gunicorn's parser makes of the request head (None: it refuses it): the method, the
    target, the headers as the WSGI environ has them and the body's length, as
    :func:`vgpu.extender.worker.parse_head` reads them."""
    parser = RequestParser(_CFG, iter([head + b"\r\n\r\n" + b"b" * body_size]), ("127.0.0.1", 1))
    try:
        req = next(parser)
    except Exception:  # noqa: BLE001 - any refusal counts
        return None
    environ: dict[str, str] = {}
    for name, value in req.headers:
        if name == "CONTENT-LENGTH":
            environ["CONTENT_LENGTH"] = value
        elif name == "CONTENT-TYPE":
            environ["CONTENT_TYPE"] = value
        else:
            key = "HTTP_" + name.replace("-", "_")
            environ[key] = f"{environ[key]},{value}" if key in environ else value
    length = int(environ.get("CONTENT_LENGTH", "0"))
    return {"method": req.method, "target": req.uri, "environ": environ, "length": length}
