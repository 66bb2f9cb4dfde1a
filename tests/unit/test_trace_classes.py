"""Every shipped trace is either a tuning trace or held out, in the policy bench and in its own header."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.bench_policy import HELD_OUT, TRACE_NAMES, TRACES


def test_each_trace_is_tuning_or_held_out_and_its_header_says_which() -> None:
    shipped = {path.stem for path in TRACES.glob("*.toml")}
    assert set(TRACE_NAMES) | set(HELD_OUT) == shipped
    assert not set(TRACE_NAMES) & set(HELD_OUT)
    for name in shipped:
        text = (TRACES / f"{name}.toml").read_text()
        says_held_out = text.startswith("# HELD OUT FROM TUNING") and 'description = "HELD OUT' in text
        assert says_held_out == (name in HELD_OUT), name


def test_the_bench_names_an_unknown_trace_and_lists_the_shipped_ones() -> None:
    bench = Path(__file__).resolve().parents[2] / "bench" / "bench_policy.py"
    result = subprocess.run([sys.executable, str(bench), "--traces", "steady,no_such_trace"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert "unknown trace(s) no_such_trace; shipped: steady," in result.stderr
