"""publisher.source.informer_state: the Informer's bookkeeping, without an API server."""

from __future__ import annotations

import pytest

from publisher.core.values import MapKey
from publisher.kube import KubeError
from publisher.retry import ReconnectBackoff
from publisher.source.informer_state import Changed, Digests, InformerHealth, Listing, Reconnects, Recovery
from publisher.source.objects import MapDigest

CHAT = MapKey("prod", "chat")
CODE = MapKey("prod", "code")


def test_the_first_failure_of_a_streak_is_news_and_the_success_that_ends_it_names_it():
    health = InformerHealth()
    assert health.succeeded(1.0) is None and health.last_success == 1.0
    assert health.failed("watch trafficmaps: reset") is True
    assert health.failed("watch trafficmaps: reset again") is False  # counted, not logged
    assert health.problem == "watch trafficmaps: reset again"
    assert health.succeeded(5.0) == Recovery(after="watch trafficmaps: reset again", refusal_ended=False)
    assert health.problem is None and health.last_success == 5.0
    assert health.succeeded(6.0) is None


def test_a_refusal_is_news_once_per_message_and_ends_with_a_success():
    health = InformerHealth()
    assert health.refused("list trafficmaps: 403") is True
    assert health.refused("list trafficmaps: 403") is False
    assert health.refused("list trafficmaps: 404") is True
    assert health.failed("list trafficmaps: timeout") is False  # a streak already under way
    assert health.succeeded(2.0) == Recovery(after="list trafficmaps: timeout", refusal_ended=True)
    assert health.refused("list trafficmaps: 404") is True  # after a success, news again


def test_only_a_connection_that_lasted_resets_the_backoff():
    reconnects = Reconnects(ReconnectBackoff(1.0, 8.0, reset_after=60.0))
    reconnects.ended(100.0)  # no connection was open: nothing to count
    reconnects.failed()
    reconnects.failed()
    reconnects.opened(0.0)
    reconnects.ended(59.0)
    assert reconnects.failures == 2
    reconnects.opened(100.0)
    reconnects.ended(160.0)
    assert reconnects.failures == 0
    reconnects.ended(1000.0)  # already counted
    assert reconnects.failures == 0


def test_a_listing_keeps_the_first_pages_version_and_follows_the_continue_token():
    listing: Listing[str] = Listing("trafficmaps")
    first = {"metadata": {"resourceVersion": "10", "continue": "page-2"}, "items": [{"a": 1}]}
    assert list(listing.items(first)) == [{"a": 1}]
    listing.add(CHAT, "chat", "7", MapDigest(b"digest", None))
    assert (listing.version, listing.token) == ("10", "page-2")
    last = {"metadata": {"resourceVersion": "11"}, "items": None}
    assert list(listing.items(last)) == []
    listing.add(CODE, "code", "9", None)
    assert (listing.version, listing.token) == ("10", None)
    assert listing.entries == [(CHAT, "chat", "7"), (CODE, "code", "9")]
    assert listing.digests == {CHAT: MapDigest(b"digest", None)}


@pytest.mark.parametrize("page", [None, ["item"], "text", {"items": {"a": 1}}, {"metadata": ["x"]}])
def test_a_page_that_is_not_a_list_response_is_a_transient_error(page):
    with pytest.raises(KubeError, match="the list of trafficmaps is not a list of objects") as raised:
        Listing("trafficmaps").items(page)
    assert raised.value.reason == "InvalidResponse"


def test_an_event_is_alike_only_to_the_digest_its_object_was_stored_from():
    digests = Digests()
    one, own = MapDigest(b"one", None), MapDigest(b"one", {"type": "gateway-publisher.ome.io/eu"})
    assert digests.compare(CHAT, None) is Changed.DECISION_INPUT and digests.compare(CHAT, one) is Changed.DECISION_INPUT
    digests.note(CHAT, one)
    assert digests.compare(CHAT, MapDigest(b"one", None)) is Changed.NOTHING
    assert digests.compare(CHAT, own) is Changed.OWN_VERDICT
    assert digests.compare(CHAT, MapDigest(b"two", None)) is Changed.DECISION_INPUT and digests.compare(CHAT, None) is Changed.DECISION_INPUT
    digests.note(CHAT, None)  # stored from an object not digested, or deleted
    assert digests.compare(CHAT, one) is Changed.DECISION_INPUT
    digests.replace({CODE: own})
    assert digests.compare(CODE, own) is Changed.NOTHING and digests.compare(CHAT, one) is Changed.DECISION_INPUT
