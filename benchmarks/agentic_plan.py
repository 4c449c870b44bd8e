"""The multi-turn episodes of the agentic sampling benchmark, shared by both of its sides (numpy only:
`tunix_sampler_baseline.py --agentic` imports it from tunix's own Python).

An episode batch is B episodes of `TURNS` assistant turns: a 16-token prompt, then per turn t a reply
of `reply_lengths[t]` tokens (16-64, the same for every episode of the batch, so that a sampler that
decodes the batch in lockstep wastes nothing) and, between turns, a tool result of 10-40 random
tokens per episode. Each turn's prompt is the whole history so far. Deterministic in its seeds.
"""

from __future__ import annotations

import dataclasses

import numpy as np

TURNS = 4
PROMPT_LENGTH = 16
REPLY_TOKENS = (16, 64)  # inclusive range of a reply's length
TOOL_TOKENS = (10, 40)  # inclusive range of a tool result's length
CACHE_LENGTH = 512  # >= PROMPT_LENGTH + TURNS * 64 + (TURNS - 1) * 40 = 392
VOCAB = (200, 8000)  # random ids drawn from here (the benchmark model's vocabulary is 8192)


@dataclasses.dataclass(frozen=True)
class EpisodeBatch:
    prompts: list[list[int]]  # [B][PROMPT_LENGTH]
    reply_lengths: list[int]  # [TURNS]
    tool_results: list[list[list[int]]]  # [TURNS - 1][B][10..40]

    @property
    def batch(self) -> int:
        return len(self.prompts)

    @property
    def generated_tokens(self) -> int:
        return self.batch * sum(self.reply_lengths)


def episode_batch(batch: int, seed: int = 0, ids_seed: int = 0) -> EpisodeBatch:
    """The lengths (reply and tool-result lengths) are drawn from `seed`, the token ids from
    `ids_seed`: batches of one `seed` have the same shapes (compiled once by both samplers) and,
    with new `ids_seed`s, new prompts, as new episodes have (a prefix cache never holds them)."""
    lengths, ids = np.random.RandomState(seed), np.random.RandomState(1_000_003 + ids_seed)
    prompts = [ids.randint(*VOCAB, PROMPT_LENGTH).tolist() for _ in range(batch)]
    replies = [int(lengths.randint(REPLY_TOKENS[0], REPLY_TOKENS[1] + 1)) for _ in range(TURNS)]
    tools = [[ids.randint(*VOCAB, lengths.randint(TOOL_TOKENS[0], TOOL_TOKENS[1] + 1)).tolist() for _ in range(batch)]
             for _ in range(TURNS - 1)]
    return EpisodeBatch(prompts, replies, tools)


def run_episodes(plan: EpisodeBatch, sample) -> tuple[int, list[list[int]]]:
    """Plays the batch's turns through `sample(histories, max_tokens) -> [generated ids per row]`;
    returns (tokens generated, the final histories)."""
    histories = [list(p) for p in plan.prompts]
    generated = 0
    for t, length in enumerate(plan.reply_lengths):
        replies = sample(histories, length)
        generated += sum(len(r) for r in replies)
        histories = [h + list(r) for h, r in zip(histories, replies)]
        if t < len(plan.tool_results):
            histories = [h + tool for h, tool in zip(histories, plan.tool_results[t])]
    return generated, histories
