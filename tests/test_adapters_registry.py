"""ADAPTERS is the one list of adapters: the CLI choices and the Helm schema follow it."""

from __future__ import annotations

import json
from pathlib import Path

from adapters import ADAPTERS
from publisher.cli.config import RunConfig

SCHEMA = Path(__file__).resolve().parent.parent / "helm" / "ome-gateway-publisher" / "values.schema.json"


def test_cli_choices_are_the_registered_adapters():
    assert set(RunConfig.model_fields["adapter"].annotation.__args__) == set(ADAPTERS)


def test_every_adapter_loads_and_its_options_reach_the_cli():
    for name, spec in ADAPTERS.items():
        options_model = spec.options
        for field in options_model.model_fields:
            assert field in RunConfig.model_fields, f"{name} option {field} has no --{field.replace('_', '-')}"


def test_helm_schema_lists_the_registered_adapters():
    schema = json.loads(SCHEMA.read_text())
    text = json.dumps(schema)
    for name in ADAPTERS:
        assert f'"{name}"' in text
