"""The project's error hierarchy.

Every error a user can meet says what is wrong and, where it can, what to change. Errors raised
while handling another keep it as ``__cause__`` (``raise ... from err``), so logs show both.

    VgpuError
    ├── AnnotationError   a contract annotation (inventory, allocation) that does not decode
    ├── RequestError      a pod's vGPU request that can never be satisfied (admission rejects it)
    ├── ConfigError       a setting with a bad value (flag, environment or file)
    └── KubeError         a call to the API server failed
        └── ConflictError the object changed under us (HTTP 409); retry with a fresh copy
"""

from __future__ import annotations


class VgpuError(Exception):
    """Base of every error this project raises on purpose."""


class FieldError(VgpuError):
    """An error about one named field of some input.

    ``field`` is a path such as ``devices[2].memoryMiB`` or ``containers[0].resources.limits``;
    ``source`` names where the field came from (an annotation name, a setting's origin).
    """

    def __init__(self, source: str, field: str, message: str) -> None:
        self.source = source
        self.field = field
        self.message = message
        super().__init__(f"{source}: {field}: {message}" if field else f"{source}: {message}")


class AnnotationError(FieldError):
    """An annotation of contracts 2 or 3 (docs/contracts.md) that is not valid JSON of the
    expected shape and version."""


class RequestError(FieldError):
    """A pod's vGPU request that is impossible whatever the cluster holds (negative, > 100 %...)."""


class ConfigError(FieldError):
    """A setting with a bad value; ``source`` names the flag, variable or file it came from."""


class KubeError(VgpuError):
    """A call to the Kubernetes API server failed; its message is one line.

    ``status`` is the HTTP status where the server answered; ``unreachable`` is true where no
    answer came at all (refused, timed out, TLS failed), so a command can say what to check.
    """

    def __init__(self, message: str, status: int | None = None, unreachable: bool = False) -> None:
        self.status = status
        self.unreachable = unreachable
        super().__init__(message)


class ConflictError(KubeError):
    """The object changed since it was read (HTTP 409 or a failed precondition)."""
