"""The controller's reads of its job in Slurm: nodes that left, node states, time limit, comment."""

from __future__ import annotations

import logging

from slurm_elastic.client.locate import job_comment
from slurm_elastic.controller.base import ControllerBase
from slurm_elastic.core.naming import worker_id_of_step
from slurm_elastic.core.placement import Allocation
from slurm_elastic.core.slurm_nodes import nodes_to_release, out_of_use_nodes
from slurm_elastic.errors import SlurmElasticError
from slurm_elastic.slurm.parse import JobInfo

log = logging.getLogger(__name__)


class AllocationChecks(ControllerBase):
    """The allocation check: every ``controller.allocation_check_s``, and after a step ended unasked."""

    def check_allocation(self, now_s: float) -> None:
        """Read the job's nodes and comment from Slurm. A node that left the running job (a failed
        node of a ``--no-kill`` job, or ``scontrol update jobid=J NumNodes=N``; Slurm never gives one
        back) gets no more workers or agents, its cordons and samples are dropped, and status names
        it. A comment that no longer names the state directory is set again."""
        self.allocation_checked_s, self.allocation_check_due = now_s, False
        try:
            job = self.backend.job_info(self.job_id)
        except SlurmElasticError as exc:
            self._record_error("allocation", str(exc))
            return
        self.note_job_times(job)
        if job.is_running and job.comment != job_comment(self.state_dir):
            self._restore_job_comment(job.comment)
        out_of_use = self.check_node_states(now_s)
        if out_of_use and job.is_running and self.config.health.release_drained_nodes:
            self.release_nodes(out_of_use, job.nodes, job.batch_host)
        own = self.allocations[0].gpus_by_node
        gone = sorted(set(own) - set(job.nodes)) if job.is_running and job.nodes else []
        if not gone:
            return
        with self.lock:
            kept = {node: gpus for node, gpus in own.items() if node not in gone}
            self.allocations = (Allocation(self.job_id, kept), *self.allocations[1:])
            for node in gone:
                self.state.cordons.forget_node(node)
                self.left_nodes.append({"node": node, "gpus": len(own[node]), "at_s": round(now_s, 3)})
                log.warning("node %s left job %d (Slurm took it out of the allocation: it failed, or the job was "
                            "shrunk); its %d GPUs get no more workers, the job runs on with %s", node, self.job_id,
                            len(own[node]), ",".join(kept) or "no node")
            self.save()

    def note_job_times(self, job: JobInfo) -> None:
        """Keep when the job started and when its time limit ends it (read at each allocation
        check, so a limit raised by ``scontrol update`` is seen within ``allocation_check_s``). A running
        job with no end (its limit set to ``UNLIMITED``) has none, so it is never drained for one."""
        if job.end_time_s > job.start_time_s > 0:
            self.job_times_s = (float(job.start_time_s), float(job.end_time_s))
        elif job.start_time_s > 0 and job.end_time_s == 0:
            self.job_times_s = None

    def check_node_states(self, now_s: float) -> dict[str, str]:
        """Read the states of the nodes the job and its burst jobs hold: every GPU of a node Slurm
        marks drained, down, failing or rebooting is cordoned (by ``slurm``) until it no longer does.
        Returns those nodes, each with why ({} also when Slurm did not answer)."""
        burst = self.burst.running_gpus() if self.burst is not None else {}  # the last listing's
        with self.lock:
            held: dict[str, set[int]] = {}
            for gpus_by_node in [a.gpus_by_node for a in self.allocations] + list(burst.values()):
                for node, gpus in gpus_by_node.items():
                    held.setdefault(node, set()).update(gpus)
        try:
            states = self.backend.node_states(sorted(held))
        except SlurmElasticError as exc:
            self._record_error("node states", str(exc))
            return {}
        self.node_states_read_for = frozenset(burst)
        out = out_of_use_nodes({name: (node.state, node.reason) for name, node in states.items()})
        with self.lock:
            changes = self.state.cordons.observe_slurm_nodes(out, held, now_s)
            by_node: dict[tuple[str, str, str], list[int]] = {}
            for change in changes:
                by_node.setdefault((change.action, change.node, change.reason), []).append(change.gpu)
            for (action, where, reason), indexes in by_node.items():
                log.warning("%s %s GPUs %s (slurm): %s", action, where, ",".join(map(str, indexes)), reason)
            if changes:
                self.save()
        return out

    def release_nodes(self, out_of_use: dict[str, str], job_nodes: tuple[str, ...], batch_host: str) -> None:
        """Give the job's out-of-use nodes that nothing of the job uses any more back to Slurm
        (``health.release_drained_nodes``); the next allocation check drops them."""
        try:
            steps = self.backend.list_steps(self.job_id)
        except SlurmElasticError as exc:
            self._record_error("release nodes", str(exc))
            return
        with self.lock:  # a placeholder only holds a cordoned GPU there: it ends with the node's release
            placeholders = {w.worker_id for w in self.state.workers.values() if w.placeholder}
        steps_by_node: dict[str, list[str]] = {}
        for step in steps:
            if step.step_id not in ("batch", "extern") and worker_id_of_step(step.name) not in placeholders:
                for node in step.nodes:
                    steps_by_node.setdefault(node, []).append(step.name)
        release = nodes_to_release(out_of_use, job_nodes, batch_host, steps_by_node)
        if not release:
            return
        kept = [node for node in job_nodes if node not in release]
        try:
            self.backend.shrink_job(self.job_id, kept)
        except SlurmElasticError as exc:
            self._record_error("release nodes", f"giving {','.join(release)} back to Slurm failed: {exc}")
            return
        for node in release:
            log.warning("gave node %s back to Slurm (%s); job %d runs on with %s", node, out_of_use[node],
                        self.job_id, ",".join(kept))
        self.allocation_check_due = True

    def _restore_job_comment(self, found: str) -> None:
        """Set the job's comment back to the state directory: the CLI, the epilog (a burst job's
        cleanup) and a restarted controller find the job's state through it."""
        wanted = job_comment(self.state_dir)
        try:
            self.backend.set_job_comment(self.job_id, wanted)
        except SlurmElasticError as exc:
            if str(exc) != self.comment_refusal:  # said once, not at every allocation check
                self.comment_refusal = str(exc)
                self._record_error("comment", f"could not set the job's comment back to {wanted!r}: {exc}")
            return
        self.comment_refusal = ""
        if found:
            message = (f"the job's Slurm comment read {found!r}; set back to {wanted!r}, through which "
                       "`slurm-elastic status`, the epilog and a restarted controller find this job's state")
            log.warning("%s", message)
            self._record_error("comment", message)
