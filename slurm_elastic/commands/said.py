"""What an operator command prints: the controller's answer in a sentence (``--json``: as it came)."""

from __future__ import annotations

import json
from typing import Any

import click

from slurm_elastic.status_view import printable

json_option = click.option("--json", "as_json", is_flag=True, help="Print the controller's answer as JSON.")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def said(what: str, job_id: int, answer: dict[str, Any]) -> str:
    """The sentence (and the answer's note, if any, on a line of its own) for ``what``'s ``answer``."""
    resume = f"`slurm-elastic resume {job_id}` gives the count back to the autoscaler"
    gpu = f"{answer.get('node')}:{answer.get('gpu')}"
    if what == "scale":
        line = f"job {job_id}: target {_plural(int(answer['target_workers']), 'worker')}, set by hand ({resume})"
    elif what == "pause":
        line = f"job {job_id}: autoscaling paused: the worker count stays at its target (`slurm-elastic resume {job_id}`)"
    elif what == "resume":
        line = f"job {job_id}: autoscaling resumed"
    elif what == "wake_all":
        line = f"job {job_id}: wake-all: a worker on every usable GPU slot ({resume})"
    elif what == "drain":
        line = (f"job {job_id}: worker {answer.get('worker_id')} is {answer.get('state')}: it finishes its rollout, "
                "hands it over and exits (replaced if the target still asks for it)")
    elif what == "cordon":
        line = (f"job {job_id}: {gpu} cordoned: no new worker is placed on it "
                f"(`slurm-elastic uncordon {job_id} {gpu}` lifts it)")
    elif what == "uncordon":
        lifted = ", ".join(map(str, answer.get("lifted") or []))
        if not lifted:
            line = ""  # the command says on stderr why it stays cordoned, or that nothing was
        elif answer.get("cordoned"):  # the command says on stderr by what, and what lifts that
            line = f"job {job_id}: {gpu}: lifted its {lifted} cordon{'s' if ', ' in lifted else ''}; it stays cordoned"
        else:
            line = f"job {job_id}: {gpu} uncordoned (lifted: {lifted})"
    else:
        line = json.dumps(answer)
    note = answer.get("note")
    return "\n".join(printable(part) for part in (line, f"note: {note}" if note else "") if part)


def echo_answer(what: str, job_id: int, answer: dict[str, Any], as_json: bool) -> None:
    """Print ``answer`` as ``said`` puts it, or as JSON."""
    text = json.dumps(answer) if as_json else said(what, job_id, answer)
    if text:
        click.echo(text)
