"""Held-out evaluation split over processes pools to the same numbers as one process evaluating all."""

import zlib

import numpy as np

from jaxrl_agent import envs, evaluation, rollout
from jaxrl_agent import tokenizer as tok
from jaxrl_agent.sampling import Completion, SamplingParams
from tests.rollout.test_rollout import END, TOKENIZER


class CoinSampler:
    """Answers a calculator task right or wrong by a coin seeded from its expression (outcomes
    differ across tasks and are the same wherever a task is evaluated)."""

    async def generate(self, prompt_ids, sampling):
        text = TOKENIZER.decode(prompt_ids)
        expr = text.split("Q: ")[1].split("=?")[0]
        value = eval(expr, {"__builtins__": {}})  # noqa: S307 - the calculator's own test expressions
        rng = np.random.RandomState(zlib.crc32(expr.encode()))
        answer = value if rng.rand() < 0.5 else value + 1
        ids = TOKENIZER.encode(envs.format_answer(str(answer))) + [END]
        return Completion(tuple(ids), tuple(-0.5 for _ in ids), tuple(0 for _ in ids), "stop")


def _evaluate(**kwargs):
    environments = {"calculator": envs.make("calculator")}
    spec = evaluation.EvalSpec({"calculator": ((1, 2), (1,))}, tasks_per_difficulty=5, pass_k=3)
    settings = rollout.EpisodeSettings(sampling=SamplingParams(temperature=1.0, max_tokens=100), max_context=400,
                                       max_turns=2)
    results = evaluation.evaluate(CoinSampler(), lambda task: rollout.InProcessEnv(envs.make("calculator")),
                                  environments, TOKENIZER, tok.CHATML, spec, greedy=settings, sampled=settings,
                                  **kwargs)
    results.pop("eval/seconds")
    return results


def test_two_shards_pool_to_the_single_process_numbers():
    whole = _evaluate()
    shares = {}
    second = _evaluate(shard=(1, 2), gather=lambda outcome: shares.setdefault(1, outcome) and [outcome])
    first = _evaluate(shard=(0, 2), gather=lambda outcome: [outcome, shares[1]])
    assert first == whole
    assert len(shares[1]["calculator/1"]["greedy"]) == 2  # tasks 1 and 3 of 5
    assert second != whole  # alone, the share is another sample of the tasks
    assert 0 < whole["eval/pass@1/d1"] < 1 or 0 < whole["eval/pass@1/d2"] < 1
