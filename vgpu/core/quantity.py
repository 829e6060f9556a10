"""Kubernetes quantities (``"3000"``, ``"3k"``, ``"1e3"``, ``"4Gi"``) read exactly, as a pod's
resources carry them: the API server rewrites ``nvidia.com/gpumem: 1000`` as ``"1k"``, so a value
is parsed as a fraction and must come out a whole number. Part of what a pod asks for (contract 1,
docs/contracts.md); :mod:`vgpu.core.requests` reads the pod.
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache
from typing import Any

from vgpu.core.errors import RequestError

SOURCE = "pod"

_QUANTITY = re.compile(
    r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E))?$"
)
_SUFFIX = {
    "": Fraction(1),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
}


# Kubernetes keeps a quantity in an int64; the longest text of one it writes is far shorter than this.
QUANTITY_MAX = 2**63 - 1

_QUANTITY_TEXT_MAX = 64
_EXPONENT_MAX = 100


def suffix_of(text: str) -> str | None:
    """The unit suffix of a quantity's text (``Gi``, ``k``, ...), "" for none, None for no quantity."""
    m = _QUANTITY.match(text)
    return None if m is None else (m.group(3) or "")


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, cut short: the value may be any JSON a client sent."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > QUANTITY_MAX:
        return f"a number of {value.bit_length()} bits"  # str() of one past 4300 digits raises
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_quantity(value: Any, field: str) -> int:
    """A Kubernetes quantity that must be a whole number (``"3000"``, ``"3k"``, ``2``).

    A value past Kubernetes' int64 range is refused: such a request can never be satisfied, and
    computing it (``"1e999999999"``) would take the extender minutes and gigabytes.
    """
    if isinstance(value, bool):
        raise RequestError(SOURCE, field, f"must be a whole number, got {value!r}")
    if isinstance(value, int):
        number = value
    else:
        text = str(value).strip()
        if len(text) > _QUANTITY_TEXT_MAX:
            raise RequestError(
                SOURCE, field, f"is {len(text)} characters, too long for a quantity, got {shown(value)}"
            )
        try:
            parsed = _quantity(text)
        except OverflowError:
            parsed = Fraction(QUANTITY_MAX + 1)
        if parsed is None:
            raise RequestError(SOURCE, field, f"must be a whole number such as 3000, got {shown(value)}")
        if parsed.denominator != 1:
            raise RequestError(SOURCE, field, f"must be a whole number, got {shown(value)}")
        number = int(parsed)
    if abs(number) > QUANTITY_MAX:
        raise RequestError(
            SOURCE, field, f"is out of range (Kubernetes quantities fit in 64 bits), got {shown(value)}"
        )
    return number


def quantity_value(value: Any) -> Fraction | None:
    """The exact value of a quantity (``"0.5"``, ``"3Gi"``, ``30``), fractions kept; None when it
    is not one or lies past any int64."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Fraction(value) if abs(value) <= QUANTITY_MAX else None
    text = str(value).strip()
    if len(text) > _QUANTITY_TEXT_MAX:
        return None
    try:
        parsed = _quantity(text)
    except OverflowError:
        return None
    return parsed if parsed is not None and abs(parsed) <= QUANTITY_MAX else None


@lru_cache(maxsize=4096)
def _quantity(text: str) -> Fraction | None:
    """The exact value of a quantity's text, or None when it is not one (cached: pods repeat them).

    OverflowError for a power of ten past any int64 (the value is then not computed).
    """
    m = _QUANTITY.match(text)
    if m is None:
        return None
    number = Fraction(m.group(1))
    if m.group(2):
        exponent = int(m.group(2)[1:])
        if not number:
            return number
        # The mantissa (at most 64 characters) lies within 10**-64..10**64, so past 10**100 the
        # value is out of any int64's range, and below 10**-100 it is a fraction: either way no
        # need to compute it.
        if exponent > _EXPONENT_MAX:
            raise OverflowError(text)
        number *= Fraction(10) ** max(exponent, -_EXPONENT_MAX)
    else:
        number *= _SUFFIX[m.group(3) or ""]
    return number
