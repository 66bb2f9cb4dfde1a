"""What the rollout queue refuses, as errors that say why (the API's routes turn them into answers)."""

from __future__ import annotations

from slurm_elastic.errors import SlurmElasticError


class QueueFull(SlurmElasticError):
    """Backpressure: the buffer is at its bound; try again after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnknownBatchError(KeyError):
    """An ack named a batch the queue never handed out."""


class TrainerSessionRefused(SlurmElasticError):
    """A trainer call carries a session other than the newest registration's (nothing changed)."""

    def __init__(self, message: str, session: int, newest: int) -> None:
        super().__init__(message)
        self.session = session
        self.newest = newest


class TrainerSuperseded(TrainerSessionRefused):
    """A trainer call carries a session older than the newest registration on the job."""

    def __init__(self, session: int, newest: int) -> None:
        super().__init__(f"trainer session superseded: this trainer's session {session} is older than the newest "
                         f"trainer registration on this job ({newest}). Another Trainer registered after this one "
                         "(run one Trainer per job, on one rank), or this is the old process of a trainer that was "
                         "restarted; the batches it holds unacknowledged go to the newer one", session, newest)


class TrainerSessionUnknown(TrainerSessionRefused):
    """A trainer call carries a session newer than any registration on the job answered."""

    def __init__(self, session: int, newest: int) -> None:
        super().__init__(f"trainer session unknown: this controller never issued session {session} (the newest "
                         f"trainer registration on this job has {newest}). Send the trainer_session that "
                         "POST /trainer/register answered, or none; a trainer whose controller lost its state "
                         "registers again", session, newest)


class GroupRefused(SlurmElasticError):
    """A group refused for its ``policy_version`` (nothing stored; a resend is refused too)."""

    def __init__(self, message: str, policy_version: int, current_version: int) -> None:
        super().__init__(message)
        self.policy_version = policy_version
        self.current_version = current_version


class StaleGroup(GroupRefused):
    """The group is older than the staleness bound allows at the trainer's current version: it
    could only be dropped. Its sequences left the worker's admission lease (in memory;
    ``RolloutQueue.save_counts`` saves that)."""

    def __init__(self, policy_version: int, current_version: int, max_staleness: int) -> None:
        oldest = current_version - max_staleness
        super().__init__(f"policy_version {policy_version} is stale: the trainer is at version {current_version} "
                         f"and takes rollouts of version {oldest} or newer (max_staleness {max_staleness}); "
                         "the group was not stored", policy_version, current_version)
        self.max_staleness = max_staleness


class VersionAhead(GroupRefused):
    """The group names a policy version past the trainer's current one (never published). Its
    sequences left the worker's admission lease, as for :class:`StaleGroup`."""

    def __init__(self, policy_version: int, current_version: int) -> None:
        super().__init__(f"policy_version {policy_version} is ahead of the trainer's current policy version "
                         f"{current_version}: no rollout can come from a policy not yet published; the group "
                         "was not stored", policy_version, current_version)
