"""A small, real RL problem for the example: learn a hidden token sequence by policy gradient.

The policy is a table of logits, one softmax over ``VOCAB`` tokens per position. A rollout
samples ``LENGTH`` tokens; the reward is the fraction of positions that match a hidden target.
Rollouts come in groups with a group-relative advantage (reward minus the group's mean), and
the trainer takes a policy-gradient step per batch. Chance level is 1/VOCAB; a working loop
drives the mean reward towards 1. CPU-only (numpy), a few microseconds per rollout; the
*time* a rollout takes is drawn from a heavy-tailed distribution, as real generation is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB = 16
LENGTH = 8


@dataclass
class Policy:
    """Logits [LENGTH, VOCAB] at a version."""

    logits: np.ndarray
    version: int = 0

    @classmethod
    def initial(cls) -> Policy:
        return cls(np.zeros((LENGTH, VOCAB), dtype=np.float64), 0)

    def probs(self) -> np.ndarray:
        z = self.logits - self.logits.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)

    def save(self, directory: Path) -> Path:
        """Write ``policy-<version>.npy`` atomically; workers load the newest."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"policy-{self.version:06d}.npy"
        tmp = directory / f".policy-{self.version:06d}.tmp.npy"
        np.save(tmp, self.logits)
        tmp.replace(path)
        return path

    @classmethod
    def load_latest(cls, directory: Path) -> Policy:
        files = sorted(directory.glob("policy-*.npy"))
        if not files:
            return cls.initial()
        latest = files[-1]
        return cls(np.load(latest), int(latest.stem.split("-")[1]))


def target_sequence(seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=LENGTH)


def sample_group(policy: Policy, group_size: int, rng: np.random.Generator,
                 target: np.ndarray) -> dict[str, object]:
    """One group of rollouts: token ids, per-token logprobs, rewards (scores)."""
    probs = policy.probs()
    tokens = np.stack([
        np.array([rng.choice(VOCAB, p=probs[t]) for t in range(LENGTH)]) for _ in range(group_size)
    ])
    logprobs = np.log(probs[np.arange(LENGTH), tokens])
    rewards = (tokens == target).mean(axis=1)
    return {"tokens": tokens.tolist(), "logprobs": logprobs.tolist(), "scores": rewards.tolist(),
            "policy_version": policy.version}


def rollout_time_s(rng: np.random.Generator, scale_s: float) -> float:
    """Heavy-tailed generation time: Pareto (alpha 1.5) with a floor, capped at 20x the scale."""
    return float(min(20 * scale_s, scale_s * (0.5 + rng.pareto(1.5))))


def policy_gradient_step(policy: Policy, tokens: np.ndarray, scores: np.ndarray, group_size: int,
                         learning_rate: float = 0.5) -> Policy:
    """One step of group-relative policy gradient on a batch (rows grouped by ``group_size``)."""
    advantages = scores.reshape(-1, group_size)
    advantages = (advantages - advantages.mean(axis=1, keepdims=True)).reshape(-1)
    probs = policy.probs()
    grad = np.zeros_like(policy.logits)
    for row, advantage in zip(tokens, advantages, strict=True):
        if advantage == 0:
            continue
        onehot = np.zeros_like(grad)
        onehot[np.arange(LENGTH), row] = 1.0
        grad += advantage * (onehot - probs)
    grad /= max(1, len(tokens))
    return Policy(policy.logits + learning_rate * grad * LENGTH, policy.version + 1)
