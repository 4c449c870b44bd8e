"""One run's parts, built once from its config, and the few counters the loop keeps.

`build_run(config, workdir)` validates the config and builds every part (`build` chooses each);
`Run` holds them, with what the trainer's loop asks of them: a record on the run's one step axis
(`log`), the held-out evaluation, a weight push to the sampler, a checkpoint write that stops the
run cleanly when it fails (`RunStopped`), and closing every part. The loop itself is `trainer`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agent import build, checkpoint, evaluation, invariants, learner, losses, models, replay, rollout, sharding
from jaxrl_agent import metrics as metrics_lib
from jaxrl_agent import tokenizer as tokenizer_lib


class RunStopped(RuntimeError):
    """The run stopped itself, cleanly, for the reason given (its records and last good checkpoint
    are kept): a run of non-finite updates, a checkpoint that could not be written."""


# Stages logged during RL: their global step is `sft.steps` + the RL iteration.
RL_STAGES = ("rl", "rl_eval", "rl_end", "resume", "alarm", "response")


def _levels(value) -> tuple[int, ...]:
    return tuple(int(d) for d in build.split_list(value))


@dataclasses.dataclass
class Run:
    """The parts of one run, built once from the config, and its few running counters."""

    config: Any
    writer: metrics_lib.MetricsWriter
    tokenizer: tokenizer_lib.Tokenizer
    template: tokenizer_lib.TurnTemplate
    mesh: jax.sharding.Mesh
    model_config: models.ModelConfig
    environments: build.Environments
    sampler: Any  # sampling.types.Sampler
    servers: build.SamplerServers | None
    buffer: replay.ReplayBuffer
    checkpointer: checkpoint.Checkpointer
    objective: losses.Objective
    postprocess: rollout.PostprocessSettings
    eval_spec: evaluation.EvalSpec
    train_levels: dict[str, tuple[int, ...]]
    sft_levels: dict[str, tuple[int, ...]]
    resume: checkpoint.RunState | None
    started: float  # monotonic time the run began (earlier segments of a resumed run counted in)
    rng: np.random.RandomState
    params: Any
    judge: Any = None  # rewards.RubricJudge of reward.judge, built when RL starts
    judge_params: Any = None  # reward.judge='policy': the frozen weights it judges with (checkpointed)
    subagent_sampler: Any = None  # rollout.delegate: the frozen sub-agents' sampler, built when SFT ends
    subagent_params: Any = None  # rollout.delegate='initial': the sub-agents' frozen weights (checkpointed)
    version: int = 0
    trained_tokens_total: int = 0
    last_eval_seconds: float = 0.0
    global_step: int = 0  # the last record's step on the one counter across stages
    consecutive_skips: int = 0  # learner updates in a row skipped as non-finite
    skipped_checkpoints: list = dataclasses.field(default_factory=list)  # (step, reason) resume passed over
    invariant_settings: invariants.Settings = invariants.Settings()  # of invariants.*
    invariants: invariants.MonitorState | None = None  # alarm states and the responses' controls

    def log(self, stage: str, step: int, metrics: dict[str, Any], *, console: str | None = None,
            global_step: int | None = None) -> None:
        """One record. Its `global_step` counts SFT updates, then `sft.steps` + the RL iteration, so
        every stage's records (evaluation's `eval/*` above all) lie on one axis."""
        if global_step is None:
            global_step = step + (self.config.sft.steps if stage in RL_STAGES else 0)
        if console is None and stage.endswith("eval"):
            console = metrics_lib.eval_console_line(stage, step, metrics)
        self.global_step = global_step
        self.writer.write(stage, step, metrics, global_step=global_step + self.config.metrics.global_step_offset,
                          console=console)

    def elapsed_seconds(self) -> float:
        return time.monotonic() - self.started

    def episode_settings(self, temperature: float) -> rollout.EpisodeSettings:
        """The run's episodes at `temperature`; with sub-agents (once started), with the `delegate`
        tool on them at the same temperature."""
        settings = build.episode_settings(self.config, temperature)
        if self.subagent_sampler is None:
            return settings
        return dataclasses.replace(settings, subagents=build.build_subagents(
            self.config, self.subagent_sampler, self.environments.make_env, self.tokenizer, self.template, temperature))

    def start_subagents(self) -> None:
        """`rollout.delegate`: the frozen sub-agents' sampler, on a copy of the current weights
        ('initial': the weights RL starts from) or a Hugging Face folder; once per run."""
        if not self.config.rollout.delegate or self.subagent_sampler is not None:
            return
        if self.config.rollout.delegate == "initial":
            self.subagent_params = jax.tree.map(jnp.copy, self.params)  # the learner donates its own
        self.subagent_sampler = build.build_subagent_sampler(self.config, self.model_config, self.subagent_params,
                                                             self.tokenizer)

    def frozen_arrays(self) -> dict[str, Any]:
        """The frozen weights a checkpoint keeps beside the learner state (`checkpoint.learner_arrays`)."""
        return {"judge_params": self.judge_params, "subagent_params": self.subagent_params}

    def evaluate(self) -> dict[str, float]:
        total = sum(len(levels) for levels, _ in self.eval_spec.levels.values())
        with self.writer.console.sub_progress("eval", total, unit="level") as progress:
            results = evaluation.evaluate(
                self.sampler, self.environments.make_env, self.environments.environments, self.tokenizer,
                self.template, self.eval_spec, greedy=self.episode_settings(0.0),
                sampled=self.episode_settings(self.config.rollout.temperature), progress=progress,
                # With several processes each evaluates its share of the tasks; all get the job's numbers.
                shard=(jax.process_index(), jax.process_count()),
                gather=sharding.gather_objects if jax.process_count() > 1 else None)
        self.last_eval_seconds = results["eval/seconds"]
        return results

    def push_weights(self, params) -> None:
        self.version += 1
        self.params = params
        self.sampler.update_weights(params, self.version)

    def save(self, stage: str, iteration: int, state: learner.TrainState, source: rollout.source.RolloutSource | None):
        """Writes a checkpoint; one that cannot be written stops the run cleanly (the previous one is kept)."""
        step = self.config.sft.steps + iteration
        run_state = checkpoint.run_state(
            stage=stage, iteration=iteration, version=self.version, elapsed_seconds=self.elapsed_seconds(),
            trained_tokens_total=self.trained_tokens_total, source=source.state_dict() if source is not None else {},
            # The buffer under its runner's lock: episodes finish and suspend while this runs.
            replay=source.runner.pending_state() if source is not None else self.buffer.state_dict(),
            rng=self.rng, invariants=self.invariants.to_dict() if self.invariants is not None else {})
        try:
            self.checkpointer.save(step, checkpoint.learner_arrays(state, self.frozen_arrays()), run_state)
        except (checkpoint.CheckpointWriteError, OSError) as err:
            if not isinstance(err, checkpoint.CheckpointWriteError):  # raised before orbax was reached
                err = checkpoint.CheckpointWriteError(step, self.checkpointer.manager.latest_step(), err)
            self.log("checkpoint_failed", iteration, err.record, global_step=step, console=f"error: {err}")
            raise RunStopped(str(err)) from err
        if self.config.checkpoint.export_hf and self.writer.active:
            from jaxrl_agent.cli import export_hf

            error = export_hf.export_at_save(self.writer.workdir, step, self.config, self.model_config, state.params)
            if error:  # the checkpoint is written; an export is a convenience
                self.log("export_failed", iteration, {"checkpoint_step": step, "error": error},
                         global_step=step, console=f"warning: Hugging Face export of step {step} failed: {error}")

    def sampler_stats(self) -> dict[str, float]:
        try:
            return self.sampler.sampler_stats()
        except Exception as err:  # noqa: BLE001 - metrics must not stop the run (a server may be down)
            self.writer.say(f"warning: sampler stats unavailable: {err}")
            return {}

    def close(self) -> None:
        if self.judge is not None:
            self.judge.sampler.close()
        if self.subagent_sampler is not None:
            self.subagent_sampler.close()
        self.environments.close()
        if self.servers is not None:
            self.servers.close()
        else:
            self.sampler.close()
        self.checkpointer.close()
        self.writer.close()


def build_run(config, workdir: str, *, quiet: bool = False, objective: losses.Objective | None = None,
              reward_fn: Callable | None = None) -> Run:
    """Validates the config, then builds every part of the run."""
    started = time.monotonic()  # the run's clock starts here (sampler servers start below)
    build.validate_config(config, reward_fn_given=reward_fn is not None)
    checkpoint.check_workdir(workdir, resume=config.resume)
    objective = objective if objective is not None else build.build_objective(config)
    if not isinstance(objective, losses.Objective):
        raise build.ConfigError(f"objective={objective!r}: expected a losses.Objective (losses.make_objective)")
    environments = build.Environments(config)
    try:
        tokenizer = build.build_tokenizer(config)
        mesh = build.build_mesh(config)
        model_config, params = build.build_model(config, mesh)
        sampler, servers = build.build_sampler(config, model_config, params, tokenizer, workdir)
    except BaseException:
        environments.close()
        raise
    checkpointer = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), config.checkpoint.keep)
    resume = checkpointer.latest() if config.resume else None
    resume = resume.for_process(jax.process_index()) if resume is not None else None
    skipped_checkpoints = list(getattr(checkpointer, "skipped", [])) if config.resume else []
    if config.resume and resume is None and skipped_checkpoints:
        checkpointer.close()
        environments.close()
        servers.close() if servers is not None else sampler.close()
        raise build.ConfigError(f"resume=True but no checkpoint in {workdir}/checkpoints restores: "
                                f"{skipped_checkpoints}")
    r = config.rollout
    named = environments.environments
    train = {n: evaluation.levels_for(e, _levels(config.env.train_difficulties)) for n, e in named.items()}
    sft = {n: evaluation.levels_for(e, _levels(config.sft.difficulties or config.env.train_difficulties))
           for n, e in named.items()}
    evals = {n: (evaluation.levels_for(e, _levels(config.env.eval_difficulties)), train[n]) for n, e in named.items()}
    return Run(
        config=config, writer=metrics_lib.MetricsWriter(
            workdir, tensorboard=config.metrics.tensorboard, wandb_project=config.metrics.wandb_project,
            console=metrics_lib.Console(enabled=not quiet and jax.process_index() == 0,
                                        progress={"auto": None, "on": True, "off": False}[config.metrics.progress])),
        tokenizer=tokenizer, template=build.build_template(config), mesh=mesh,
        model_config=model_config, environments=environments, sampler=sampler, servers=servers,
        buffer=replay.ReplayBuffer(capacity_tokens=build.replay_capacity_tokens(config)),
        checkpointer=checkpointer, objective=objective,
        postprocess=rollout.PostprocessSettings(
            shaping=build.build_reward_shaping(config, reward_fn), advantage_fn=build.build_advantage_fn(config),
            drop_zero_advantage_groups=r.drop_zero_advantage_groups,
            max_staleness=r.max_staleness if r.schedule == "async" else None, stale_policy=r.stale_policy,
            distill_only_envs=build.distill_envs(config), distill=config.rl.distill_coef > 0),
        eval_spec=evaluation.EvalSpec(evals, config.eval.tasks_per_difficulty, config.eval.pass_k),
        train_levels=train, sft_levels=sft, resume=resume, skipped_checkpoints=skipped_checkpoints,
        # Wall time of the run so far: this process since it started building, plus what earlier
        # segments of a resumed run recorded in their last checkpoint.
        started=started - (resume.elapsed_seconds if resume is not None else 0.0),
        rng=np.random.RandomState(config.seed + 7919 * jax.process_index()), params=params,  # per process
        invariant_settings=build.invariant_settings(config))
