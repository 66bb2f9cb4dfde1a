"""bench/random_traces.py draws valid traces, the same ones on every machine, of every shape."""

from __future__ import annotations

from pathlib import Path

from bench.random_traces import draw_trace
from slurm_elastic.sim.output import load_trace


def test_every_drawn_trace_loads_and_a_seed_draws_the_same_one(tmp_path: Path) -> None:
    shapes = set()
    for i in range(60):
        text = draw_trace(i)
        assert text == draw_trace(i)
        (tmp_path / f"random{i}.toml").write_text(text)
        trace = load_trace(tmp_path / f"random{i}.toml")
        assert 4 <= trace.cluster.gpu_slots <= 40 and trace.autoscaler.max_workers == trace.cluster.gpu_slots
        shapes.add(text.splitlines()[0])
    assert len(shapes) == 5, shapes
