"""Errors the sandbox reports to a person: each says what is wrong and how to fix it."""


class SandboxError(Exception):
    """A sandbox operation failed; the message names the cause and the fix."""
