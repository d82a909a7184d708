"""publisher.core.quantity: the Kubernetes quantity grammar, exact values and the canonical form."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from publisher.core.quantity import QuantityError, QuantityFormat, canonical, milli_ceil, parse_quantity


@pytest.mark.parametrize(
    ("text", "value", "quantity_format"),
    [
        ("3", "3", QuantityFormat.DECIMAL_SI),
        ("1.5", "1.5", QuantityFormat.DECIMAL_SI),
        ("500m", "0.5", QuantityFormat.DECIMAL_SI),
        ("5.", "5", QuantityFormat.DECIMAL_SI),
        (".5", "0.5", QuantityFormat.DECIMAL_SI),
        ("+.5", "0.5", QuantityFormat.DECIMAL_SI),
        ("-1.5", "-1.5", QuantityFormat.DECIMAL_SI),
        ("1n", "0.000000001", QuantityFormat.DECIMAL_SI),
        ("2u", "0.000002", QuantityFormat.DECIMAL_SI),
        ("1k", "1000", QuantityFormat.DECIMAL_SI),
        ("1M", "1000000", QuantityFormat.DECIMAL_SI),
        ("1G", "1e9", QuantityFormat.DECIMAL_SI),
        ("1T", "1e12", QuantityFormat.DECIMAL_SI),
        ("1P", "1e15", QuantityFormat.DECIMAL_SI),
        ("1E", "1e18", QuantityFormat.DECIMAL_SI),
        ("1Ki", "1024", QuantityFormat.BINARY_SI),
        ("1Mi", "1048576", QuantityFormat.BINARY_SI),
        ("1.5Gi", "1610612736", QuantityFormat.BINARY_SI),
        ("1Ti", str(1024**4), QuantityFormat.BINARY_SI),
        ("1Pi", str(1024**5), QuantityFormat.BINARY_SI),
        ("1Ei", str(1024**6), QuantityFormat.BINARY_SI),
        ("0.5Ki", "512", QuantityFormat.DECIMAL_SI),
        ("1e3", "1000", QuantityFormat.DECIMAL_EXPONENT),
        ("1E3", "1000", QuantityFormat.DECIMAL_EXPONENT),
        ("15e-1", "1.5", QuantityFormat.DECIMAL_EXPONENT),
        ("2e+2", "200", QuantityFormat.DECIMAL_EXPONENT),
        ("0.1n", "0.000000001", QuantityFormat.DECIMAL_SI),
        ("1e-20", "0.000000001", QuantityFormat.DECIMAL_EXPONENT),
        ("-1e-20", "-0.000000001", QuantityFormat.DECIMAL_EXPONENT),
        ("9Ei", str(2**63 - 1), QuantityFormat.BINARY_SI),
        ("-0", "0", QuantityFormat.DECIMAL_SI),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_parses_exactly(text: str, value: str, quantity_format: QuantityFormat) -> None:
    quantity = parse_quantity(text)
    assert quantity.value == Decimal(value)
    assert quantity.format is quantity_format


@pytest.mark.parametrize(
    "text",
    ["abc", "1.5.5", "", "1e", "e3", "1K", "1.5e1.5", " 1", "1 ", "1\n", "1 k", ".", "+", "-", "--1",
     "1ki", "1Mb", "0x10", "١", "1e3m", "1Kii", "1e99999999999", "1e41", str(10**41)],
)
def test_rejects(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(text)


def test_rejects_a_non_string() -> None:
    with pytest.raises(QuantityError, match="must be a string"):
        parse_quantity(3)  # type: ignore[arg-type]


def test_rejects_too_many_digits() -> None:
    with pytest.raises(QuantityError, match="too many digits"):
        parse_quantity("1" * 4001)


@pytest.mark.parametrize(
    ("text", "milli"),
    [("1", 1000), ("3", 3000), ("1.5", 1500), ("500m", 500), ("1.2345", 1235), ("1n", 1), ("1e-20", 1),
     ("0", 0), ("-1.5", -1500), ("-1.2345", -1234), ("1Ki", 1_024_000), ("1000001", 1_000_001_000)],
)
def test_milli_ceil_rounds_up(text: str, milli: int) -> None:
    assert milli_ceil(parse_quantity(text)) == milli


@pytest.mark.parametrize(
    ("text", "shown"),
    [("1.5", "1500m"), ("3", "3"), ("1000", "1k"), ("1500", "1500"), ("1.5Gi", "1536Mi"), ("0.5Ki", "512"),
     ("1.5Mi", "1536Ki"), ("2048Ki", "2Mi"), ("1024", "1024"), ("1.5Ki", "1536"), ("1.2345", "1234500u"),
     ("0.1n", "1n"), ("1e3", "1e3"), ("12e1", "120"), ("15e-1", "1500e-3"), ("0", "0"), ("-1.5", "-1500m"),
     ("-1Ki", "-1Ki"), ("1E", "1E"), ("1e21", "1e21"), ("1000E", "1e21"), ("0.5", "500m"), ("100m", "100m"),
     ("9Ei", "9223372036854775807")],
)
def test_canonical(text: str, shown: str) -> None:
    assert canonical(parse_quantity(text)) == shown
    assert str(parse_quantity(text)) == shown


@given(st.integers(min_value=-(10**12), max_value=10**12), st.sampled_from(["n", "u", "m", "", "k", "M"]))
def test_canonical_parses_back_to_the_same_value(number: int, suffix: str) -> None:
    quantity = parse_quantity(f"{number}{suffix}")
    again = parse_quantity(canonical(quantity))
    assert again.value == quantity.value


@given(st.integers(min_value=0, max_value=10**9), st.integers(min_value=0, max_value=6))
def test_milli_ceil_of_decimal_text_is_the_ceiling(numerator: int, places: int) -> None:
    text = f"{numerator // 10**places}.{numerator % 10**places:0{places}d}" if places else str(numerator)
    expected = -(-numerator * 1000 // 10**places)
    assert milli_ceil(parse_quantity(text)) == expected
