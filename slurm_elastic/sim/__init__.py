"""The trace simulator: replays a workload through the real autoscaler and reconcile code.

``trace``, ``policies`` and ``engine`` are pure (simulated clock, no I/O); ``output`` writes the
summary and draws the timeline.
"""

from slurm_elastic.sim.engine import Simulation, simulate
from slurm_elastic.sim.policies import POLICIES
from slurm_elastic.sim.results import SimResult
from slurm_elastic.sim.trace import Trace, parse_trace

__all__ = ["POLICIES", "SimResult", "Simulation", "Trace", "parse_trace", "simulate"]
