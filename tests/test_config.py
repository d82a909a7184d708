from __future__ import annotations

import argparse

import pytest

from publisher.cli import config
from publisher.cli.config import ConfigError, RunConfig, load
from publisher.core.durations import parse_duration


def parse_flags(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return vars(parser.parse_args(argv))


def test_defaults_are_valid():
    cfg = load({}, environ={})
    assert cfg.adapter == "json" and cfg.resync == 60.0 and cfg.report_status and cfg.listen_address == ("0.0.0.0", 9180)


def test_flags_beat_environment_which_beats_the_file(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("listen: 127.0.0.1:9000\nlog-format: json\nresync: 5m\nname: from-file\n")
    environ = {"OME_PUBLISHER_LISTEN": "127.0.0.1:9001", "OME_PUBLISHER_NAME": "from-env"}
    cfg = load(parse_flags("--config", str(file), "--name", "from-flag"), environ=environ)
    assert cfg.name == "from-flag" and cfg.region == "from-flag"
    assert cfg.listen == "127.0.0.1:9001"
    assert cfg.log_format == "json"
    assert cfg.resync == 300.0


def test_every_field_has_a_flag_an_environment_variable_and_help():
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    help_text = parser.format_help()
    for name, info in RunConfig.model_fields.items():
        spelled = f"--no-{name.replace('_', '-')}" if info.default is True else config.flag(name)
        assert spelled in help_text, name
        assert info.description, name
    cfg = load({}, environ={"OME_PUBLISHER_DRY_RUN": "true", "OME_PUBLISHER_NAMESPACE": "a,b", "OME_PUBLISHER_REPORT_STATUS": "false"})
    assert cfg.dry_run and cfg.namespace == ("a", "b") and not cfg.report_status


def test_repeated_namespace_and_negated_boolean():
    cfg = load(parse_flags("--namespace", "a", "--namespace", "b", "--no-report-status", "--once"), environ={})
    assert cfg.namespace == ("a", "b") and not cfg.report_status and cfg.once


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"name": "Not_A_Label"}, "--name"),
        ({"region": "Not_A_Label"}, "--region"),
        ({"source": "s3://bucket"}, "--source"),
        ({"adapter": "haproxy"}, "--adapter"),
        ({"resync": "soon"}, "--resync"),
        ({"listen": "8080"}, "--listen"),
        ({"host_template": "{name}.{cluster}"}, "--host-template"),
        ({"ome_published_gate": "sometimes"}, "--ome-published-gate"),
    ],
    ids=["name", "region", "source", "adapter", "resync", "listen", "host-template", "gate"],
)
def test_bad_option_names_the_flag(flags, named):
    with pytest.raises(ConfigError, match=named):
        load(flags, environ={})


def test_unknown_key_in_the_file_is_refused(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("lisen: 1\n")
    with pytest.raises(ConfigError, match="unknown option 'lisen'"):
        load({"config": str(file)}, environ={})


@pytest.mark.parametrize(("text", "seconds"), [("60s", 60.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0), ("1m30s", 90.0), (1.5, 1.5), (3, 3.0)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["0s", "-1s", "1d", "", "fast", "1.5"])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_envoy_admin_needs_a_scheme():
    with pytest.raises(ConfigError, match="--envoy-admin: 'localhost:9901' is not a URL: give the scheme"):
        load({"envoy_admin": "localhost:9901"}, environ={})
    assert load({"envoy_admin": "https://envoy:9901"}, environ={}).envoy_admin == "https://envoy:9901"


def test_once_with_leader_election_is_refused_unless_no_status_is_written():
    for flags in ({"once": True, "leader_elect": True}, {"once": True, "leader_elect": True, "source": "kube"}):
        with pytest.raises(ConfigError, match="--once cannot be combined with --leader-elect"):
            load(flags, environ={})
    assert load({"once": True, "leader_elect": True, "report_status": False}, environ={}).once
    assert load({"dry_run": True, "leader_elect": True}, environ={}).dry_run


def test_one_pass_has_a_bounded_default_timeout():
    assert load({}, environ={}).timeout == 60.0
    assert load({}, environ={"OME_PUBLISHER_TIMEOUT": "5s"}).timeout == 5.0


def test_path_problems_names_each_option(tmp_path):
    cfg = load({"adapter": "envoy", "envoy_dir": str(tmp_path / "nope"), "envoy_ca_file": str(tmp_path / "ca.pem"),
                "kubeconfig": str(tmp_path / "kc")}, environ={})
    assert config.path_problems(cfg) == [
        f"--kubeconfig {tmp_path / 'kc'}: no such file",
        f"--envoy-dir {tmp_path / 'nope'}: no such directory",
        f"--envoy-ca-file {tmp_path / 'ca.pem'}: no such file",
    ]
    assert config.path_problems(load({"json_path": str(tmp_path / "out.json")}, environ={})) == []


def test_status_mode_defaults_to_condition_and_no_report_status_is_off():
    assert load({}, environ={}).effective_status_mode == "condition"
    assert load(parse_flags("--status-mode", "report"), environ={}).effective_status_mode == "report"
    assert load({}, environ={"OME_PUBLISHER_STATUS_MODE": "report"}).effective_status_mode == "report"
    assert load(parse_flags("--no-report-status"), environ={}).effective_status_mode == "off"
    assert load(parse_flags("--no-report-status", "--status-mode", "off"), environ={}).effective_status_mode == "off"
    with pytest.raises(ConfigError, match="--no-report-status is --status-mode off: it contradicts --status-mode report"):
        load(parse_flags("--no-report-status", "--status-mode", "report"), environ={})
    with pytest.raises(ConfigError, match="--status-mode"):
        load({}, environ={"OME_PUBLISHER_STATUS_MODE": "crd"})


def test_once_with_leader_election_is_allowed_when_the_status_mode_is_off():
    assert load({"once": True, "leader_elect": True, "status_mode": "off"}, environ={}).once
    with pytest.raises(ConfigError, match="--once cannot be combined with --leader-elect"):
        load({"once": True, "leader_elect": True, "status_mode": "report"}, environ={})


def test_name_is_the_old_spelling_of_region():
    assert load(parse_flags("--region", "eu"), environ={}).region == "eu"
    assert load(parse_flags("--name", "eu"), environ={}).region == "eu"
    assert load({}, environ={"OME_PUBLISHER_NAME": "eu"}).region == "eu"
    assert load(parse_flags("--name", "eu", "--region", "eu"), environ={}).region == "eu"
    with pytest.raises(ConfigError, match="--name is the old spelling of --region"):
        load(parse_flags("--name", "eu", "--region", "us"), environ={})
