"""Values that load and then break the job are refused at the edge, naming the key."""

from __future__ import annotations

from typing import Any

import pytest

from slurm_elastic.controller.config import parse_config
from slurm_elastic.core.autoscaler_config import AutoscalerConfig
from slurm_elastic.errors import ConfigError


@pytest.mark.parametrize(("key", "value"), [("horizon_s", 0), ("requests_per_worker_capacity", 0)])
def test_a_knob_the_law_divides_by_must_be_positive(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"autoscaler.{key}: must be > 0"):
        AutoscalerConfig.from_mapping({key: value})


@pytest.mark.parametrize(("doc", "named"), [
    ({"workers": {"heartbeat_interval_s": 30, "heartbeat_grace_s": 5}}, "workers.heartbeat_grace_s (5) must be at"),
    ({"controller": {"tick_interval_s": True}}, "controller.tick_interval_s"),
    ({"controller": {"tick_interval_s": "2"}}, "controller.tick_interval_s"),
    ({"workers": {"cpus_per_worker": "4"}}, "workers.cpus_per_worker"),
    ({"job": {"time_limit": "forever"}}, "job.time_limit"),
    ({"job": {"name": "my run"}}, "job.name"),
    ({"job": {"partition": "a b"}}, "job.partition"),
    ({"job": {"output": ""}}, "job.output"),
    ({"workers": {"initial_workers": 6}, "autoscaler": {"max_workers": 2}},
     "workers.initial_workers (6) > autoscaler.max_workers (2)"),
    ({"agent": {"interval_s": 0.05}}, "agent.interval_s: Input should be greater than or equal to 0.1"),
    ({"agent": {"interval_s": 60}}, "agent.interval_s (60) must be below health.agent_silence_s (30)"),
    ({"health": {"agent_silence_s": 0}}, "health.agent_silence_s: Input should be greater than 0"),
    ({"job": {"mem_per_node_mb": 2000}}, "job.mem_per_node_mb (2000) needs job.trainer_mem_mb and workers.mem_per_worker_mb"),
    ({"job": {"mem_per_node_mb": 2000, "trainer_mem_mb": 500}}, "(2000) needs workers.mem_per_worker_mb too"),
    ({"autoscaler": {"setpoint_batches": 0}}, "autoscaler.setpoint_batches: must be > 0"),
    ({"workers": {"readiness_path": "health"}}, "workers.readiness_path: 'health' must start with /"),
    ({"workers": {"liveness_path": "live"}}, "workers.liveness_path: 'live' must start with /"),
    ({"workers": {"backoff_base_s": 600}}, "workers.backoff_base_s (600) > workers.backoff_max_s (300)"),
    # [burst] is as strict as the other tables (it took "2", true and inf before)
    ({"burst": {"max_jobs": True}}, "burst.max_jobs"),
    ({"burst": {"max_jobs": "2"}}, "burst.max_jobs"),
    ({"burst": {"signal_lead_s": 1.5}}, "burst.signal_lead_s"),
    ({"burst": {"submit_cooldown_s": "60"}}, "burst.submit_cooldown_s"),
    ({"burst": {"controller_unreachable_grace_s": float("inf")}}, "burst.controller_unreachable_grace_s"),
    # text the OS cannot take: before, these loaded and failed at each launch (subprocess's ValueError)
    ({"workers": {"env": {"A=B": "x"}}}, "workers.env: 'A=B' is not an environment variable's name"),
    ({"workers": {"env": {"": "x"}}}, "workers.env: '' is not an environment variable's name"),
    ({"workers": {"env": {"A": "x\x00y"}}}, "workers.env: holds a NUL character"),
    ({"agent": {"inject_file": "/tmp/a\x00b"}}, "agent.inject_file: holds a NUL character"),
    ({"workers": {"command": ["", "w.py"]}}, "workers.command: its first word, the program to run, is empty"),
    # keys another key turns off were read by nothing, silently
    ({"workers": {"readiness_path": "/health"}}, "workers.readiness_path is read only for servers, and workers.kind is 'rollout'"),
    ({"workers": {"liveness_failure_threshold": 5}}, "workers.liveness_failure_threshold is read only for servers"),
    ({"weights": {"update": "sglang"}}, "weights.update is read only for servers"),
    # before, a placeholder other than {cluster} and {job_id} made a directory named "{nope}"
    ({"controller": {"state_dir": "/scratch/{user}/{job_id}"}},
     "controller.state_dir: unknown placeholder {user}; the known ones are {cluster} and {job_id}"),
])
def test_a_value_that_would_break_the_job_later_is_refused_now(doc: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        parse_config(doc)


def test_the_agents_settings_beside_agents_turned_off_are_said_not_refused(caplog: pytest.LogCaptureFixture) -> None:
    """agent.enabled = false is a switch: the settings kept for when it is on again load, with a warning."""
    parse_config({"agent": {"enabled": False, "interval_s": 1}})
    assert "agent.interval_s is read only by the agents, and agent.enabled is false" in caplog.text


def test_good_values_still_load() -> None:
    config = parse_config({"controller": {"tick_interval_s": 2}, "workers": {"heartbeat_interval_s": 5,
                           "heartbeat_grace_s": 10, "command": "python w.py", "mem_per_worker_mb": 8000},
                           "job": {"time_limit": "1-00:00:00", "name": "rl-run_1", "partition": "gpu,scavenger",
                                   "mem_per_node_mb": 64000, "trainer_mem_mb": 16000}})
    assert config.controller.tick_interval_s == 2.0 and config.job.mem_per_node_mb == 64000


def test_a_listen_host_not_of_this_host_is_a_configuration_mistake_not_a_crash_to_restart() -> None:
    import errno
    import socket

    from slurm_elastic.controller.app import _a_config_mistake

    with socket.socket() as sock, pytest.raises(OSError) as bound:
        sock.bind(("10.255.255.1", 0))  # an address no interface here has
    assert _a_config_mistake(bound.value)
    with pytest.raises(OSError) as named:
        socket.getaddrinfo("no-such-host.invalid", 0)
    assert _a_config_mistake(named.value)
    assert not _a_config_mistake(OSError(errno.EADDRINUSE, "in use"))  # may free up: a restart can cure it


def test_a_host_name_that_resolves_to_loopback_listens_on_an_interface_other_nodes_reach(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A stock Debian /etc/hosts maps the host's name to 127.0.1.1: workers on other nodes could
    never reach a controller listening there."""
    import socket
    from types import SimpleNamespace

    import psutil

    from slurm_elastic import host_address
    from slurm_elastic.controller import serve
    from slurm_elastic.worker.context import node_address

    def addr(address: str, family: int = socket.AF_INET) -> SimpleNamespace:
        return SimpleNamespace(family=family, address=address)

    monkeypatch.setattr(host_address.socket, "gethostbyname", lambda _name: "127.0.1.1")
    monkeypatch.setattr(psutil, "net_if_stats", lambda: {n: SimpleNamespace(isup=n != "down0")
                                                     for n in ("lo", "down0", "ib0", "eth0")})
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {
        "lo": [addr("127.0.0.1")], "down0": [addr("10.9.9.9")],
        "ib0": [addr("fe80::1", socket.AF_INET6), addr("169.254.3.4"), addr("10.1.0.17")],
        "eth0": [addr("10.2.0.5")]})
    with caplog.at_level("INFO"):
        assert serve.default_listen_host() == "10.1.0.17"
    assert "127.0.1.1 (loopback)" in caplog.text and "controller.listen_host" in caplog.text
    assert node_address() == "10.1.0.17"  # a server's endpoint too (before, http://127.0.1.1:PORT)
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {"lo": [addr("127.0.0.1")]})
    assert serve.default_listen_host() == "127.0.1.1"  # nothing else is up: loopback, with a warning
    monkeypatch.setattr(host_address.socket, "gethostbyname", lambda _name: "10.3.0.1")
    assert serve.default_listen_host() == "10.3.0.1"  # a name that resolves off this host is taken as it is


@pytest.mark.parametrize(("data", "message"), [
    ({"workers": {"drain_timout_s": 3}}, "workers.drain_timout_s: unknown key (did you mean drain_timeout_s?)"),
    ({"autoscaler": {"max_worker": 3}}, "autoscaler.max_worker: unknown key (did you mean max_workers?)"),
    ({"queue": {"batch_sise": 3}}, "queue.batch_sise: unknown key (did you mean batch_size?)"),
    ({"workers": {"zzz": 1}}, "workers.zzz: unknown key"),
])
def test_an_unknown_key_names_the_close_one(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    assert str(caught.value) == f"config: {message}"
