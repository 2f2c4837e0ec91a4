"""What the generator is asked: one job per prompt, planned from the seeds and few-shot examples.

A job is a pure function of (seed, index): its category, kind of request, persona, the
few-shot examples shown (drawn from the source's training side) and whether the prompt gets
a follow-up turn. So a resumed run plans the jobs it has not done exactly as an
uninterrupted run would.

Examples are shown as earlier exchanges of the chat (asked for a message, the generator
"gave" the example), then the job's own request follows. Small models follow shown turns far
better than a described format: with the examples listed inside one instruction, 8 of 20
SmolLM2-135M replies passed the filters and most of those echoed the instruction ("A casual
remark to chat about."); written this way, 15 of 16 passed and read like user messages.
Follow-ups are seeded the same way by the source's own second user turns.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from trainer.datagen.synth.seeds import PERSONAS, TASKS

MAX_ANSWER_CHARS = 300  # of an answer shown to the follow-up writer
SHOT_REQUEST = "Write a message that someone could send to a chatbot."


@dataclass(frozen=True)
class Example:
    id: str  # the source conversation's id (trainer.datagen.record_ids.record_id)
    text: str  # its first user turn
    reply: str | None = None  # the assistant's answer to it, when a second user turn follows
    next: str | None = None  # that second user turn


def job_id(index: int) -> str:
    return f"synth-{index}"


@dataclass(frozen=True)
class Job:
    index: int
    category: str
    task: str
    persona: str
    examples: tuple[Example, ...]  # prompt shots
    follow_up: bool
    follow_examples: tuple[Example, ...] = ()  # follow-up shots (with reply and next)

    @property
    def id(self) -> str:
        return job_id(self.index)

    def meta(self) -> dict:
        seeds = [e.id for e in self.examples] + [e.id for e in self.follow_examples]
        return {"category": self.category, "task": self.task, "persona": self.persona, "follow_up": self.follow_up, "seed_ids": seeds}


@dataclass(frozen=True)
class Planner:
    categories: dict[str, str]  # name -> description
    pool: tuple[Example, ...]  # few-shot examples: the source's training side only
    seed: int
    shots: int = 3
    follow_up_fraction: float = 0.25

    def __post_init__(self) -> None:
        if not self.categories or not 0 <= self.follow_up_fraction <= 1 or self.shots < 0 or (self.shots and not self.pool):
            raise ValueError(
                f"planner: need categories, 0 <= follow_up_fraction <= 1 and a few-shot pool for shots > 0; got "
                f"{len(self.categories)} categories, {self.follow_up_fraction}, {len(self.pool)} examples, {self.shots} shots"
            )

    def job(self, index: int) -> Job:
        rng = random.Random(f"synth:{self.seed}:{index}")
        category = rng.choice(sorted(self.categories))
        examples = tuple(rng.sample(self.pool, min(self.shots, len(self.pool))))
        task, persona, follow_up = rng.choice(TASKS), rng.choice(PERSONAS), rng.random() < self.follow_up_fraction
        with_next = [e for e in self.pool if e.next is not None]
        follow = tuple(rng.sample(with_next, min(self.shots, len(with_next)))) if follow_up else ()
        return Job(index, category, task, persona, examples, follow_up, follow)

    def prompt_request(self, job: Job) -> list[dict[str, str]]:
        """The chat the generator answers with a new prompt."""
        shots = []
        for e in job.examples:
            shots += [{"role": "user", "content": SHOT_REQUEST}, {"role": "assistant", "content": e.text}]
        ask = f"Write a message that {job.persona} could send to a chatbot about {self.categories[job.category]}. It should be {job.task}."
        return [*shots, {"role": "user", "content": ask}]


def _follow_up_ask(prompt: str, answer: str) -> str:
    return f'Someone said to a chatbot: "{prompt}"\nThe chatbot replied: "{answer[:MAX_ANSWER_CHARS]}"\nWrite what the person says next.'


def follow_up_request(job: Job, prompt: str, answer: str) -> list[dict[str, str]]:
    """The chat the generator answers with the person's next message."""
    shots = []
    for e in job.follow_examples:
        shots += [{"role": "user", "content": _follow_up_ask(e.text, e.reply or "")}, {"role": "assistant", "content": e.next or ""}]
    return [*shots, {"role": "user", "content": _follow_up_ask(prompt, answer)}]


def example_of(conv: Sequence[dict], cid: str) -> Example:
    """The conversation's first user turn, with the reply and the next user turn when it goes on."""
    turns = [m for m in conv if m["role"] != "system"]
    if len(turns) >= 3 and [m["role"] for m in turns[:3]] == ["user", "assistant", "user"]:
        return Example(cid, turns[0]["content"], turns[1]["content"], turns[2]["content"])
    return Example(cid, next(m["content"] for m in turns if m["role"] == "user"))


def examples_of(convs: Sequence[Sequence[dict]], ids: Sequence[str]) -> tuple[Example, ...]:
    """One example per distinct first user turn (the first conversation that has it), in source order."""
    seen, out = set(), []
    for conv, cid in zip(convs, ids):
        example = example_of(conv, cid)
        if example.text not in seen:
            seen.add(example.text)
            out.append(example)
    return tuple(out)
