"""Kubernetes resource quantities (`8`, `8k`, `1e3`, `500m`, `16Gi`) as exact numbers.

The API server may write a node's capacity and allocatable in any form its grammar allows (it keeps the
form a client sent, and canonicalises others: 8000 may read `8k`), so a count read with `int()` misses
real values and a comparison with NVML goes silent. This is the grammar of apimachinery's
resource.ParseQuantity, with nothing of Kubernetes' client imported (its models cost the daemon tens of
MiB):

    quantity ::= [+-] number suffix
    number   ::= digits | digits "." [digits] | "." digits
    suffix   ::= "" | n | u | m | k | M | G | T | P | E          (powers of 1000)
               | Ki | Mi | Gi | Ti | Pi | Ei                      (powers of 1024)
               | (e | E) [+-] digits                              (a power of ten)

The value is exact (a Decimal); Kubernetes itself rounds anything finer than 1n up, which no count here
depends on.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:                # decimal is imported when a quantity is first read: the daemon of a node
    from decimal import Decimal  # whose checks never read one keeps its half a MiB

MAX_LENGTH = 64            # the API server's quantities are short; a longer string is junk, not a number
MAX_EXPONENT = 1000        # beyond any resource; keeps "1e999999999" from building a huge number
MAX_COUNT = 10**18         # a whole count above this (int64's range) is not a count of anything

_DECIMAL_SI = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SI = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
# ASCII digits only ([0-9], not \d, which takes any Unicode digit). A binary suffix is tried before the
# exponent and the exponent before a lone "E", so "1Ei", "1E3" and "1E" each read as Kubernetes reads them.
_QUANTITY = re.compile(r"(?P<sign>[+-]?)(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
                       r"(?:(?P<binary>[KMGTPE]i)|[eE](?P<exponent>[+-]?[0-9]+)|(?P<decimal>[numkMGTPE]?))")


def parse_quantity(text: str) -> Decimal:
    """The exact value of a Kubernetes quantity; ValueError, naming the text, for anything else."""
    from decimal import Decimal, localcontext  # noqa: PLC0415 - see the import above

    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not a quantity (a string such as 8, 8k or 500m)")
    if len(text) > MAX_LENGTH:
        raise ValueError(f"{text[:MAX_LENGTH]!r}... is not a quantity: longer than {MAX_LENGTH} characters")
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a quantity (a number with an optional suffix such as k, m, Ki or e3)")
    sign, number = match["sign"], match["number"]
    if match["binary"] is not None:
        power = _BINARY_SI[match["binary"]]
        with localcontext() as ctx:          # exact: enough digits for the number times 1024**6
            ctx.prec = len(number) + 3 * power + 2
            return Decimal(sign + number) * (Decimal(1024) ** power)
    if match["exponent"] is not None:
        exponent = int(match["exponent"])
        if abs(exponent) > MAX_EXPONENT:
            raise ValueError(f"{text!r} is out of range: exponent {exponent}")
    else:
        exponent = _DECIMAL_SI[match["decimal"]]
    return Decimal(f"{sign}{number}E{exponent}")      # exact: no context rounding on construction


def whole_count(text: str, what: str = "count") -> int:
    """A quantity that must count whole things (GPUs, devices): `8`, `8k`, `8000m`, `8.0`. ValueError
    saying what it is instead for a fraction (`500m`), a negative or an out-of-range value, or junk."""
    try:
        value = parse_quantity(text)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    if value < 0:
        raise ValueError(f"{what} {text!r} is negative: not a count")
    if value > MAX_COUNT:
        raise ValueError(f"{what} {text!r} is out of range: not a count")
    if value != value.to_integral_value():
        raise ValueError(f"{what} {text!r} is {value.normalize():f}, not a whole number")
    return int(value)


__all__ = ["parse_quantity", "whole_count"]
