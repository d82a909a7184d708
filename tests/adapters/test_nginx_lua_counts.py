"""NGINX Lua mode's request counts (adapters/nginx_lua/ome_counts.lua, LuaRequestCounts): real NGINX
counts what it served per map backend; the sidecar reads deltas page by page, and a restart or a
counter that went down restarts the count instead of being misjudged."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from adapters.base import CountReport
from adapters.nginx_lua import LuaRequestCounts
from publisher.model import MapKey
from publisher.split import SplitWindows
from tests.adapters.test_nginx_lua import HOST, KEY, lua_nginx, route
from tests.gateways import Backends, measure


async def collect(counter: LuaRequestCounts) -> CountReport:
    (report,) = await counter.collect()
    return report


@pytest.mark.slow
async def test_nginx_counts_each_backend_it_served_and_the_split_is_judged(tmp_path: Path) -> None:
    weights = {"a": 2, "b": 3, "c": 5, "d": 0}
    other = MapKey("ns", "other")
    async with Backends(tuple(weights)) as backends, lua_nginx(tmp_path) as lua:
        served = route(HOST, *((n, backends.endpoint(n), w) for n, w in weights.items()))
        await lua.push({KEY: served, other: route("other.example.com", ("a", backends.endpoint("a"), 1))})
        counter = lua.transport.request_counter
        assert await counter.collect() == []  # nothing is read until enabled
        counter.enable(60.0)
        counter.page_backends = 3  # pages that split a map's backends
        assert await collect(counter) == CountReport(counter.instance, restarted=True)  # the baseline

        got = await measure(lua.nginx.url, HOST, 1000)
        assert sum(got.values()) == 1000
        report = await collect(counter)
        assert report.instance == counter.instance and not report.restarted
        assert report.counts == {KEY: {name: got[name] for name in ("a", "b", "c")}}
        assert "d" not in got

        windows = SplitWindows(enough=1000)
        windows.route_changed(KEY, served)
        windows.add(KEY, counter.instance, {}, 0.0)
        windows.add(KEY, counter.instance, report.counts[KEY], 1.0)
        (judged,) = windows.judge_due(1.0)
        assert judged[2].verdict == "fine" and judged[2].largest_deviation < 0.01  # round robin is exact

        # A restart empties the counters and changes the boot id: counting starts over.
        await measure(lua.nginx.url, HOST, 10)
        await lua.nginx.restart()
        await lua.push({KEY: None})
        await lua.push({KEY: served})
        assert (await collect(counter)).restarted


@pytest.mark.slow
async def test_a_table_changed_behind_the_sidecars_back_is_caught_by_its_counts(tmp_path: Path) -> None:
    """NGINX is given other weights through the control listener than the sidecar confirmed: the
    counts say so within two windows."""
    confirmed = {"a": 1, "b": 1}
    async with Backends(("a", "b")) as backends, lua_nginx(tmp_path) as lua:
        sidecar_route = route(HOST, *((n, backends.endpoint(n), w) for n, w in confirmed.items()))
        await lua.push({KEY: sidecar_route})
        counter = lua.transport.request_counter
        counter.enable(60.0)
        await collect(counter)
        # Someone else writes 9:1 into the table with the same secret.
        rogue = lua.renderer.render(KEY, route(HOST, ("a", backends.endpoint("a"), 9), ("b", backends.endpoint("b"), 1)))
        rogue_text = lua.transport._entry_text(rogue)
        status, answer = await lua.control("POST", "/batch", f"{{}}\nset {KEY.namespace}/{KEY.name} {rogue_text}\n")
        assert status == 200, answer
        windows = SplitWindows(enough=500)
        windows.route_changed(KEY, sidecar_route)
        windows.add(KEY, counter.instance, {}, 0.0)
        for t in (1.0, 2.0):
            await measure(lua.nginx.url, HOST, 500)
            windows.add(KEY, counter.instance, (await collect(counter)).counts[KEY], t)
            windows.judge_due(t)
        assert list(windows.off()) == [(KEY, counter.instance)]


@pytest.mark.parametrize(("size", "declared"), [("8m", True), ("16m", True), ("off", False)])
def test_nginx_config_declares_the_counts_dict_unless_turned_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], size: str, declared: bool
) -> None:
    from publisher.cli import main

    secret = tmp_path / "secret"
    secret.write_text("test-secret-0123456789abcdef\n")
    code = main(["nginx-config", "--listen", "8080", "--control-listen", "127.0.0.1:8082", "--secret-file", str(secret), "--counts-dict-size", size])
    out = capsys.readouterr().out
    assert code == 0
    assert (f"lua_shared_dict ome_counts {size};" in out) is declared
    assert 'require("ome_counts").count()' in out  # counting without the dict is a no-op


@pytest.mark.slow
async def test_a_weight_change_is_never_held_back_by_a_read_of_the_counters(tmp_path: Path) -> None:
    """Read under the transport's lock, the counters of 10,000 maps (25 ms a page) held every
    weight change that came meanwhile: compare.py's change p99 went from 1.5x to 4.2x the bare
    watch's with a read every 10 s."""
    async with Backends(("a", "b")) as backends, lua_nginx(tmp_path) as lua:
        await lua.push({KEY: route(HOST, ("a", backends.endpoint("a"), 1), ("b", backends.endpoint("b"), 1))})
        counter = lua.transport.request_counter
        counter.enable(60.0)
        exchange = lua.transport._exchange
        reading, release = asyncio.Event(), asyncio.Event()

        async def slow_counts(method: str, path: str, body: str | None = None):  # type: ignore[no-untyped-def]
            if path == "/counts":
                reading.set()
                await release.wait()
            return await exchange(method, path, body)

        lua.transport._exchange = slow_counts  # type: ignore[method-assign]
        read = asyncio.create_task(counter.collect())
        await asyncio.wait_for(reading.wait(), 5)
        result = await asyncio.wait_for(lua.push({KEY: route(HOST, ("a", backends.endpoint("a"), 3), ("b", backends.endpoint("b"), 1))}), 5)
        assert result.rejected == {} and not read.done()
        release.set()
        assert (await read)[0].restarted  # the first read is the baseline
