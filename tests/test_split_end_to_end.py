"""The served-split check end to end (issue 22): the sidecar's own loop publishing the demo's map
into a real NGINX in Lua mode, reading NGINX's counters and judging them. A correct split is
verified; a table rewritten behind the sidecar's back 10 points away from the weights is named
off within two windows, in /debug/maps and the metrics, while the map stays published."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client import generate_latest

from adapters import ADAPTERS
from adapters.nginx_lua import LuaRenderer
from publisher import demo, loop, metrics
from publisher.loop import LoopOptions, Publisher
from publisher.manifests import parse_manifests
from publisher.model import Backend, Route
from publisher.served_split import SplitVerifier
from publisher.source import DirectorySource, Stores
from tests.adapters.nginx_fixtures import running_lua_nginx
from tests.gateways import Backends, eventually, measure

pytestmark = pytest.mark.slow

CHAT = demo.CHAT
WINDOW = 2000  # a window is judged at 2,000 requests


def _instance_view(publisher: Publisher) -> dict:
    (entry,) = [m for m in publisher.debug_maps() if (m["namespace"], m["name"]) == CHAT]
    return entry["split"]["instances"]


async def test_the_demo_map_is_verified_on_nginx_and_a_ten_point_skew_is_named_within_two_windows(tmp_path: Path) -> None:
    example = parse_manifests(str(demo.EXAMPLE), demo.EXAMPLE.read_text())
    maps = tmp_path / "maps"
    maps.mkdir()
    async with Backends(demo.CLUSTERS) as backends, running_lua_nginx(tmp_path / "nginx") as nginx:
        objects = demo.point_at(example, CHAT, {name: backends.endpoint(name) for name in demo.CLUSTERS})
        (maps / "chat.yaml").write_text(yaml.safe_dump_all(objects))
        engine = ADAPTERS["nginx"].engine("nginx", nginx.options())
        publisher = Publisher(Stores.empty(), engine, LoopOptions(adapter_name="nginx", resync=3600))
        counter = engine.transport.request_counter
        # One second between reads instead of the CLI's floor of 10: the test's time, not the rule's.
        publisher.split = SplitVerifier(counter, 1.0, "nginx", publisher.split_changed)
        metrics.watch_split(publisher.split)
        source = DirectorySource(maps, publisher.stores, publisher, clock=publisher.clock, poll_interval=0.1)
        running = asyncio.create_task(loop.run(publisher, source))
        try:
            await eventually(lambda: CHAT in publisher.published, timeout=20)
            host = publisher.published[CHAT].hostname
            assert [b.weight for b in publisher.published[CHAT].backends] == [2, 3]
            # Let the sidecar read a baseline, then fill a window past the skipped interval.
            await eventually(lambda: counter.instance in _instance_view(publisher), timeout=10)
            await asyncio.sleep(1.5)
            for _ in range(2):
                await measure(nginx.url, host, WINDOW)
            await eventually(lambda: _instance_view(publisher)[counter.instance]["verdict"] == "verified", timeout=15)
            window = _instance_view(publisher)[counter.instance]
            assert window["expected"] == {"worker-a": 0.4, "worker-b": 0.6}
            assert abs(window["observed"]["worker-a"] - 0.4) < 0.02

            # 1:1 written into NGINX's table with the control listener's secret: 50/50 served for 40/60.
            served = publisher.published[CHAT]
            even = Route(served.hostname, tuple(Backend(b.cluster, b.endpoint, 1) for b in served.backends))
            rogue = engine.transport._entry_text(LuaRenderer().render(CHAT, even))
            secret = nginx.secret_file.read_text().strip()
            async with aiohttp.ClientSession() as session:
                batch = f"{{}}\nset {CHAT.namespace}/{CHAT.name} {rogue}\n"
                async with session.post(nginx.control_url + "/batch", data=batch, headers={"Authorization": f"Bearer {secret}"}) as answer:
                    assert answer.status == 200, await answer.text()
            for _ in range(3):  # the interval that mixes both tables, then two windows
                await measure(nginx.url, host, WINDOW)
                await asyncio.sleep(1.5)
            await eventually(lambda: publisher.split.note(CHAT) is not None, timeout=15)
            assert publisher.split.note(CHAT).startswith(f"served split on nginx {counter.instance} over ")
            assert "(weights 2/3)" in publisher.split.note(CHAT)
            assert _instance_view(publisher)[counter.instance]["verdict"] == "off"
            assert publisher.states[CHAT].state == "published"  # a report, never a hold
            scrape = generate_latest(metrics.REGISTRY).decode()
            assert f'split_off{{gateway="{counter.instance}",name="{CHAT.name}",namespace="{CHAT.namespace}"}} 1.0' in scrape
        finally:
            metrics.watch_split(None)
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await engine.aclose()
