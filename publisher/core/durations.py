"""The one duration grammar of every option (`1h30m`, `500ms`), and the range each option takes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator

# One duration grammar for every option, the chart's values schema included (its `duration`
# definition is this pattern, tests/test_durations.py holds them together): Go's and Kubernetes'
# spelling, `1h30m`, `2m`, `60s`, `1.5s`, `500ms`, `0`, restricted to h, m, s and ms, each unit at
# most once and largest first, a unit on every number, digits on both sides of a decimal point.
DURATION_PATTERN = (
    r"^(0|([0-9]+(\.[0-9]+)?h)?([0-9]+(\.[0-9]+)?m)?([0-9]+(\.[0-9]+)?s)?([0-9]+(\.[0-9]+)?ms)?)$"
)
DURATION_EXAMPLES = "1h30m, 2m, 60s, 1.5s, 500ms"
_DURATION = re.compile(DURATION_PATTERN)
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|h|m|s)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any, *, zero_ok: bool = False) -> float:
    """A duration string of DURATION_PATTERN ('1h30m', '500ms') or a number of seconds (from
    code or a YAML number); zero only with `zero_ok`."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip()
        if text.startswith("-") and _DURATION.match(text[1:]):
            raise ValueError(f"{value!r} is negative: it must be {'0 or longer' if zero_ok else 'longer than zero'}")
        if not text or _DURATION.match(text) is None:
            raise ValueError(f"{value!r} is not a duration such as {DURATION_EXAMPLES} (a unit on every number)")
        seconds = sum(float(number) * _UNITS[unit] for number, unit in _DURATION_PART.findall(text))
    if seconds < 0 or (seconds == 0 and not zero_ok):
        raise ValueError(f"{value!r} must be {'0 or longer' if zero_ok else 'longer than zero'}")
    return seconds


def format_duration(seconds: float) -> str:
    """`seconds` in the duration grammar, largest unit first: 90 -> 1m30s, 0.5 -> 500ms, 0 -> 0s."""
    if seconds == 0:
        return "0s"
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    hours, rest = divmod(seconds, 3600.0)
    minutes, rest = divmod(rest, 60.0)
    parts = [f"{value:g}{unit}" for value, unit in ((hours, "h"), (minutes, "m"), (rest, "s")) if value]
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class DurationRange:
    """The durations one option takes: longer than zero (or zero too, `zero_ok`), at least
    `least` and at most `most` seconds. Every duration option has a ceiling, so that a slip like
    `100000000h` is refused instead of meaning "never". It is the option's validator, and the
    chart's check of the value feeding the option is generated from it (tools/chart_limits.py)."""

    most: float
    least: float = 0.0
    zero_ok: bool = False
    why: str = ""  # why the floor is where it is, for the refusal

    def describe(self) -> str:
        """The range in words, for the help: `10s to 1h`, `0 to 1h`, `at most 24h`."""
        if self.least:
            return f"{format_duration(self.least)} to {format_duration(self.most)}"
        return f"0 to {format_duration(self.most)}" if self.zero_ok else f"at most {format_duration(self.most)}"

    def __call__(self, value: Any) -> float:
        seconds = parse_duration(value, zero_ok=self.zero_ok)
        if seconds < self.least:
            raise ValueError(f"{value!r} is shorter than {format_duration(self.least)}" + (f": {self.why}" if self.why else ""))
        if seconds > self.most:
            raise ValueError(f"{value!r} is longer than {format_duration(self.most)}, the longest this option takes")
        return seconds


HOUR = 3600.0
DAY = 24 * HOUR
# Options in seconds that take the duration grammar, in the default ranges: longer than zero
# (Duration) or zero too (Interval, "no wait"), at most a day. An option with another range
# annotates itself the same way with its own DurationRange.
Duration = Annotated[float, BeforeValidator(DurationRange(DAY))]
Interval = Annotated[float, BeforeValidator(DurationRange(DAY, zero_ok=True))]
# How a help text names the forms parse_duration takes.
DURATION_UNITS = f"a duration: {DURATION_EXAMPLES}"
