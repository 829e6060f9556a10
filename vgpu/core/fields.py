"""Typed reads of a decoded JSON annotation: each failure an ``AnnotationError`` naming the
annotation and the field's path (``devices[1].memoryMiB``), as contracts 2 and 3 promise."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from vgpu.core.errors import AnnotationError


class FieldReader:
    """Typed field access that raises AnnotationError naming the annotation and the field path."""

    def __init__(self, annotation: str) -> None:
        self.annotation = annotation

    def fail(self, path: str, message: str) -> AnnotationError:
        return AnnotationError(self.annotation, path, message)

    def load(self, text: str | bytes | None) -> dict[str, Any]:
        if text is None or (isinstance(text, str | bytes) and not text.strip()):
            raise self.fail("", "annotation is missing or empty")
        try:
            doc = json.loads(text)
        except (ValueError, TypeError) as err:
            raise self.fail("", f"not valid JSON ({err})") from err
        except RecursionError as err:  # past the decoder's stack limit: none of our documents nests so
            raise self.fail("", "not valid JSON (nested too deeply)") from err
        if not isinstance(doc, dict):
            raise self.fail("", f"must be a JSON object, got {type(doc).__name__}")
        return doc

    def version(self, doc: Mapping[str, Any], expected: int, *also: int) -> None:
        known = " and ".join(str(v) for v in (expected, *also))
        if "version" not in doc:
            raise self.fail("version", f"missing; this reader understands version {known}")
        got = doc["version"]
        if isinstance(got, bool) or not isinstance(got, int) or got not in (expected, *also):
            raise self.fail(
                "version",
                f"unsupported version {got!r}; this reader understands version {known} "
                "(upgrade the component that reads it, or the one that wrote it, so both match)",
            )

    def obj(self, value: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"must be an object, got {type(value).__name__}")
        return value

    def _get(self, obj: Mapping[str, Any], key: str, path: str) -> tuple[Any, str]:
        full = f"{path}.{key}" if path else key
        if key not in obj:
            raise self.fail(full, "missing")
        return obj[key], full

    def array(self, obj: Mapping[str, Any], key: str, full: str) -> list[Any]:
        if key not in obj:
            raise self.fail(full, "missing")
        value = obj[key]
        if not isinstance(value, list):
            raise self.fail(full, f"must be a list, got {type(value).__name__}")
        return value

    def string(self, obj: Mapping[str, Any], key: str, path: str, allow_empty: bool = False) -> str:
        value, full = self._get(obj, key, path)
        if not isinstance(value, str) or (not value and not allow_empty):
            raise self.fail(full, f"must be a non-empty string, got {value!r}")
        return value

    def integer(self, obj: Mapping[str, Any], key: str, path: str, minimum: int) -> int:
        value, full = self._get(obj, key, path)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(full, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def boolean(self, obj: Mapping[str, Any], key: str, path: str) -> bool:
        value, full = self._get(obj, key, path)
        if not isinstance(value, bool):
            raise self.fail(full, f"must be true or false, got {value!r}")
        return value
