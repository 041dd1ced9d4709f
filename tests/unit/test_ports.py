"""Listening ports: one bound (0–65535) for every port flag and setting, one line for a taken port."""

from __future__ import annotations

import argparse
import errno
import logging
import socket

import pytest

from infra.config import ConfigError, config_from_mapping
from infra.ports import MAX_PORT, PortUnavailable, port_unavailable
from prm_pipeline.cli import COMMANDS, build_parser, command_parser
from prm_pipeline.flags import port
from scoring_workers.telemetry import WorkerTelemetry
from shaper.telemetry import TrainerTelemetry


@pytest.mark.parametrize("text", ["0", "8431", str(MAX_PORT)])
def test_port_flag_takes_0_to_65535(text: str) -> None:
    assert port(text) == int(text)


@pytest.mark.parametrize("text", ["-1", "65536", "99999", "http", "80.5", ""])
def test_port_flag_refuses_what_is_no_port(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected a port from 0 .* to 65535"):
        port(text)


def test_every_port_flag_of_every_command_is_the_one_port_type() -> None:
    parser = build_parser()
    flags = {
        (name, flag): action.type
        for name in COMMANDS
        for action in command_parser(parser, name)._actions
        for flag in action.option_strings
        if flag in ("--port", "--metrics-port")
    }
    assert {
        ("gateway", "--port"),
        ("worker", "--metrics-port"),
        ("trainer", "--metrics-port"),
        ("status", "--metrics-port"),
        ("model-server", "--port"),
        ("fake-judge", "--port"),
    } <= set(flags)
    assert {key: t for key, t in flags.items() if t is not port} == {}


@pytest.mark.parametrize(
    ("env", "where"),
    [
        ({"PRM_WORKER_METRICS_PORT": "99999"}, "PRM_WORKER_METRICS_PORT"),
        ({"PRM_WORKER_METRICS_PORT": "-1"}, "PRM_WORKER_METRICS_PORT"),
        ({"PRM_GATEWAY_PORT": "65536"}, "PRM_GATEWAY_PORT"),
    ],
)
def test_port_settings_are_bounded_and_name_the_variable(env: dict[str, str], where: str) -> None:
    with pytest.raises(ConfigError, match=where):
        config_from_mapping({}, environ=env)


def test_port_settings_in_the_file_are_bounded() -> None:
    with pytest.raises(ConfigError, match="worker.metrics_port"):
        config_from_mapping({"worker": {"metrics_port": 70000}}, environ={})
    assert config_from_mapping({"worker": {"metrics_port": 0}}, environ={}).worker.metrics_port == 0


def test_a_taken_port_is_one_line_naming_the_setting() -> None:
    message = str(
        port_unavailable(OSError(errno.EADDRINUSE, "Address in use"), "127.0.0.1", 9100, "status --metrics-port")
    )
    assert message.startswith("status --metrics-port: cannot listen on 127.0.0.1:9100: the port is already in use")
    assert "\n" not in message


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_worker_metrics_on_a_taken_port_is_a_config_error(taken_port: int) -> None:
    with pytest.raises(PortUnavailable, match="worker --metrics-port .*PRM_WORKER_METRICS_PORT.*already in use"):
        WorkerTelemetry().serve(taken_port, host="127.0.0.1")


def test_trainer_metrics_on_a_taken_port_is_a_config_error(taken_port: int) -> None:
    with pytest.raises(PortUnavailable, match="trainer --metrics-port: .*already in use"):
        TrainerTelemetry(consumer=None).serve(taken_port, host="127.0.0.1")


def test_metrics_log_the_port_that_0_picked(caplog: pytest.LogCaptureFixture) -> None:
    telemetry = WorkerTelemetry()
    with caplog.at_level(logging.INFO, logger="scoring_workers.telemetry"):
        bound = telemetry.serve(0, host="127.0.0.1")
    try:
        assert bound != 0
        assert f"metrics listening on http://127.0.0.1:{bound}/metrics" in caplog.text
    finally:
        telemetry.close()
