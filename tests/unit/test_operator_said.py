"""Operator commands answer in a sentence (``--json``: the controller's answer as it came)."""

from __future__ import annotations

import pytest

from slurm_elastic.commands.said import said


@pytest.mark.parametrize(("what", "answer", "line"), [
    ("scale", {"target_workers": 1, "paused": True},
     "job 7: target 1 worker, set by hand (`slurm-elastic resume 7` gives the count back to the autoscaler)"),
    ("pause", {"paused": True},
     "job 7: autoscaling paused: the worker count stays at its target (`slurm-elastic resume 7`)"),
    ("resume", {"paused": False}, "job 7: autoscaling resumed"),
    ("wake_all", {"wake_all": True},
     "job 7: wake-all: a worker on every usable GPU slot (`slurm-elastic resume 7` gives the count back to the "
     "autoscaler)"),
    ("drain", {"worker_id": "0003", "state": "DRAINING"},
     "job 7: worker 0003 is DRAINING: it finishes its rollout, hands it over and exits (replaced if the target "
     "still asks for it)"),
    ("cordon", {"node": "node1", "gpu": 2, "cordoned": True},
     "job 7: node1:2 cordoned: no new worker is placed on it (`slurm-elastic uncordon 7 node1:2` lifts it)"),
    ("uncordon", {"node": "node1", "gpu": 2, "cordoned": False, "lifted": ["operator", "crash"]},
     "job 7: node1:2 uncordoned (lifted: operator, crash)"),
])
def test_each_command_says_what_it_did(what: str, answer: dict[str, object], line: str) -> None:
    assert said(what, 7, answer) == line


def test_a_note_follows_on_its_own_line_and_nothing_unprintable_reaches_the_terminal() -> None:
    text = said("scale", 7, {"target_workers": 9, "paused": True, "note": "only 8 GPU slots\x1b[2J"})
    assert text.splitlines()[1] == "note: only 8 GPU slots\\x1b[2J"


def test_an_uncordon_that_lifted_a_cordon_says_so_when_another_stays() -> None:
    """Before, an operator's cordon lifted from a GPU Slurm also marks printed nothing on stdout."""
    answer = {"node": "node2", "gpu": 1, "cordoned": True, "lifted": ["operator"], "source": "slurm",
              "reason": "Slurm marks node node2 DRAIN"}
    assert said("uncordon", 7, answer) == "job 7: node2:1: lifted its operator cordon; it stays cordoned"
    assert said("uncordon", 7, {**answer, "lifted": ["operator", "crash"]}) == (
        "job 7: node2:1: lifted its operator, crash cordons; it stays cordoned")


def test_an_uncordon_that_lifted_nothing_prints_nothing_on_stdout() -> None:
    """The command says on stderr why the GPU stays cordoned, or that nothing was."""
    assert said("uncordon", 7, {"node": "n", "gpu": 0, "cordoned": True, "lifted": [], "reason": "hot"}) == ""
    assert said("uncordon", 7, {"node": "n", "gpu": 0, "cordoned": False, "lifted": []}) == ""
