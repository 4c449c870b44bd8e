"""Deployment: a trained policy acting on tasks, with the same episode code as training.

`run(task, sampler, env, ...)` is one episode through `rollout.run_episode` — the coroutine that
rollout and evaluation run — with the same chat template, tool format and context strategy
(`rollout.context`), so a policy is deployed in exactly the contexts it was trained in. What it
returns is an `AgentResult`: the episode's `Trajectory` and its transcript, each learner sequence
decoded (after a context edit the policy's context starts again, so the transcript is one text
per sequence).

  from jaxrl_agent import agent
  result = agent.run(task, sampler, envs.make("chain"), tokenizer=tok, template=template,
                     settings=settings, context="summarize")
  print(result.text())

`launch/agent.py --checkpoint <workdir> --env <name>` does this for a run's checkpoint and prints
the transcripts; `load(workdir)` is its Python form.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Sequence

from jaxrl_agent import envs, rollout
from jaxrl_agent.replay.trajectory import Trajectory
from jaxrl_agent.rollout import context as context_lib
from jaxrl_agent.rollout.episode import run_coroutine


@dataclasses.dataclass(frozen=True)
class AgentResult:
    """One deployed episode: its trajectory (the tokens, as rollout records them) and transcript
    (each learner sequence's text: the context the policy saw, then its replies)."""

    trajectory: Trajectory
    transcript: tuple[str, ...]

    @property
    def success(self) -> bool:
        return bool(self.trajectory.reward_components.get("success", 0.0) > 0)

    def text(self) -> str:
        """The transcript, its sequences separated by a line that says a context edit happened."""
        edits = [t.get("context_edit", "") for t in self.trajectory.turns if "context_edit" in t]
        out = [self.transcript[0]] if self.transcript else []
        for i, part in enumerate(self.transcript[1:]):
            out.append(f"\n--- context edited ({edits[i] if i < len(edits) else 'template'}) ---\n{part}")
        return "".join(out)


def transcript(trajectory: Trajectory, tokenizer) -> tuple[str, ...]:
    """Each learner sequence of `trajectory` decoded: exactly the ids the sampler saw and wrote."""
    return tuple(tokenizer.decode(trajectory.tokens[a:b].tolist()) for a, b in trajectory.segments)


def with_context(settings: rollout.EpisodeSettings, context: str | context_lib.ContextSettings | None,
                 max_edits: int | None = None) -> rollout.EpisodeSettings:
    """`settings` with another context strategy (a name keeps the other context settings) and/or
    another cap on edits; None leaves them as they are."""
    ctx = settings.context
    if isinstance(context, context_lib.ContextSettings):
        ctx = context
    elif context is not None:
        ctx = dataclasses.replace(ctx, strategy=context)
    if max_edits is not None:
        ctx = dataclasses.replace(ctx, max_edits=max_edits)
    return dataclasses.replace(settings, context=ctx)


async def run_async(task: envs.Task, sampler, env, *, tokenizer, template, settings: rollout.EpisodeSettings,
                    context: str | context_lib.ContextSettings | None = None, max_edits: int | None = None,
                    seed: int = 0) -> AgentResult:
    """`run` as a coroutine (to run many episodes concurrently on one sampler)."""
    if isinstance(env, envs.Environment):
        env = rollout.InProcessEnv(env)
    elif not inspect.iscoroutinefunction(getattr(env, "reset", None)):
        raise TypeError(f"env={env!r}: expected an envs.Environment or an episode environment "
                        "(rollout.EpisodeEnv: async reset / step / close, e.g. rollout.ServiceEnv)")
    trajectory = await rollout.run_episode(sampler, env, task, tokenizer, template,
                                           with_context(settings, context, max_edits), seed=seed)
    return AgentResult(trajectory, transcript(trajectory, tokenizer))


def run(task: envs.Task, sampler, env, *, tokenizer, template, settings: rollout.EpisodeSettings,
        context: str | context_lib.ContextSettings | None = None, max_edits: int | None = None,
        seed: int = 0) -> AgentResult:
    """Runs the policy behind `sampler` on `task` in `env` (an `envs.Environment`, or an episode
    environment such as `rollout.ServiceEnv`) to the episode's end.

    settings: how episodes are sampled and shown (`build.episode_settings(config, 0.0)` for a
    run's greedy deployment); `context` / `max_edits` override its context strategy and its cap on
    edits (e.g. more edits than training allowed: test-time scaling of the context). `seed` is the
    episode's seed (`rollout.episode_seed` gives rollout's and evaluation's)."""
    return run_coroutine(run_async(task, sampler, env, tokenizer=tokenizer, template=template, settings=settings,
                                   context=context, max_edits=max_edits, seed=seed))


def run_many(tasks: Sequence[envs.Task], sampler, make_env, *, tokenizer, template, settings: rollout.EpisodeSettings,
             context=None, max_edits: int | None = None, seeds: Sequence[int] | None = None) -> list[AgentResult]:
    """`run` on each task, concurrently (the sampler batches them); `make_env(task)` gives each
    episode its environment."""
    import asyncio

    seeds = list(range(len(tasks))) if seeds is None else list(seeds)

    async def all_episodes():
        return await asyncio.gather(*(
            run_async(t, sampler, make_env(t), tokenizer=tokenizer, template=template, settings=settings,
                      context=context, max_edits=max_edits, seed=s) for t, s in zip(tasks, seeds)))

    return list(run_coroutine(all_episodes()))


@dataclasses.dataclass
class Deployment:
    """A run's policy, loaded for deployment (`load`): its config, tokenizer, template, greedy
    episode settings, and an in-process sampler holding the checkpoint's parameters. Close it (or
    use it as a context manager) to stop the sampler."""

    config: object
    tokenizer: object
    template: object
    settings: rollout.EpisodeSettings
    sampler: object
    step: int | None
    subagent_sampler: object = None  # rollout.delegate: the frozen sub-agents' (in `settings.subagents`)

    def close(self) -> None:
        self.sampler.close()
        if self.subagent_sampler is not None:
            self.subagent_sampler.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load(workdir: str, *, config=None, step: int | None = None, temperature: float = 0.0) -> Deployment:
    """The policy of a run's checkpoint (`<workdir>/checkpoints`: the newest that restores, or
    `step`; none: the config's initial parameters, step None) behind an in-process sampler. The
    config is `config`, else the run's `<workdir>/config.json`. A run with sub-agents
    (`rollout.delegate`) gets them too: 'initial' restores the frozen weights the checkpoint keeps
    (no checkpoint: a copy of the initial parameters), and `settings` delegates to them."""
    from jaxrl_agent import build, checkpoint
    from jaxrl_agent.config_lib import run_config

    config = config if config is not None else run_config(workdir)
    model_config, params = build.build_model(config)
    checkpoints = os.path.join(workdir, "checkpoints")
    restored = None
    if step is not None or (os.path.isdir(checkpoints) and os.listdir(checkpoints)):
        params, restored, _ = checkpoint.restore_policy(checkpoints, params, keep=config.checkpoint.keep, step=step)
    tok = build.build_tokenizer(config)
    template = build.build_template(config)
    sampler = build.build_local_sampler(config, model_config, params, tok)
    settings, subagent_sampler = build.episode_settings(config, temperature), None
    if config.rollout.delegate:
        frozen = params
        if config.rollout.delegate == "initial" and restored is not None:
            frozen, _, _ = checkpoint.restore_policy(checkpoints, params, keep=config.checkpoint.keep, step=restored,
                                                     name="subagent_params")
        subagent_sampler = build.build_subagent_sampler(config, model_config, frozen, tok)
        kwargs = build.env_kwargs(config)
        settings = dataclasses.replace(settings, subagents=build.build_subagents(
            config, subagent_sampler, lambda task: rollout.InProcessEnv(envs.make(task.env, **kwargs)), tok, template,
            temperature))
    return Deployment(config, tok, template, settings, sampler, restored, subagent_sampler)
