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

import numpy as np

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


def _transcript(trajectory, decode) -> tuple[str, str]:
    """(task prompt, transcript after it) decoded from the episode's token ids. An episode of several
    learner sequences is judged on its last one (the final context, which holds the whole
    conversation as the policy last saw it), after the first sequence's prompt."""
    generated = np.flatnonzero(np.asarray(trajectory.loss_mask) == 1)
    start = int(generated[0]) if generated.size else len(trajectory.tokens)
    last = trajectory.segment_starts[-1] if getattr(trajectory, "segment_starts", ()) else 0
    return decode(trajectory.tokens[:start]), decode(trajectory.tokens[last + start:])


def judge_groups(judge: "RubricJudge", groups, decode, *, length_bias_threshold: float = 0.5
                 ) -> tuple[list[list], dict[str, float]]:
    """Scores every episode with the judge; returns new trajectories with the named component
    'judge' (the score in [0, 1]; 0 and 'judge_failed' = 1 when the judge gave no usable score) and
    metrics: mean score, failures, and the length-bias check of MiniMax-M1 (the Pearson correlation
    of score with sampled length over the scored episodes; `judge/length_bias_warning` = 1 above
    the threshold: a judge that rewards verbosity, which RL would learn to exploit)."""
    import asyncio
    import dataclasses

    from jaxrl_agent.rewards.components import length_bias
    from jaxrl_agent.rollout.episode import run_coroutine  # here: rollout imports rewards

    episodes = [t for g in groups for t in g]

    async def score_all():
        return await asyncio.gather(*(judge.score(*_transcript(t, decode)) for t in episodes))

    results = run_coroutine(score_all()) if episodes else []
    scored = iter(results)
    out = []
    for g in groups:
        new = []
        for t in g:
            result = next(scored)
            components = {**t.reward_components, "judge": float(result.score or 0.0),
                          "judge_failed": float(result.score is None)}
            new.append(dataclasses.replace(t, reward_components=components))
        out.append(new)
    valid = [(r.score, t.generated_tokens) for r, t in zip(results, episodes) if r.score is not None]
    bias = length_bias([s for s, _ in valid], [n for _, n in valid])
    metrics = {"judge/score_mean": float(np.mean([s for s, _ in valid])) if valid else 0.0,
               "judge/failures": float(len(results) - len(valid)), "judge/length_bias": bias}
    if bias > length_bias_threshold:
        metrics["judge/length_bias_warning"] = 1.0
    return out, metrics
