"""More probes for the bad-input table (:mod:`tests.cluster.bad_input`), on the same live job: values
JSON has no text for, loose types and unbounded numbers on the control plane and the agents'
route, operator arguments that never end a wait, a damaged token file."""

from __future__ import annotations

from collections.abc import Iterator

import httpx

from slurm_elastic.client.files import TOKEN_COPY
from tests.cluster.bad_input import Probe, Rig, _api, cli, error_line, group, short

GPU = '{"node": "node1", "index": 0, "temperature_c": 40.0}'
REPORT = '{"node": "node1", "sampled_at_s": 1.0, "gpus": [' + GPU + "]}"


def _json(rig: Rig, path: str, body: str) -> httpx.Response:
    """``body`` sent as it is (no JSON encoder would write it) as JSON, with the job's token."""
    return rig.post(path, content=body.encode(), headers={**rig.auth, "content-type": "application/json"})


def audit_probes(rig: Rig) -> Iterator[Probe]:
    yield _api(rig, "scale to `NaN` workers", lambda: _json(rig, "/admin/scale", '{"workers": NaN}'),
               422, '"workers"')
    yield _api(rig, "scale to `true` workers", lambda: _json(rig, "/admin/scale", '{"workers": true}'),
               422, '"workers"')
    yield _api(rig, "heartbeat with `busy_s: Infinity`",
               lambda: _json(rig, "/workers/0001/heartbeat", '{"busy_s": Infinity}'), 422, '"busy_s"')
    yield _api(rig, "cordon with a lone surrogate (`\\ud800`) in the reason",
               lambda: _json(rig, "/admin/cordon", '{"node": "node1", "gpu": 0, "reason": "a\\ud800"}'),
               422, '"reason"')
    yield _api(rig, "agent report of a GPU at temperature `Infinity`",
               lambda: _json(rig, "/agent/report", REPORT.replace("40.0", "Infinity")),
               422, '"temperature_c"')
    yield _api(rig, "agent report of GPU index 10^23",
               lambda: _json(rig, "/agent/report", REPORT.replace('"index": 0', '"index": ' + "9" * 23)),
               422, '"index"')
    yield from hurtful_body_probes(rig)
    before = rig.snapshot()
    result = cli("scale", str(rig.job.job_id), "1", "--wait", "--timeout-s", "nan")
    kept, same = rig.kept(before)
    yield Probe("CLI", "`slurm-elastic scale JOB 1 --wait --timeout-s nan`", f"exit {result.returncode}: "
                f"{error_line(result)}", kept, result.returncode == 2 and "nan" in result.stderr and same)
    yield from token_probes(rig)


def hurtful_body_probes(rig: Rig) -> Iterator[Probe]:
    """Bodies built to cost the controller, with the job's token; a report of a GPU the job does
    not hold; a rollout from a policy version the trainer never published."""
    yield _api(rig, "scale with JSON nested 900 levels deep",
               lambda: _json(rig, "/admin/scale", '{"workers": ' + "[" * 900 + "]" * 900 + "}"), 422,
               "nested too deeply")
    flood = '{"node": "node1", "sampled_at_s": 1.0, "gpus": [' + ",".join(["1"] * 200_000) + "]}"
    before = rig.snapshot()
    answer = _json(rig, "/agent/report", flood)
    kept, same = rig.kept(before)
    yield Probe("HTTP API", "agent report of 200,000 GPUs, each a number (400 KB)",
                f"{answer.status_code} in {len(answer.content)} bytes: {short(answer.text, 70)}", kept,
                answer.status_code == 422 and len(answer.content) < 4096 and "gpus" in answer.text and same)
    cordons = rig.http.get("/controller/status", headers=rig.auth).json()["cordoned_gpus"]
    foreign = REPORT.replace('"index": 0, "temperature_c": 40.0', '"index": 999, "ecc_uncorrectable_volatile": 5')
    answer = _json(rig, "/agent/report", foreign)
    after = rig.http.get("/controller/status", headers=rig.auth).json()["cordoned_gpus"]
    yield Probe("HTTP API", "agent report of a failing GPU 999 on node1 (the job holds none such)",
                f"{answer.status_code} {short(answer.text, 70)}", f"cordoned GPUs {len(after)}: "
                + ("unchanged" if after == cordons else f"CHANGED from {cordons}"),
                answer.status_code == 200 and answer.json().get("ignored_gpus") == [999] and after == cordons)
    yield _api(rig, "submit a group of `policy_version` 10^6 (never published)",
               lambda: rig.post("/rollouts", {**group("ahead"), "policy_version": 10**6}), 409, "ahead")


def token_probes(rig: Rig) -> Iterator[Probe]:
    """The job's token file emptied under a live job: read from its copy; with the copy gone too,
    a one-line error naming the file."""
    token_file, copy = rig.job.state_dir / "token", rig.job.state_dir / TOKEN_COPY
    saved = {path: path.read_text() for path in (token_file, copy)}
    try:
        before = rig.snapshot()
        token_file.write_text("")
        result = cli("status", str(rig.job.job_id))
        kept, same = rig.kept(before)
        yield Probe("CLI", "`slurm-elastic status JOB` with the job's token file emptied",
                    f"exit {result.returncode}: {short(result.stdout.splitlines()[1] if result.stdout else result.stderr, 70)}"
                    " (the token read from its copy)", kept, result.returncode == 0 and same)
        copy.write_text("")
        result = cli("pause", str(rig.job.job_id))
        kept, same = rig.kept(before)
        yield Probe("CLI", "`slurm-elastic pause JOB` with the token file and its copy emptied",
                    f"exit {result.returncode}: {error_line(result).replace(str(rig.job.state_dir), '$STATE')}", kept,
                    result.returncode == 1 and "is empty" in result.stderr and same)
    finally:
        for path, text in saved.items():
            path.write_text(text)
