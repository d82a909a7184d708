"""The Informer's bookkeeping, as values free of I/O: its health (when a call last succeeded, what is
wrong now, and which of its changes are news to log), the age of its connection (which resets the
reconnect backoff), the pages of one list, and the digest of each object it stored."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, TypeVar

from publisher.core.values import MapKey
from publisher.kube import KubeError
from publisher.retry import ReconnectBackoff
from publisher.source.objects import MapDigest

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Recovery:
    """A success after a problem: the problem that ended, and whether it was a refusal."""

    after: str | None
    refusal_ended: bool


class InformerHealth:
    """When a list or watch call last succeeded (for staleness) and what is wrong now (for the
    operator). A problem is news once: the first failure of a streak, a refusal that is new or
    changed, and the success that ends them; their repeats are counted, not logged."""

    def __init__(self) -> None:
        self.last_success: float | None = None
        self.problem: str | None = None
        self.refusal: str | None = None

    def succeeded(self, now: float) -> Recovery | None:
        """A call succeeded at `now`; the Recovery when a problem ended with it."""
        self.last_success = now
        if self.problem is None and self.refusal is None:
            return None
        recovery = Recovery(self.problem, self.refusal is not None)
        self.problem = self.refusal = None
        return recovery

    def failed(self, problem: str) -> bool:
        """A transient failure; True when it is the first of a streak."""
        news = self.problem is None
        self.problem = problem
        return news

    def refused(self, message: str) -> bool:
        """The API server refused us; True when this refusal is new or says something else."""
        news = message != self.refusal
        self.refusal = self.problem = message
        return news


class Reconnects:
    """The pause before each reconnect, and the age of the connection open now: one that lasted the
    backoff's reset time forgets the failures before it."""

    def __init__(self, backoff: ReconnectBackoff) -> None:
        self._backoff = backoff
        self._opened_at: float | None = None

    @property
    def failures(self) -> int:
        return self._backoff.failures

    def opened(self, now: float) -> None:
        self._opened_at = now

    def ended(self, now: float) -> None:
        """The connection ended (or none was open: nothing to count)."""
        if self._opened_at is not None:
            self._backoff.connected_for(now - self._opened_at)
            self._opened_at = None

    def failed(self) -> float:
        """Seconds to wait before the next attempt."""
        return self._backoff.failed()


class Listing(Generic[T]):
    """One list of a resource, page by page: the entries read so far with their digests, the
    list's resourceVersion (the first page's) and the continue token of the next page (None: done)."""

    def __init__(self, plural: str) -> None:
        self.entries: list[tuple[MapKey, T, str]] = []
        self.digests: dict[MapKey, MapDigest] = {}
        self.version = ""
        self.token: str | None = None
        self._plural = plural

    def items(self, page: Any) -> Iterable[Any]:
        """The raw items of `page`, one list response; raises KubeError when it is not one."""
        if not isinstance(page, dict) or not isinstance(page.get("items") or [], list) or not isinstance(page.get("metadata") or {}, dict):
            # A 2xx that is not a list (a proxy's page that parsed): as transient as no answer.
            raise KubeError(0, "InvalidResponse", f"the list of {self._plural} is not a list of objects")
        metadata = page.get("metadata") or {}
        if not self.token:
            self.version = str(metadata.get("resourceVersion", ""))
        self.token = metadata.get("continue") or None
        items: Iterable[Any] = page.get("items") or ()
        return items

    def add(self, key: MapKey, obj: T, version: str, digest: MapDigest | None) -> None:
        self.entries.append((key, obj, version))
        if digest is not None:
            self.digests[key] = digest


class Changed(Enum):
    """What an event of an object changed, by its digest against the one the Store's object came from."""

    NOTHING = "nothing the loop reads: only other instances' verdicts"
    OWN_VERDICT = "this instance's own condition alone: nothing to decide again"
    DECISION_INPUT = "what a decision is made from (or nothing is known)"


class Digests:
    """The digest of each object an informer holds in its Store, when it digests them."""

    def __init__(self) -> None:
        self._by_key: dict[MapKey, MapDigest] = {}

    def compare(self, key: MapKey, digest: MapDigest | None) -> Changed:
        seen = self._by_key.get(key)
        if digest is None or seen is None or seen.decided != digest.decided:
            return Changed.DECISION_INPUT
        return Changed.NOTHING if seen.own == digest.own else Changed.OWN_VERDICT

    def note(self, key: MapKey, digest: MapDigest | None) -> None:
        """`key` is now stored from an object of `digest` (None: not digested, or gone)."""
        if digest is None:
            self._by_key.pop(key, None)
        else:
            self._by_key[key] = digest

    def replace(self, digests: dict[MapKey, MapDigest]) -> None:
        """A list replaced the Store: these are the digests of what it holds now."""
        self._by_key = digests
