"""Every benchmark in one command, and one markdown report: bench/out/report.md.

    ./run bench            # as root on Debian 12: set-up, dev cluster, every bench (about 50 minutes)
    ./run bench --quick    # shorter forms of each (about 15 minutes)
    .venv/bin/python bench/run_all.py [--quick] [--only NAME ...]

Each bench runs as its own process (the dev cluster up, SLURM_CONF set) and writes
bench/out/<name>.md with ratios against a baseline measured in the same run; benches that name
headline figures also write bench/out/<name>.headline.json. The report starts with the machine,
then the headline table (what README.md shows), then each bench's own section. Atropos' API
server, the ingest peer, is installed into its own virtual environment on first use.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
ATROPOS_VENV = Path(os.environ.get("ATROPOS_VENV", "/tmp/atropos-venv"))

# name -> (arguments for the full form, arguments for the quick form); run in this order
BENCHES: dict[str, tuple[list[str], list[str]]] = {
    "slurm": ([], ["--steps", "30", "--launch-samples", "6", "--list-repeats", "5"]),
    "controller": ([], []),
    "router": ([], []),
    "ingest": ([], ["--quick"]),
    "policy": (["--random", "16"], ["--seeds", "3"]),  # not --quick: the headline's verdicts stay over 20 seeds
    "burst": ([], ["--quick"]),
    "bad_input": ([], []),
    "chaos": (["--duration-s", "600"], ["--quick"]),
    "scale": ([], ["--quick"]),
    "heartbeat_cost": ([], ["--runs", "1"]),
}
REPORT_NAME = {"bad_input": "bad-input"}


def ensure_atropos() -> Path:
    """Atropos' ``run-api`` in its own virtual environment (installed from PyPI on first use)."""
    run_api = ATROPOS_VENV / "bin" / "run-api"
    if not run_api.exists():
        print(f"==> installing atroposlib into {ATROPOS_VENV} (the ingest peer)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(ATROPOS_VENV)], check=True)
        subprocess.run([str(ATROPOS_VENV / "bin" / "pip"), "install", "-q", "atroposlib"], check=True)
    return run_api


def slurm_version() -> str:
    try:
        return subprocess.run(["sinfo", "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_bench(name: str, args: list[str], env: dict[str, str]) -> tuple[int, float]:
    print(f"\n==> bench {name} {' '.join(args)}", flush=True)
    started = time.monotonic()
    code = subprocess.run([sys.executable, str(REPO / "bench" / f"bench_{name}.py"), *args], cwd=REPO,
                          env=env).returncode
    return code, time.monotonic() - started


def headline_rows(names: list[str]) -> list[str]:
    rows = ["| figure | ours | baseline (same run) | ratio |", "|---|---|---|---|"]
    for name in names:
        path = OUT / f"{REPORT_NAME.get(name, name)}.headline.json"
        if path.exists():
            rows += [f"| {r['figure']} | {r['ours']} | {r['baseline']} | {r['ratio']} |"
                     for r in json.loads(path.read_text())]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the shorter form of every bench")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHES), help="run only these")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: assemble the report from the sections already in bench/out")
    args = parser.parse_args()
    names = args.only or list(BENCHES)
    if args.report_only:
        return write_full_report(names, {})
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    OUT.mkdir(parents=True, exist_ok=True)
    for name in names:  # a stale section must not pass for this run's (--report-only reuses them)
        (OUT / f"{REPORT_NAME.get(name, name)}.md").unlink(missing_ok=True)
        (OUT / f"{REPORT_NAME.get(name, name)}.headline.json").unlink(missing_ok=True)
    results: dict[str, tuple[int, float]] = {}
    for name in names:
        extra = BENCHES[name][1 if args.quick else 0]
        if name == "ingest":
            extra = [*extra, "--atropos", str(ensure_atropos())]
        results[name] = run_bench(name, extra, env)
        (OUT / f"{name}.run.json").write_text(json.dumps({"exit": results[name][0], "seconds": results[name][1],
                                                          "args": extra}))
    return write_full_report(names, results)


def write_full_report(names: list[str], results: dict[str, tuple[int, float]]) -> int:
    """bench/out/report.md from the sections in bench/out; 1 if a bench that ran failed."""
    arguments: dict[str, str] = {}
    for name in names:  # benches run earlier (--only, --report-only) keep their exit, duration and arguments
        record = OUT / f"{name}.run.json"
        if record.exists():
            data = json.loads(record.read_text())
            arguments[name] = " ".join(data.get("args", [])).replace(str(ATROPOS_VENV), "$ATROPOS_VENV")
            results.setdefault(name, (int(data["exit"]), float(data["seconds"])))
    memory_gib = psutil.virtual_memory().total / 2**30
    lines = [
        "# slurm-elastic bench report", "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {os.cpu_count()} cores, "
        f"{memory_gib:.0f} GiB; {platform.platform()}; Python {platform.python_version()}; {slurm_version()}. "
        "Every ratio compares against a baseline measured in the same run on this machine; machines are "
        "shared and noisy, so each figure is a median of several runs.", "",
        "## Headline figures", "", *headline_rows(names), "",
        "## Runs", "", "| bench | arguments | exit | seconds |", "|---|---|---|---|",
        *[f"| {n} | `{arguments.get(n) or '(full form)'}` | {c} | {s:.0f} |" for n, (c, s) in results.items()], "",
    ]
    for name in names:
        section = OUT / f"{REPORT_NAME.get(name, name)}.md"
        missing = f"## {name}\n\n(no report: exit {results[name][0] if name in results else 'not run'})\n"
        lines += [section.read_text() if section.exists() else missing, ""]
    report = OUT / "report.md"
    report.write_text("\n".join(lines))
    print(f"\n==> wrote {report}")
    failed = [n for n, (c, _s) in results.items() if c != 0]
    if failed:
        print(f"==> failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
