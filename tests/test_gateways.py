"""The split measurement the real-gateway tests rely on must itself be able to fail."""

from __future__ import annotations

import pytest

from tests.gateways import assert_split


def test_exact_shares_pass():
    assert_split({"a": 750, "b": 250}, {"a": 3, "b": 1})


@pytest.mark.parametrize(
    ("counts", "weights"),
    [
        ({"a": 700, "b": 300}, {"a": 3, "b": 1}),
        ({"a": 999, "z": 1}, {"a": 1, "z": 0}),
        ({"a": 500, "stranger": 500}, {"a": 1}),
        ({"status:503": 10}, {"a": 1}),
    ],
    ids=["share-off-by-5-points", "weight-0-got-one", "backend-outside-the-map", "no-backend-answered"],
)
def test_wrong_splits_fail(counts, weights):
    with pytest.raises(AssertionError):
        assert_split(counts, weights)


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    """The kernel may give a just-released port again: two servers of one test then shared it."""
    import socket

    from tests import gateways

    offered = iter([47001, 47001, 47002])

    class Recycling:
        def __init__(self, *args):
            self.port = 0

        def __enter__(self):
            return self

        def __exit__(self, *args):
            return False

        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(socket, "socket", Recycling)
    monkeypatch.setattr(gateways, "_HANDED_OUT", set())
    assert [gateways.free_port(), gateways.free_port()] == [47001, 47002]
