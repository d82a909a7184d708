from __future__ import annotations

import json
import logging

import pytest

from publisher.logs import JsonFormatter, TextFormatter, configure


def record(message: str = "map held", **fields) -> logging.LogRecord:
    entry = logging.LogRecord("publisher.loop", logging.WARNING, __file__, 1, message, (), None)
    for key, value in fields.items():
        setattr(entry, key, value)
    return entry


def test_json_lines_carry_the_fields():
    line = JsonFormatter().format(record(map="prod/chat", reason="VerificationFailed"))
    entry = json.loads(line)
    assert entry["msg"] == "map held" and entry["level"] == "warning" and entry["logger"] == "publisher.loop"
    assert entry["map"] == "prod/chat" and entry["reason"] == "VerificationFailed"
    assert entry["time"].endswith("Z")


def test_text_lines_carry_the_same_fields():
    line = TextFormatter().format(record(map="prod/chat", detail="weight is 3, recomputed 2"))
    assert "warning" in line and "map held" in line
    assert "map=prod/chat" in line and 'detail="weight is 3, recomputed 2"' in line


@pytest.mark.parametrize(("log_format", "formatter"), [("json", JsonFormatter), ("text", TextFormatter)])
def test_configure_installs_one_handler(log_format, formatter):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure(log_format, "debug")
        assert len(root.handlers) == 1 and isinstance(root.handlers[0].formatter, formatter)
        assert root.level == logging.DEBUG
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


@pytest.mark.parametrize("formatter", [JsonFormatter, TextFormatter])
def test_none_fields_are_left_out(formatter):
    line = formatter().format(record("watch restarting", resource="trafficmaps", namespace=None, error="reset"))
    assert "None" not in line and "null" not in line and "namespace" not in line
    assert "trafficmaps" in line and "reset" in line
