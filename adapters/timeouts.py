"""How long a gateway lets one request take: the two timeouts every gateway adapter shares.

LLM serving sets their shape. A streamed answer lasts as long as its tokens take (minutes), and a
long prompt, a queue in front of the model or an answer that is not streamed keep the first byte
waiting for minutes too. So there is no total deadline by default (Envoy's own default, 15 s, cut
every longer stream and answered 504 to every slow first token), and an idle timeout between two
bytes instead, which still frees what a hung backend holds. One hour, as a whole answer that is
not streamed sends nothing until it is done.

Envoy takes both per route (`timeout`, `idle_timeout`, which replaces the connection manager's
stream idle timeout of 5 minutes). NGINX has no total deadline: the idle one is its
proxy_read_timeout and proxy_send_timeout. Gateway API's HTTPRoute has the total one only
(`timeouts.request`); idle timeouts there are each implementation's own policy.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from publisher.core.durations import DAY, Duration, DurationRange, Interval

__all__ = [
    "DEFAULT_ROUTE_IDLE_TIMEOUT",
    "DEFAULT_ROUTE_TIMEOUT",
    "MAX_ROUTE_TIMEOUT",
    "RouteIdleTimeout",
    "RouteTimeout",
    "envoy_duration",
    "idle_timeout_seconds",
    "route_idle_timeout_field",
    "route_timeout_field",
    "unit_duration",
]

DEFAULT_ROUTE_TIMEOUT = 0.0  # none
DEFAULT_ROUTE_IDLE_TIMEOUT = 3600.0
# NGINX keeps its timers in a 32-bit wrapping clock of milliseconds (24.8 days); a day (every
# duration option's ceiling) is far beyond any answer, and bounds what a typo such as `100000h`
# would hold open.
MAX_ROUTE_TIMEOUT = DAY


def _whole_milliseconds(seconds: float) -> float:
    milliseconds = round(seconds * 1000)
    if seconds and milliseconds == 0:
        raise ValueError(f"{seconds:g}s is shorter than a millisecond")
    return milliseconds / 1000


# 0 is "no total deadline"; an idle timeout is always on (0 would be NGINX's "at once").
RouteTimeout = Annotated[Interval, AfterValidator(_whole_milliseconds)]
RouteIdleTimeout = Annotated[Duration, AfterValidator(_whole_milliseconds)]


def idle_timeout_seconds(value: str) -> float:
    """A route idle timeout as a flag gives it (`nginx-config --route-idle-timeout`), checked as
    RouteIdleTimeout checks it. ValueError names what is wrong."""
    return _whole_milliseconds(DurationRange(MAX_ROUTE_TIMEOUT)(value))


def route_timeout_field() -> RouteTimeout:
    return Field(  # type: ignore[no-any-return]
        default=DEFAULT_ROUTE_TIMEOUT,
        description="The longest a whole request may take, answer included (0: no deadline, as an LLM stream lasts "
        "what its tokens take; Envoy's own default, 15s, cut every longer stream). Envoy's route timeout, an "
        "HTTPRoute's timeouts.request; NGINX has none.",
    )


def route_idle_timeout_field() -> RouteIdleTimeout:
    return Field(  # type: ignore[no-any-return]
        default=DEFAULT_ROUTE_IDLE_TIMEOUT,
        description="The longest a request may go without a byte either way, the wait for the first one included "
        "(a long prompt, an answer not streamed). Envoy's route idle_timeout, NGINX's proxy_read_timeout and "
        "proxy_send_timeout (Lua mode: `nginx-config --route-idle-timeout`).",
    )


def _parts(seconds: float) -> list[tuple[int, str]]:
    milliseconds = round(seconds * 1000)
    hours, rest = divmod(milliseconds, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, rest = divmod(rest, 1000)
    return [(value, unit) for value, unit in ((hours, "h"), (minutes, "m"), (whole, "s"), (rest, "ms")) if value]


def envoy_duration(seconds: float) -> str:
    """A protobuf Duration in JSON: `0s`, `3600s`, `1.500s`."""
    milliseconds = round(seconds * 1000)
    return f"{milliseconds // 1000}s" if milliseconds % 1000 == 0 else f"{milliseconds // 1000}.{milliseconds % 1000:03d}s"


def unit_duration(seconds: float) -> str:
    """`0s`, `1h`, `1m30s`, `1s500ms`: whole numbers, units largest first. Both an NGINX time (which
    takes no fractions) and a Gateway API Duration (GEP-2257; a day is `24h`, within the five digits
    a number may have there)."""
    return "".join(f"{value}{unit}" for value, unit in _parts(seconds)) or "0s"
