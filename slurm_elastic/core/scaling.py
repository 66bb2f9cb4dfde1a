"""The autoscaler: rollout pressure (and, for servers, request load) -> a worker count.

Pure: no I/O, the time is passed in. The control law (units in brackets):

    staleness room room  = (max_staleness - 1/2)·batch_size - in_flight     [sequences]
    setpoint       sp    = min(setpoint_batches·batch_size, max(setpoint_floor_batches·batch_size, room))
    buffer error   e(t)  = sp - queued                            [sequences]; > 0: the trainer starves
    error ahead    a(t)  = e(t) - loading·per_worker_rate·horizon_s  [sequences]
    feed-forward   w_ff  = consumption / per_worker_rate          [workers]
    PID            u(t)  = Kp·a + Ki·∫a dt - Kd·d(queued)/dt       [sequences]
    recommendation w*    = w_ff + u(t) / (per_worker_rate · horizon_s)   [workers]

The room is what the staleness bound lets the buffer hold on average: while the trainer computes,
buffered + in flight <= max_staleness·batch_size, and each pull takes a batch out, so the buffer
averages half a batch below its peak. A setpoint above the room could never be reached and would
never let the policy scale down. per_worker_rate is the production of a worker while it
generates (sequences per busy worker-second), not per ACTIVE worker: workers waiting at the
staleness gate or loading their model would otherwise lower it until w_ff mirrors the count.
The error ahead counts what workers launched but still loading (no rollout started yet) will
produce within the horizon as already coming (a Smith predictor for the model load's dead time):
without it, every decision during a long load asks again for the workers the last one launched.

With the derivative on the measurement (no kick when the setpoint moves) and anti-windup (the
integral stops growing while the output is pinned at a bound, or while the hysteresis below holds
a move back: an integral that grows while a cooldown or the stabilization window delays the move
it asks for overshoots once the move is made). Then the bounds that make it
safe: a full buffer or an exhausted staleness capacity never scales up (they scale down, to
what the trainer's measured demand needs when that is fewer than one down: more workers would
only make rollouts staler), the law never scales down while the trainer waits with the buffer
below its setpoint (its consumption, starved, reads as low demand), min/max workers and GPU
slots, a deadband and N confirmations in a row (hysteresis), separate scale-up and scale-down
cooldowns, a minimum stable period, a
scale-down stabilization window (act on the highest recommendation in it, as Kubernetes' HPA
does, each scaled by the trainer's demand now over its demand then; lengthened to a swinging
load's cycle by core.swings), and a maximum step per action. The trainer's demand is
batch_size / its compute time per step, measured from its pulls (core.rates.TrainerSteps).
Workers still starting count as capacity, draining ones do not, so nothing is counted twice.
Before the rates are measured the start-up (core.startup) decides, and one sizing step hands over
to this law. A trainer back from a stall gets the count it needs in one step (core.speedup),
before the full bounds are looked at, and a trainer whose stalls recur alike gets it a worker's
lead time before one ends (core.stalls).

For inference servers a second source, their load ratio (core.server_load), recommends a count
too; when both sources exist the larger recommendation wins, and the reason says which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from slurm_elastic.core.autoscaler_config import AutoscalerConfig
from slurm_elastic.core.autoscaler_memory import AutoscalerMemory
from slurm_elastic.core.rates import positive
from slurm_elastic.core.server_load import load_recommendation
from slurm_elastic.core.speedup import SPEEDUP_LOOKBACK_S, UsualCount, speedup_resize
from slurm_elastic.core.startup import (
    measured,
    sizing_step,
    staleness_ceiling,
    startup_recommendation,
)

RESUME_SETTLE_S = 30.0  # a restarted controller's rates start again from nothing: held this long


@dataclass(frozen=True)
class PressureInputs:
    """What the controller measured this tick. None = not measured (yet)."""

    queued_seqs: float | None
    batch_size: int
    consumption_seqs_per_s: float | None = None
    trainer_demand_seqs_per_s: float | None = None  # batch_size / the trainer's compute time per step
    trainer_latest_demand_seqs_per_s: float | None = None  # batch_size / its last step's compute time
    trainer_waiting: bool | None = None  # the trainer waits for a batch now (None: it has not asked yet)
    per_worker_seqs_per_s: float | None = None  # production per worker while generating (busy)
    in_flight_seqs: float | None = None  # admitted, not yet submitted (the staleness manager's running)
    max_staleness: int | None = None  # the queue's bound; None: the setpoint is not limited by it
    staleness_capacity_seqs: float | None = None
    buffer_capacity_seqs: float | None = None
    smallest_group_seqs: int | None = None  # the smallest of the last groups accepted (None: none yet)
    workers_starting: int = 0
    workers_active: int = 0
    workers_draining: int = 0
    workers_loading: int = 0  # launched, no rollout started yet (starting, or loading their model)
    allowed_slots: int = 1_000_000
    burst_slots: int = 0  # of allowed_slots, those only burst jobs not yet held could add
    outstanding_requests: int | None = None


@dataclass(frozen=True)
class Decision:
    target_workers: int
    action: str  # "scale_up" | "scale_down" | "hold"
    reason: str
    recommended: float | None = None
    error_seqs: float | None = None
    p: float | None = None
    i: float | None = None
    d: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def _pressure_words(queued_seqs: float, setpoint_seqs: float) -> str:
    """The buffer against its setpoint, as a user reads it."""
    if queued_seqs < setpoint_seqs:
        return f"trainer starving: the buffer holds {queued_seqs:.0f} of the {setpoint_seqs:.0f} seqs aimed for"
    return f"buffer above setpoint: {queued_seqs:.0f} seqs buffered, {setpoint_seqs:.0f} aimed for"


def _fewer_workers(x: PressureInputs, current: int) -> tuple[float, str]:
    """With the buffer or the staleness bound full: one worker fewer, or as few as the trainer's
    measured demand needs when that is fewer still."""
    demand, rate = x.trainer_demand_seqs_per_s, x.per_worker_seqs_per_s
    if demand and rate and math.isfinite(demand) and math.isfinite(rate) and demand / rate < current - 1:
        return demand / rate, (f"fewer workers, {demand / rate:.2f} for the trainer's demand {demand:.2f} seqs/s "
                               f"at {rate:.2f} per worker")
    return float(current - 1), "fewer workers"


def return_resize(x: PressureInputs, current: int) -> tuple[int, str] | None:
    """Back from a count the autoscaler did not set (an operator's target, a pause, wake-all, the
    drain before the time limit) with the trainer waiting: the workers its measured demand needs
    at the measured production, at once, where that is more than ``current``; None otherwise (the
    law goes on from the count it finds). A starved trainer's consumption is what the few
    workers make, so the law alone climbs back a cooldown at a time."""
    demand, production = positive(x.trainer_demand_seqs_per_s), positive(x.per_worker_seqs_per_s)
    if demand is None or production is None or not x.trainer_waiting:
        return None
    need = math.ceil(demand / production - 1e-9)
    if need <= current:
        return None
    return need, (f"back from a count the autoscaler did not set, the trainer waiting: it needs {demand:.2f} "
                  f"seqs/s, a worker makes {production:.2f} -> {need} workers at once")


def unmeasured_for_return(x: PressureInputs) -> bool:
    """:func:`return_resize` cannot tell yet: the trainer's demand or a worker's production is not measured."""
    return positive(x.trainer_demand_seqs_per_s) is None or positive(x.per_worker_seqs_per_s) is None


def effective_setpoint_seqs(cfg: AutoscalerConfig, x: PressureInputs) -> float:
    """The buffer level aimed for [sequences]: setpoint_batches·batch_size, lowered to what the
    staleness bound lets the buffer hold while ``in_flight_seqs`` are generating, but not below
    setpoint_floor_batches·batch_size: half a batch is the least average that has a full batch
    ready at each pull, and the quarter batch above it is the margin for a batch's last groups
    that come late."""
    wanted = cfg.setpoint_batches * x.batch_size
    if x.max_staleness is None or x.in_flight_seqs is None or not math.isfinite(x.in_flight_seqs):
        return wanted
    room = (x.max_staleness - 0.5) * x.batch_size - x.in_flight_seqs
    return min(wanted, max(cfg.setpoint_floor_batches * x.batch_size, room))


@dataclass
class Autoscaler(AutoscalerMemory):
    """The policy with its memory (integral, votes, cooldowns, window: kept and saved by
    :class:`~slurm_elastic.core.autoscaler_memory.AutoscalerMemory`)."""

    def decide(self, x: PressureInputs, now_s: float) -> Decision:
        """One decision; its reason names, in plain words, the pressure and whatever term, bound,
        vote, period or cooldown made it (a hold while the trainer waits says why it holds)."""
        cfg = self.config
        current = x.workers_starting + x.workers_active  # draining workers are not capacity
        room = staleness_ceiling(x)
        ceiling = max(cfg.min_workers, min(cfg.max_workers, x.allowed_slots, room or x.allowed_slots))
        self.startup_step = self.direct_step = False
        if self.resuming:
            self.resumed_s = now_s if self.resumed_s is None else self.resumed_s
            if self.ramped and now_s - self.resumed_s < RESUME_SETTLE_S:
                return self._hold(current, ceiling, (
                    f"hold: the controller restarted {now_s - self.resumed_s:.0f} s ago; its rates are measured "
                    f"again for {RESUME_SETTLE_S:g} s before the autoscaler acts on them"), (None, None, None, None))
            self.resuming = False
        rec, why, terms = self._recommend(x, now_s, current)
        rec_load, why_load = load_recommendation(self.config, x.outstanding_requests, x.workers_active, current)
        if rec_load is not None and (rec is None or rec_load > rec):
            rec, why = rec_load, why_load
        bound_by_room = room is not None and ceiling == room < min(cfg.max_workers, x.allowed_slots)
        if bound_by_room and current > ceiling:  # those above it could not start a rollout: shed at once,
            # a bound, not a move: no cooldown starts (the start-up's sizing step may follow)
            return Decision(ceiling, "scale_down", f"{why}; the staleness bound lets {room} rollouts run at once "
                            f"(max_staleness + 1 batches of {x.batch_size} in groups of {x.smallest_group_seqs}): "
                            f"the workers above {room} could not start one", rec, *terms)
        if rec is None:
            return self._hold(current, ceiling, why, terms)
        starving = terms[0] is not None and terms[0] > 0
        despite = " although the trainer waits for rollouts" if starving else ""
        steady = min(max(current, cfg.min_workers), ceiling)  # what a hold keeps: within the bounds
        bounded = min(max(rec, cfg.min_workers), ceiling)
        limit = (f"the staleness bound ({room} rollouts at once)" if bound_by_room
                 else f"max_workers ({cfg.max_workers})" if cfg.max_workers <= x.allowed_slots
                 else f"the usable GPU slots ({x.allowed_slots})")
        if rec > ceiling and current <= ceiling and abs(bounded - current) <= cfg.deadband_workers:
            self._remember(bounded, positive(x.trainer_demand_seqs_per_s), now_s)  # the window holds the ceiling
            self.votes, self.votes_dir, self.direction_since_s = 0, 0, None
            self.held_dir = 1
            return Decision(steady, "hold", f"hold: at the ceiling, {limit}{despite}; {why}", rec, *terms)
        bounded, kept = self._stabilized(bounded, current, positive(x.trainer_demand_seqs_per_s), now_s)
        why += kept
        window_held = bool(kept)
        delta = bounded - current
        self.held_dir = -1 if window_held else 0
        if delta < -cfg.deadband_workers and starving and x.trainer_waiting and terms[1] is not None:
            self.votes, self.votes_dir, self.direction_since_s = 0, 0, None  # the law's move, not a bound's
            self.held_dir = -1
            return Decision(steady, "hold", f"hold: no scale-down while the trainer waits for rollouts; {why}",
                            rec, *terms)
        if abs(delta) <= cfg.deadband_workers:
            self.votes, self.votes_dir, self.direction_since_s = 0, 0, None
            return Decision(steady, "hold", f"hold: {bounded:.1f} workers wanted is within the deadband "
                            f"({cfg.deadband_workers:g} worker) of the current {current}{despite}; {why}", rec, *terms)
        direction = 1 if delta > 0 else -1
        word = "up" if direction > 0 else "down"
        self.held_dir = direction  # until the move is made in full below
        wait = self._hysteresis(direction, now_s)
        if wait is not None:
            return Decision(steady, "hold", f"{wait}{despite}; {why}", rec, *terms)
        at_once = self.startup_step or self.direct_step
        limit_step = cfg.max_step_up if direction > 0 else cfg.max_step_down
        if at_once:
            limit_step = max(limit_step, math.ceil(abs(delta)))
        step = min(abs(delta), limit_step)
        target = current + direction * max(1, math.floor(step + 1e-9))
        if direction > 0:
            if not self.direct_step:  # a trainer back from a stall is not the load swinging
                self.swings.scaled_up(now_s, self.last_down_s, self.last_up_s, starving)
            self.last_up_s = now_s
        else:
            self.last_down_s = now_s
        self.votes = 0
        if not unmeasured_for_return(x):  # a move made before the rates are measured (to min_workers from
            self.returning = False        # 0) leaves the resize back to come
        capped = f" (step capped at max_step_{word} {limit_step})" if step < abs(delta) else ""
        if not capped and not window_held:
            self.held_dir = 0
        bound = f" (bounded by {limit})" if direction > 0 and rec > ceiling and target == ceiling else ""
        return Decision(target, f"scale_{word}", f"{why}{capped}{bound}", rec, *terms)

    def _remember(self, bounded: float, demand: float | None, now_s: float) -> tuple[float, str]:
        """Put a recommendation in the stabilization window (not a start-up's: its counts are
        guesses) and drop those older than it; the window's length, and why it is lengthened."""
        if not self.startup_step:
            self.window.append((now_s, bounded, demand))
        window_s, swinging = self.swings.window_s(self.config.stabilization_window_s, now_s)
        self.window = [w for w in self.window if now_s - w[0] <= window_s]
        return window_s, swinging

    def _stabilized(self, bounded: float, current: int, demand: float | None, now_s: float) -> tuple[float, str]:
        """The scale-down stabilization window: a count below ``current`` raised to the highest
        recommendation in the window (each scaled by the trainer's demand now over its demand
        then), and what the reason says of it ('' where the window kept nothing back)."""
        window_s, swinging = self._remember(bounded, demand, now_s)
        if bounded >= current:
            return bounded, ""
        highest = max((r * (demand / then if demand and then else 1.0) for _t, r, then in self.window),
                      default=bounded)
        if highest <= bounded:
            return bounded, ""
        kept = min(float(current), highest)
        length = f", lengthened to {window_s:.0f} s because {swinging}," if swinging else f" ({window_s:g} s)"
        return kept, f"; the stabilization window{length} keeps {kept:.1f} (highest recent recommendation {highest:.1f})"

    def _hysteresis(self, direction: int, now_s: float) -> str | None:
        """This reading's vote for a move in ``direction`` (+1 up, -1 down), and why the move must
        wait: too few confirmations in a row or a direction not held for the minimum stable period
        (neither for a start-up or speed-up step), or a cooldown; None: make it now."""
        cfg = self.config
        if direction != self.votes_dir:
            self.votes_dir, self.votes, self.direction_since_s = direction, 0, now_s
        self.votes += 1
        word, more = ("up", "more") if direction > 0 else ("down", "fewer")
        if not (self.startup_step or self.direct_step):
            if self.votes < cfg.confirmations:
                return (f"hold: {word} vote {self.votes}/{cfg.confirmations}, waiting for {cfg.confirmations} "
                        f"readings in a row that ask for {more} workers (confirmations)")
            assert self.direction_since_s is not None
            held_s = now_s - self.direction_since_s
            if held_s < cfg.min_stable_period_s:
                return (f"hold: the call for {more} workers is not stable yet, it has held {held_s:.0f} s of the "
                        f"{cfg.min_stable_period_s:g} s required (min_stable_period_s)")
        last, cooldown = (self.last_up_s, cfg.scale_up_cooldown_s) if direction > 0 else (
            self.last_down_s, cfg.scale_down_cooldown_s)
        if now_s - last < cooldown:
            return (f"hold: cooldown after scale-{word} ({cooldown - (now_s - last):.0f} s left of "
                    f"scale_{word}_cooldown_s {cooldown:g} s)")
        return None

    def _hold(self, current: int, ceiling: int, why: str, terms: tuple[float | None, ...]) -> Decision:
        self.held_dir = 0
        target = min(max(current, self.config.min_workers), ceiling)
        action = "hold" if target == current else ("scale_up" if target > current else "scale_down")
        return Decision(target, action, why, None, *terms)

    def _recommend(self, x: PressureInputs, now_s: float, current: int
                   ) -> tuple[float | None, str, tuple[float | None, float | None, float | None, float | None]]:
        cfg = self.config
        none4: tuple[float | None, float | None, float | None, float | None] = (None, None, None, None)
        if x.queued_seqs is None or not math.isfinite(x.queued_seqs) or x.batch_size <= 0:
            return None, ("nothing to measure yet: no rollout has reached the buffer and the trainer has not asked "
                          "for a batch"), none4
        setpoint = effective_setpoint_seqs(cfg, x)
        error = setpoint - x.queued_seqs
        dt = 0.0 if self.last_now_s is None else max(0.0, now_s - self.last_now_s)
        d_queued = 0.0 if self.last_queued is None or dt == 0 else (x.queued_seqs - self.last_queued) / dt
        self.last_now_s, self.last_queued = now_s, x.queued_seqs
        if self.lead_s is None and not self.ramped:  # the start-up measures a worker's lead time
            if self.first_seen_s is None:
                self.first_seen_s = now_s
            elif positive(x.per_worker_seqs_per_s):
                self.lead_s = now_s - self.first_seen_s
        if not self.ramped and measured(x):
            self.ramped = True
            if self.starting:  # a start-up ran: it ends with one sizing step
                self.starting, self.startup_step, self.window = False, True, []
                rec, why = sizing_step(x)
                return rec, f"{_pressure_words(x.queued_seqs, setpoint)}; {why}", (error, None, None, None)
        back = return_resize(x, current) if self.returning else None
        # until the move is made (a cooldown may hold it a while), or until the rates it needs are
        # measured: back from `scale J 0` no worker makes anything, and an operator's count taken
        # before the start-up sized the pool leaves no start-up sizing step to come
        self.returning = back is not None or (self.returning and unmeasured_for_return(x))
        if back is not None:  # the count was the operator's (or none): the trainer's demand sets it at once
            self.direct_step = True
            return float(back[0]), f"{_pressure_words(x.queued_seqs, setpoint)}; {back[1]}", (error, None, None, None)
        jump = self._speedup(x, now_s, current) if self.ramped else None
        if jump is not None:  # before the full bounds: the buffer a stall filled empties fast now
            self.direct_step = True
            self.integral = max(self.integral, 0.0)  # what the stall wound down no longer holds
            return float(jump[0]), f"{_pressure_words(x.queued_seqs, setpoint)}; {jump[1]}", (error, None, None, None)
        stall = self.stalls.advice(now_s, self.lead_s, self.usual.workers, current) if self.usual else None
        if stall is not None:  # a recurring stall: its workers back before it ends, then held
            if stall[0] is None:
                return None, stall[1], (error, None, None, None)
            self.direct_step = True
            return float(stall[0]), f"{_pressure_words(x.queued_seqs, setpoint)}; {stall[1]}", (error, None, None, None)
        full = None
        if x.staleness_capacity_seqs is not None and x.staleness_capacity_seqs <= 0:
            full = "staleness bound reached (capacity 0)"
            if x.trainer_waiting and x.queued_seqs < x.batch_size:  # nothing starts, no batch comes: stuck
                full += (" while the trainer waits for a batch: no rollout starts until it publishes its next "
                         "policy version (Trainer.publish_version after every batch: a version a batch)")
        elif x.buffer_capacity_seqs is not None and x.queued_seqs >= x.buffer_capacity_seqs:
            full = f"buffer full ({x.queued_seqs:.0f}/{x.buffer_capacity_seqs:.0f})"
        if full is not None and not self.ramped and x.trainer_waiting is not None:
            self.starting = True
            return None, f"{full}: holding until the trainer's demand is measured (start-up)", (error, None, None, None)
        if full is not None:  # the trainer is the bottleneck: fewer workers, down to what its demand needs
            self.integral = min(self.integral, 0.0)
            fewer, why = _fewer_workers(x, current)
            return fewer, f"{full}: {why}", (error, None, None, None)
        start = None if self.ramped else startup_recommendation(cfg, x, current, setpoint)
        if start is not None:
            self.startup_step = self.starting = True
            return start[0], start[1], (error, None, None, None)
        rate = x.per_worker_seqs_per_s
        if rate is None or not math.isfinite(rate) or rate <= 0:
            return None, "no production rate measured yet: holding", (error, None, None, None)
        coming = x.workers_loading * rate * cfg.horizon_s  # ordered already: what loading workers will add
        ahead = error - coming
        p = cfg.kp * ahead
        d = -cfg.kd * d_queued
        consumption, taken = positive(x.consumption_seqs_per_s), "consumption"
        if consumption is None:  # before two pulls: its demand, from its step time
            consumption, taken = positive(x.trainer_demand_seqs_per_s) or 0.0, "demand"
        feed_forward = consumption / rate
        tentative = feed_forward + (p + cfg.ki * self.integral + d) / (rate * cfg.horizon_s)
        saturated_up = tentative >= min(self.config.max_workers, x.allowed_slots,
                                        staleness_ceiling(x) or x.allowed_slots) and ahead > 0
        saturated_down = tentative <= self.config.min_workers and ahead < 0
        held_back = self.held_dir != 0 and (ahead > 0) == (self.held_dir > 0)
        if not (saturated_up or saturated_down or held_back):  # anti-windup: not while pinned or held back
            self.integral = max(-cfg.integral_limit_seqs_s, min(cfg.integral_limit_seqs_s, self.integral + ahead * dt))
        i = cfg.ki * self.integral
        rec = feed_forward + (p + i + d) / (rate * cfg.horizon_s)
        loading = (f" ({x.workers_loading} workers still loading count for {coming:.0f} seqs of it)"
                   if x.workers_loading else "")
        why = (f"{_pressure_words(x.queued_seqs, setpoint)}{loading}; the trainer's {taken} {consumption:.2f} seqs/s ÷ "
               f"{rate:.2f} per worker = feed-forward {feed_forward:.2f} + P {p:.0f} I {i:.0f} D {d:.0f} -> {rec:.2f} workers")
        return rec, why, (error, p, i, d)

    def _speedup(self, x: PressureInputs, now_s: float, current: int) -> tuple[int, str] | None:
        """Track the usual count; the speed-up resize's count, if the trainer has just sped up."""
        demand = positive(x.trainer_demand_seqs_per_s)
        if demand is not None:
            if self.usual is None:
                self.usual = UsualCount(float(current), demand, now_s)
            else:
                self.usual.observe(current, demand, now_s)
        latest, rate = positive(x.trainer_latest_demand_seqs_per_s), positive(x.per_worker_seqs_per_s)
        if latest is not None and self.usual is not None:
            self.stalls.observe(latest, self.usual.demand_seqs_per_s, now_s)
        if latest is None or rate is None:
            return None
        recent = [then for t, _r, then in self.window if then is not None and now_s - t <= SPEEDUP_LOOKBACK_S]
        return speedup_resize(latest, recent, rate, current, self.usual)
