"""The status table: what a person reads, with and without a controller."""

from __future__ import annotations

from slurm_elastic.status_view import render_status

STATUS = {
    "controller_url": "http://10.0.0.1:4000", "now_s": 1000.0, "uptime_s": 125, "ticks": 60,
    "target_workers": 2, "paused": False, "wake_all": False,
    "last_decision": {"action": "scale_up", "reason": "buffer 12 < setpoint 64 sequences (P term)"},
    "workers_by_state": {"STARTING": 0, "ACTIVE": 2, "DRAINING": 0, "INACTIVE": 3, "FAILED": 0, "BACKOFF": 0},
    "placeholders": 0,
    "workers": [
        {"worker_id": "0001", "step_id": "4", "node": "node1", "gpus": [0], "state": "ACTIVE", "age_s": 100,
         "rollouts": 12, "last_heartbeat_age_s": 0.4},
        {"worker_id": "0002", "step_id": "5", "node": "node2", "gpus": [3], "state": "ACTIVE", "age_s": 4000,
         "rollouts": 300, "last_heartbeat_age_s": 1.2, "placeholder": True},
    ],
    "cordoned_gpus": [{"node": "node2", "gpu": 1, "source": "health", "since_s": 940.0,
                       "reason": "hw_thermal_slowdown"}],
    "unknown_health_nodes": ["node3"],
    "errors": [{"where": "launch", "error": "worker 0009: srun failed"}],
}


def test_table_reads_at_a_glance() -> None:
    text = render_status(7, STATUS)
    assert text.startswith("job 7\ncontroller: http://10.0.0.1:4000  up 2m")
    assert "target: 2 workers (autoscaling)  last decision: scale_up: buffer 12 < setpoint 64" in text
    assert "workers: active 2  inactive 3" in text
    assert "0002    5     node2  3    ACTIVE (placeholder)  67m" in text
    assert "node2:1  health  60s ago  hw_thermal_slowdown" in text
    assert "health unknown (agent silent, no new workers): node3" in text
    assert "recent error [launch]: worker 0009: srun failed" in text


def test_controller_down_shows_slurm_steps() -> None:
    text = render_status(7, None, [{"step_id": "7.3", "name": "se-w-0001", "nodes": ["node1"], "time_used": "5:00"}],
                         unreachable="connection refused")
    assert "controller: UNREACHABLE (connection refused)" in text
    assert "7.3   se-w-0001  node1  5:00" in text


def test_missing_sections_do_not_break_the_table() -> None:
    assert "workers: none" in render_status(1, {"controller_url": "x"})


def test_control_characters_from_clients_are_shown_escaped() -> None:
    hostile = "\x1b]0;owned\x07\x1b[2J\x1b[31mred\nfake line\u202eedoc"
    status = {**STATUS,
              "workers": [{**STATUS["workers"][0], "worker_id": "w\x1b[1m", "node": "node\r1"}],  # type: ignore[index]
              "cordoned_gpus": [{"node": "node\x1b[0m2", "gpu": 1, "source": "operator", "since_s": 940.0,
                                 "reason": hostile}],
              "errors": [{"where": "state\x1b", "error": "bad\x00file"}]}
    text = render_status(7, status)
    assert "\x1b" not in text and "\x07" not in text and "\r" not in text and "\x00" not in text
    assert "\u202e" not in text
    assert "\\x1b]0;owned\\x07\\x1b[2J\\x1b[31mred\\nfake line\\u202eedoc" in text
    assert "w\\x1b[1m" in text and "node\\r1" in text and "recent error [state\\x1b]: bad\\x00file" in text
    plain = {**status, "workers": STATUS["workers"][:1], "cordoned_gpus": STATUS["cordoned_gpus"],
             "errors": STATUS["errors"]}
    assert text.count("\n") == render_status(7, plain).count("\n")  # a newline in a value adds no line
    down = render_status(7, None, [{"step_id": "1", "name": "se-w-\x1b[5m", "nodes": ["n\x1b"], "time_used": ""}],
                         unreachable="refused\x1b[2J")
    assert "\x1b" not in down and "refused\\x1b[2J" in down


def test_buffer_line_from_the_queue_section() -> None:
    queue = {"queued_sequences": 96, "capacity_sequences": 192, "staleness_capacity": 0, "policy_version": 31,
             "delivered_sequences": 992}
    text = render_status(7, {**STATUS, "queue": queue})
    assert "buffer: 96/192 sequences  staleness capacity 0  trainer version 31  delivered 992\n" in text
    assert "buffer:" not in render_status(7, {**STATUS, "queue": None})
    lost = render_status(7, {**STATUS, "queue": {**queue, "lost_groups": 2}})
    assert "delivered 992  LOST 2 groups (damaged records)\n" in lost


def test_trainer_line_from_the_queue_section() -> None:
    queue = {"queued_sequences": 0, "capacity_sequences": 192, "batch_size": 64, "trainer_step_s": 10.0,
             "consumption_seqs_per_s": 5.12, "trainer_wait_fraction": 0.2}
    text = render_status(7, {**STATUS, "queue": queue})
    assert ("trainer: step 10.0 s (demand 6.40 seqs/s)  consumes 5.12 seqs/s  waited for rollouts 20% of its "
            "last steps\n") in text
    assert "trainer: no step measured yet\n" in render_status(7, {**STATUS, "queue": {**queue, "trainer_step_s": None}})


def test_a_hold_is_said_once_and_one_worker_is_singular() -> None:
    held = {**STATUS, "target_workers": 1,
            "last_decision": {"action": "hold", "reason": "hold: 5.6 workers wanted is within the deadband"}}
    assert "target: 1 worker (autoscaling)  last decision: hold: 5.6 workers wanted" in render_status(7, held)


def test_a_recent_error_says_its_age_and_an_old_one_is_not_shown() -> None:
    """An error from a slurmctld hang long over made a healthy job look broken (no time, kept until
    20 newer ones pushed it out): the text shows those of the last 15 minutes, with their age."""
    ctl = {**STATUS, "now_s": 5000.0, "errors": [{"where": "observe", "error": "squeue timed out", "at_s": 3000.0},
                                                 {"where": "launch", "error": "srun failed", "at_s": 4940.0}]}
    text = render_status(7, ctl)
    assert "squeue timed out" not in text
    assert "recent error [launch] 60s ago: srun failed" in text, text


def test_a_node_slurm_takes_out_is_one_cordon_row_and_gpus_read_as_runs() -> None:
    why = "Slurm marks node node2 ALLOCATED+DRAIN: fan swap"
    cordons = [{"node": "node2", "gpu": g, "source": "slurm", "since_s": 990.0, "reason": why} for g in (0, 1, 2, 3, 6)]
    cordons.append({"node": "node2", "gpu": 5, "source": "operator", "since_s": 900.0, "reason": "ECC"})
    text = render_status(7, {**STATUS, "cordoned_gpus": cordons})
    rows = text.split("cordoned GPUs:\n")[1].splitlines()
    assert rows[1].split() == ["node2:0-3,6", "slurm", "10s", "ago", *why.split()]
    assert rows[2].split() == ["node2:5", "operator", "2m", "ago", "ECC"]
    assert len(rows) == 3 or not rows[3].startswith("  node2")


def test_a_quiet_trainer_is_named_with_the_age_of_its_last_call() -> None:
    queue = {"trainer_step_s": 77.7, "batch_size": 32, "trainer_wait_fraction": 0.0, "trainer_last_call_s_ago": 95.0}
    text = render_status(7, {**STATUS, "queue": queue})
    assert "trainer: step 77.7 s (demand 0.41 seqs/s)" in text and "(its last call to the controller: 2m ago)" in text
    assert "last call" not in render_status(7, {**STATUS, "queue": {**queue, "trainer_last_call_s_ago": 3.0}})


def test_a_server_job_says_its_routable_servers_load_and_routers() -> None:
    """Before, the table of a server job said nothing of its servers (only `--json` did)."""
    servers = {"version": 5, "endpoints": [{"worker_id": "0001", "outstanding": 3}, {"worker_id": "0004", "outstanding": 1}],
               "routers": 2, "requests_sent": 108, "requests_retried": 1, "requests_failed": 0, "load_ratio": 0.5,
               "requests_per_worker_capacity": 4}
    text = render_status(7, {**STATUS, "servers": servers})
    assert ("servers: 2 routable, 4 requests outstanding (load 0.50 of capacity 4 each); 2 routers: 108 sent, "
            "1 retried, 0 failed") in text
    quiet = render_status(7, {**STATUS, "servers": {**servers, "endpoints": [], "routers": 0, "load_ratio": None}})
    assert "servers: 0 routable, 0 requests outstanding; no router reported in the last 10 s" in quiet
    assert "servers:" not in render_status(7, {**STATUS, "servers": None})  # a rollout job
    assert "servers: ? (unreadable)" in render_status(7, {**STATUS, "servers": {"routers": "many"}})


def test_a_relaunched_worker_says_so_and_how_often_it_crashed() -> None:
    """A server that crashed and was relaunched under its id is no longer in "ended last": its row says it."""
    workers = [{**STATUS["workers"][0], "launches": 3, "crash_count": 2},  # type: ignore[index]
               {**STATUS["workers"][0], "worker_id": "0003", "launches": 2, "crash_count": 0},  # type: ignore[index]
               {**STATUS["workers"][0], "worker_id": "0004", "launches": 1, "crash_count": 0},  # type: ignore[index]
               {**STATUS["workers"][0], "worker_id": "0005", "launches": 1, "crash_count": 1}]  # type: ignore[index]
    text = render_status(7, {**STATUS, "workers": workers})
    assert "ACTIVE (relaunched 2x, 2 crashes)" in text
    assert "ACTIVE (1 crash)" in text and "relaunched 0x" not in text  # adopted with no saved record
    assert "ACTIVE (relaunched 1x)" in text
    row = next(line for line in text.splitlines() if line.lstrip().startswith("0004")).split()
    assert row[4:6] == ["ACTIVE", "2m"]  # no note: launched once


def test_a_worker_waiting_out_its_backoff_holds_no_gpu_and_has_no_heartbeat_age() -> None:
    """Before, it kept its old GPU and a growing heartbeat age beside its replacement on that GPU."""
    waiting = {"worker_id": "0009", "step_id": None, "node": "node1", "gpus": [3], "state": "BACKOFF",
               "age_s": 360, "rollouts": 291, "last_heartbeat_age_s": 46.0, "crash_count": 1}
    row = next(line for line in render_status(7, {**STATUS, "workers": [waiting]}).splitlines() if "0009" in line)
    assert row.split()[:5] == ["0009", "-", "-", "-", "BACKOFF"] and "46s" not in row


def test_long_times_read_in_days() -> None:
    """Slurm gives a requeued job of an unlimited partition 365 days: the line read `8760.0h`."""
    from slurm_elastic.status_view import _age

    assert [_age(s) for s in (45, 600, 7200, 172799, 365 * 86400)] == ["45s", "10m", "2.0h", "48.0h", "365.0d"]
