"""A rubric judge: an LLM, served by the same sampler as the policy, scores an episode.

`judge_prompt(task_prompt, transcript, rubric)` renders the instructions; the judge is asked to end
with `SCORE: <number between 0 and 10>`. `parse_judge_score(text)` never raises: it reads the last
`SCORE:` (or, failing that, the last `<number>/10`) and returns a float in [0, 1], or None when the
output holds no usable score — a failure the caller records, not a crash of the run.
`RubricJudge(sampler, tokenizer, template)` runs the judge through any `Sampler` and returns the
score with the raw text.
"""

from __future__ import annotations

import dataclasses
import math
import re

from jaxrl_agent.sampling.types import SamplingParams

DEFAULT_RUBRIC = (
    "1. The final answer is correct.",
    "2. Tools were called with valid arguments and their results were used.",
    "3. No unnecessary steps or text.",
)

_SCORE_RE = re.compile(r"score\s*[:=]\s*([-+]?\d+(?:\.\d+)?)", re.I)
_OUT_OF_RE = re.compile(r"([-+]?\d+(?:\.\d+)?)\s*/\s*10\b")


def judge_prompt(task_prompt: str, transcript: str, rubric=DEFAULT_RUBRIC) -> str:
    items = "\n".join(rubric)
    return (f"You grade an agent's work against a rubric.\nTask:\n{task_prompt}\n\nTranscript:\n{transcript}\n\n"
            f"Rubric:\n{items}\n\nThink briefly, then end with a line 'SCORE: <0-10>'.")


def parse_judge_score(text) -> float | None:
    """Score in [0, 1] from a judge's output, or None; never raises on any input."""
    try:
        if not isinstance(text, str):
            return None
        for pattern in (_SCORE_RE, _OUT_OF_RE):
            matches = pattern.findall(text)
            if matches:
                value = float(matches[-1])
                if not math.isfinite(value) or value < 0 or value > 10:
                    return None
                return value / 10.0
        return None
    except Exception:  # noqa: BLE001 - by contract: a bad judge output is a recorded failure
        return None


@dataclasses.dataclass
class JudgeResult:
    score: float | None
    text: str


class RubricJudge:
    """Scores transcripts with a judge model behind a `Sampler` (in-process or remote)."""

    def __init__(self, sampler, tokenizer, template, *, rubric=DEFAULT_RUBRIC, max_tokens: int = 64,
                 temperature: float = 0.0):
        self.sampler, self.tokenizer, self.template = sampler, tokenizer, template
        self.rubric = tuple(rubric)
        self.sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens)
        self.failures = 0

    async def score(self, task_prompt: str, transcript: str) -> JudgeResult:
        prompt = judge_prompt(task_prompt, transcript, self.rubric)
        ids = self.template.render([{"role": "user", "content": prompt}], self.tokenizer,
                                   add_generation_prompt=True).ids
        try:
            completion = await self.sampler.generate(list(ids), self.sampling)
            text = self.tokenizer.decode(completion.token_ids)
        except Exception as err:  # noqa: BLE001 - a judge failure must not end the run
            self.failures += 1
            return JudgeResult(None, f"judge error: {err!r}")
        score = parse_judge_score(text)
        if score is None:
            self.failures += 1
        return JudgeResult(score, text)
