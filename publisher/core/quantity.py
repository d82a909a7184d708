"""Exact Kubernetes quantities: parse, round up to thousandths, print in canonical form.

Owns the quantity grammar of k8s.io/apimachinery (sign, digits, decimal or binary suffix, or an
integer exponent) and its canonical form. All arithmetic is on integers and Decimals built from
integers: never floats, and never a Decimal context that could round silently.
Imports only the standard library; no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum

__all__ = ["Quantity", "QuantityError", "QuantityFormat", "canonical", "milli_ceil", "parse_quantity"]


class QuantityError(ValueError):
    """The text is not a quantity Kubernetes accepts (or is too large to compute with exactly)."""


class QuantityFormat(StrEnum):
    DECIMAL_SI = "DecimalSI"
    BINARY_SI = "BinarySI"
    DECIMAL_EXPONENT = "DecimalExponent"


_GRAMMAR = re.compile(
    r"(?P<sign>[+-]?)"
    r"(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?:(?P<binary>Ki|Mi|Gi|Ti|Pi|Ei)|[eE](?P<exp>[+-]?[0-9]+)|(?P<decimal>[numkMGTPE]))?"
)
_DECIMAL_EXPONENTS = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIXES = {exponent: suffix for suffix, exponent in _DECIMAL_EXPONENTS.items()}
_BINARY_POWERS = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_BINARY_SUFFIXES = {0: "", **{power: suffix for suffix, power in _BINARY_POWERS.items()}}
_NANO = -9
# Kubernetes caps a BinarySI quantity at the largest int64.
_MAX_BINARY = 2**63 - 1
# Kubernetes reads the exponent as an int32.
_MIN_EXPONENT, _MAX_EXPONENT = -(2**31), 2**31 - 1
# Not a Kubernetes limit: a bound that keeps exact integer arithmetic cheap. A factor of 10^40 is
# already 10^31 times anything a weight can express.
_MAX_ADJUSTED_EXPONENT = 40
# Python refuses to convert longer digit strings to int (sys.get_int_max_str_digits).
_MAX_DIGITS = 4000


@dataclass(frozen=True, slots=True)
class Quantity:
    """A parsed quantity: the value Kubernetes holds (exact, rounded up to a nano) and its format.

    >>> parse_quantity("1.5Gi").value
    Decimal('1610612736')
    """

    value: Decimal
    format: QuantityFormat

    def __str__(self) -> str:
        return canonical(self)


def parse_quantity(text: str) -> Quantity:
    """Parses a Kubernetes quantity exactly; raises QuantityError where Kubernetes refuses it.

    >>> parse_quantity("500m")
    Quantity(value=Decimal('0.500'), format=<QuantityFormat.DECIMAL_SI: 'DecimalSI'>)
    """
    if not isinstance(text, str):
        raise QuantityError(f"quantity must be a string, got {type(text).__name__}")
    match = _GRAMMAR.fullmatch(text)
    if match is None or not (match["int"] or match["frac"]):
        raise QuantityError(f"{text!r} is not a quantity")
    integer, fraction = match["int"], match["frac"] or ""
    if len(integer) + len(fraction) > _MAX_DIGITS:
        raise QuantityError(f"{text!r} has too many digits")
    coefficient = int(integer + fraction or "0")
    exponent = -len(fraction)
    if match["binary"] is not None:
        quantity_format = QuantityFormat.BINARY_SI
        coefficient *= 1024 ** _BINARY_POWERS[match["binary"]]
    elif match["exp"] is not None:
        quantity_format = QuantityFormat.DECIMAL_EXPONENT
        if len(match["exp"]) > 12:
            raise QuantityError(f"{text!r} has an exponent outside the int32 range")
        suffix_exponent = int(match["exp"])
        if not _MIN_EXPONENT <= suffix_exponent <= _MAX_EXPONENT:
            raise QuantityError(f"{text!r} has an exponent outside the int32 range")
        exponent += suffix_exponent
    else:
        quantity_format = QuantityFormat.DECIMAL_SI
        exponent += _DECIMAL_EXPONENTS[match["decimal"] or ""]
    if coefficient and len(str(coefficient)) - 1 + exponent > _MAX_ADJUSTED_EXPONENT:
        raise QuantityError(f"{text!r} is larger than 1e{_MAX_ADJUSTED_EXPONENT}")

    coefficient, exponent = _round_up(coefficient, exponent, _NANO)
    if quantity_format is QuantityFormat.BINARY_SI:
        # A binary value is a whole number times a power of 1024 unless its digits had a fraction.
        # coefficient x 10^exponent compared with a bound, in integers (exponent <= 0 here).
        scale = 10**-exponent
        if coefficient > _MAX_BINARY * scale:
            coefficient, exponent = _MAX_BINARY, 0
        elif coefficient < 1024 * scale:
            quantity_format = QuantityFormat.DECIMAL_SI
    sign = 1 if match["sign"] == "-" and coefficient else 0
    value = Decimal((sign, tuple(int(d) for d in str(coefficient)), exponent))
    return Quantity(value=value, format=quantity_format)


def milli_ceil(quantity: Quantity) -> int:
    """The value in thousandths, rounded up (towards +infinity) to a whole number.

    >>> milli_ceil(parse_quantity("1.2345"))
    1235
    """
    sign, coefficient, exponent = _parts(quantity.value)
    exponent += 3
    if exponent >= 0:
        return sign * coefficient * 10**exponent
    whole, rest = divmod(coefficient, 10**-exponent)
    if sign < 0:
        return -whole
    return whole + (1 if rest else 0)


def canonical(quantity: Quantity) -> str:
    """Kubernetes' canonical string: "1.5" -> "1500m", "1000" -> "1k", "1.5Gi" -> "1536Mi"."""
    sign, coefficient, exponent = _parts(quantity.value)
    if coefficient == 0:
        return "0"
    prefix = "-" if sign < 0 else ""
    while coefficient % 10 == 0:
        coefficient //= 10
        exponent += 1
    if quantity.format is QuantityFormat.BINARY_SI and exponent >= 0:
        # A whole number of bytes: as many factors of 1024 as the suffixes can name.
        whole = coefficient * 10**exponent
        power = 0
        while whole % 1024 == 0 and power < 6:
            whole //= 1024
            power += 1
        return f"{prefix}{whole}{_BINARY_SUFFIXES[power]}"
    while exponent % 3:
        coefficient *= 10
        exponent -= 1
    if quantity.format is QuantityFormat.DECIMAL_EXPONENT:
        return f"{prefix}{coefficient}" + (f"e{exponent}" if exponent else "")
    suffix = _DECIMAL_SUFFIXES.get(exponent)
    if suffix is None:
        # Beyond exa, no decimal suffix exists: Kubernetes falls back to an exponent.
        return f"{prefix}{coefficient}e{exponent}"
    return f"{prefix}{coefficient}{suffix}"


def _round_up(coefficient: int, exponent: int, to_exponent: int) -> tuple[int, int]:
    """coefficient x 10^exponent, rounded away from zero to a multiple of 10^to_exponent."""
    if exponent >= to_exponent:
        return coefficient, exponent
    shift = to_exponent - exponent
    if shift > len(str(coefficient)):
        return (1 if coefficient else 0), to_exponent
    whole, rest = divmod(coefficient, 10**shift)
    return whole + (1 if rest else 0), to_exponent


def _parts(value: Decimal) -> tuple[int, int, int]:
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    coefficient = int("".join(map(str, digits)) or "0")
    return (-1 if sign else 1), coefficient, exponent
