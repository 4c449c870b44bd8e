"""Wiring only: config -> parts -> SFT cold start -> RL iterations. No part of the loop lives here.

The data path of one RL iteration, one downward pass:

  rollout.RolloutSource.next_groups()     tasks -> submitted groups, held in the replay buffer
                                          (replay.ReplayBuffer: finished and suspended episodes, a
                                          token capacity) -> the schedule's trainable groups
  rewards.judge_groups()                  the rubric judge's component (when reward.judge is set)
  rollout.postprocess.postprocess()       reward shaping -> staleness -> advantages -> zero-signal filter
  replay.ReplayBuffer.admit()             validation (rejections counted by reason)
  learner.rl_update()                     packed minibatches -> train_step (proximal log-probs first
                                          for the decoupled correction)
  metrics.iteration_record() -> MetricsWriter
  sampler.update_weights()                the new policy version for the next samples

Everything the config chooses is built in `build` (`validate_config` first, before any model);
`checkpoint` holds the run state, `evaluation` the held-out evaluation on the rollout path.
RL ends after `rl.iterations`, or earlier once `rl.stop_after_trained_tokens` tokens were trained,
or at the last iteration boundary that keeps the run within `rl.time_budget_minutes` of wall time
(counted across resumed segments; the final checkpoint and evaluation included).

`train_and_evaluate(config, workdir, objective=..., reward_fn=...)` is importable from a notebook;
`launch/tpu_run.py` calls it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agent import (build, checkpoint, evaluation, invariants, learner, losses, models, replay, rewards, rollout,
                         run_schedule, sharding)
from jaxrl_agent import metrics as metrics_lib
from jaxrl_agent import tokenizer as tokenizer_lib

# Demonstration tasks use their own seed range: disjoint from RL's task stream (0, 1, ...) and from
# the held-out evaluation seeds (envs.HELD_OUT_SEED_OFFSET + i).
DEMONSTRATION_SEED_OFFSET = 2_000_000


class RunStopped(RuntimeError):
    """The run stopped itself, cleanly, for the reason given (its records and last good checkpoint
    are kept): a run of non-finite updates, a checkpoint that could not be written."""


STOP_REASONS = run_schedule.STOP_REASONS
stop_reason = run_schedule.stop_reason
_every = run_schedule.every

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
            max_staleness=r.max_staleness if r.schedule == "async" else None, stale_policy=r.stale_policy),
        eval_spec=evaluation.EvalSpec(evals, config.eval.tasks_per_difficulty, config.eval.pass_k),
        train_levels=train, sft_levels=sft, resume=resume, skipped_checkpoints=skipped_checkpoints,
        # Wall time of the run so far: this process since it started building, plus what earlier
        # segments of a resumed run recorded in their last checkpoint.
        started=started - (resume.elapsed_seconds if resume is not None else 0.0),
        rng=np.random.RandomState(config.seed + 7919 * jax.process_index()), params=params,  # per process
        invariant_settings=build.invariant_settings(config))


# ------------------------------------------------------------------------------------------- SFT
def run_sft(run: Run) -> None:
    """Cold start: masked cross-entropy on scripted-expert episodes, rendered as sampled ones are."""
    config, c = run.config, run.config.sft
    if c.steps <= 0 or run.resume is not None:
        return
    state, step_fn = build.build_learner(config, run.model_config, run.mesh, run.params, sft=True)
    row_multiple = learner.row_multiple_for(run.mesh, config.learner.row_multiple)
    # With several processes each draws its own demonstrations (its own seed range).
    demonstrations = build.build_demonstrations(config, run.environments, run.sft_levels, run.tokenizer, run.template,
                                                first_seed=DEMONSTRATION_SEED_OFFSET + jax.process_index() * 10_000_000)
    if demonstrations.info is not None:
        run.log("data", 0, demonstrations.info)
    skipped, start = 0, time.perf_counter()
    run.writer.console.bar("sft", c.steps, unit="step")
    for step in range(1, c.steps + 1):
        trajectories = demonstrations.sample(run.rng, sharding.process_share(c.batch_size))  # this process's part
        # Demonstrations longer than a learner row cannot be trained on: skip them, counted.
        fitting = [t for t in trajectories if t.longest_segment <= config.learner.row_length]
        skipped += len(trajectories) - len(fitting)
        batch, _ = replay.pack(fitting, config.learner.row_length, row_multiple=learner.local_row_multiple(row_multiple),
                               target_multiple=config.learner.target_multiple)
        state, metrics = step_fn(state, learner.global_batch(batch, run.mesh))
        postfix = None
        if _every(c.log_every, step) or step == c.steps:
            metrics = jax.device_get(metrics)
            run.log("sft", step, {"loss": metrics["loss"], "entropy": metrics["entropy"],
                                  "grad_norm": metrics["grad_norm"], "skipped_demonstrations": skipped,
                                  "seconds": time.perf_counter() - start})
            postfix = {"loss": float(metrics["loss"])}
        run.writer.console.advance(1, postfix)
        if _every(c.eval_every, step) and step != c.steps:
            run.sampler.update_weights(state.params, run.version)
            run.log("sft_eval", step, run.evaluate())
    run.push_weights(state.params)
    run.start_subagents()  # 'initial' sub-agents: the SFT policy, frozen (its evaluation below delegates)
    run.save("sft_done", 0, state, None)
    run.log("sft_eval", c.steps, run.evaluate())
    run.writer.console.close()


# -------------------------------------------------------------------------------------------- RL
def run_rl(run: Run) -> None:
    config, c, r = run.config, run.config.rl, run.config.rollout
    if c.iterations <= 0:
        return
    resume = run.resume
    if resume is not None and resume.stage != "rl":
        # The latest checkpoint is the one after SFT: start RL fresh from its weights.
        run.params = run.checkpointer.restore_params(run.params)
        run.version = resume.version
        checkpoint.set_rng_state(run.rng, resume.rng)
        run.buffer.load_state_dict(resume.replay)
        run.sampler.update_weights(run.params, run.version)
    run.start_subagents()  # a resumed RL stage restores their checkpointed weights below
    reference = build.build_reference(config, run.mesh, run.params) if run.objective.needs_reference else None
    teacher = build.build_teacher(config, run.mesh, run.params) if run.objective.needs_teacher else None
    if config.reward.judge == "policy":
        # A frozen judge: its own copy of the weights RL starts from (the learner's are donated at
        # every step); a resumed run restores the copy from its checkpoint below.
        run.judge_params = jax.tree.map(jnp.copy, run.params)
    state, step_fn = build.build_learner(config, run.model_config, run.mesh, run.params, objective=run.objective,
                                         ref_params=reference, teacher_params=teacher)
    logprobs_fn = learner.make_proximal_logprobs(run.model_config, run.mesh, temperature=r.temperature,
                                                 logits_chunk=config.learner.logits_chunk) \
        if run.objective.needs_proximal or config.invariants.drift_every > 0 else None
    proximal = logprobs_fn if run.objective.needs_proximal else None
    source = build.build_rollout_source(config, run.sampler, run.environments, run.tokenizer, run.template,
                                        run.episode_settings(r.temperature), run.train_levels, buffer=run.buffer)
    if config.data.tasks != "procedural":
        run.log("data", 0, {"tasks": config.data.tasks, "task_records": source.tasks.size,
                            "skipped_records": dict(source.tasks.skipped)}, global_step=config.sft.steps)
    run.invariants = invariants.MonitorState.initial(run.invariant_settings)
    first_iteration = 1
    if resume is not None:
        if resume.stage == "rl":
            state = _restore_rl(run, source, state, resume)
            first_iteration = resume.iteration + 1
        run.log("resume", first_iteration - 1, {"from_stage": resume.stage, "version": run.version})
    if config.reward.judge and run.judge is None:
        run.judge = build.build_judge(config, run.model_config, run.judge_params, run.tokenizer, run.template)
    durations: list[float] = []  # RL iterations' wall time, evaluations and checkpoints included
    run.writer.console.bar("rl", c.iterations, initial=first_iteration - 1)
    try:
        for iteration in range(first_iteration, c.iterations + 1):
            iteration_started = time.monotonic()
            state = rl_iteration(run, source, iteration, state, step_fn, proximal, logprobs_fn)
            durations.append(time.monotonic() - iteration_started)
            reason = stop_reason(c, iteration, trained_tokens_total=run.trained_tokens_total,
                                 elapsed_seconds=run.elapsed_seconds(), durations=durations,
                                 last_eval_seconds=run.last_eval_seconds)
            # Every process stops at the same iteration (the first reason any of them has), or the
            # others would wait in the next step's collectives for one that has left.
            reason = STOP_REASONS[int(sharding.agree_max([STOP_REASONS.index(reason)])[0])]
            if reason is not None:
                # End as a finished run does: a checkpoint and an evaluation of this iteration
                # (unless the iteration's schedule already made them).
                if not _every(config.checkpoint.every, iteration) and iteration != c.iterations:
                    run.save("rl", iteration, state, source)
                if not _every(config.eval.every, iteration) and iteration != c.iterations:
                    run.log("rl_eval", iteration, run.evaluate())
                run.log("rl_end", iteration, {"reason": reason, "iterations": iteration,
                                              "elapsed_seconds": run.elapsed_seconds()})
                break
    finally:
        run.writer.console.close()
        source.runner.close()


def _restore_rl(run: Run, source: rollout.source.RolloutSource, state, resume: checkpoint.RunState):
    """Continues an RL stage from its checkpoint: the learner state (and frozen judge), the run's
    counters and RNG, the task source, the invariants' state; then the sampler gets the restored
    weights, and only then the replay buffer's groups continue (finished episodes kept, suspended
    ones from their tokens, on the weights they will be trained against). Returns the state."""
    state, frozen = checkpoint.restore_learner(run.checkpointer, state, run.frozen_arrays())
    run.judge_params = frozen.get("judge_params")
    if frozen.get("subagent_params") is not None:  # the sub-agents the stage started with
        run.subagent_params = frozen["subagent_params"]
        run.subagent_sampler.update_weights(run.subagent_params, 0)
    run.params, run.version = state.params, resume.version
    run.trained_tokens_total = resume.trained_tokens_total
    checkpoint.set_rng_state(run.rng, resume.rng)
    source.load_state_dict(resume.source)
    run.invariants = invariants.MonitorState.from_dict(resume.invariants, run.invariant_settings)
    if run.invariant_settings.respond:
        _steer(run, source)
    run.sampler.update_weights(run.params, run.version)
    source.runner.restore_pending(resume.replay, legacy_pending=resume.source.get("pending"))
    return state


def rl_iteration(run: Run, source: rollout.source.RolloutSource, iteration: int, state, step_fn, proximal,
                 logprobs_fn=None):
    """Source -> post-processing -> replay -> learner -> metrics -> new weights."""
    config = run.config
    started = time.perf_counter()
    sampler_before = run.sampler_stats()
    groups = source.next_groups()
    sample_seconds = time.perf_counter() - started
    if config.metrics.episodes_log:
        run.writer.write_episodes(iteration, groups)
    judge_metrics = {}
    if run.judge is not None:
        groups, judge_metrics = rewards.judge_groups(run.judge, groups, run.tokenizer.decode,
                                                     length_bias_threshold=config.reward.length_bias_threshold)
        if judge_metrics.get("judge/length_bias_warning"):
            run.writer.say(f"warning: judge scores correlate with length ({judge_metrics['judge/length_bias']:.2f} > "
                           f"reward.length_bias_threshold={config.reward.length_bias_threshold})")
    processed = rollout.postprocess.postprocess(groups, run.postprocess, iteration=iteration,
                                                current_version=run.version)
    source.observe(processed.shaped_groups, processed.metrics["nonzero_advantage_group_share"]
                   if processed.groups else None)
    batch = run.buffer.admit(processed.trainable, vocab_size=run.model_config.vocab_size,
                             max_length=config.learner.row_length, current_version=run.version)
    learn_started = time.perf_counter()
    trained_version = run.version
    state, learner_metrics = learner.rl_update(
        state, step_fn, batch, rng=run.rng, minibatches=config.rl.minibatches, row_length=config.learner.row_length,
        row_multiple=learner.row_multiple_for(run.mesh, config.learner.row_multiple, config.rl.row_multiple),
        target_multiple=config.learner.target_multiple, mesh=run.mesh, proximal_logprobs=proximal,
        **({"logprobs_fn": logprobs_fn, "current_version": run.version}
           if _every(config.invariants.drift_every, iteration) else {}),
        loss_controls=(run.invariants.controls.entropy_coef, float(run.invariants.controls.icepop), 0.0)
        if run.invariant_settings.respond else None, summary_weight=config.learner.summary_weight)
    run.consecutive_skips = learner.consecutive_skips(run.consecutive_skips,
                                                      learner_metrics.pop("update_skipped_flags", []))
    if learner_metrics:  # an update was made (by every process: with several, some may have had no rows)
        run.push_weights(state.params)
    learn_seconds = time.perf_counter() - learn_started
    suspended = source.runner.clock.suspended  # episodes that spent this iteration's token budget
    source.runner.next_iteration()  # suspended partial rollouts resume, on the new weights
    source_stats = source.iteration_stats(groups, suspended=suspended,
                                          with_task_ids=config.data.tasks != "procedural")
    trained_tokens = int(sum(int(t.loss_mask.sum()) for t in batch))
    run.trained_tokens_total += trained_tokens
    iteration_seconds = time.perf_counter() - started
    record = metrics_lib.iteration_record(
        groups=processed.shaped_groups, trained=batch, signal=processed.metrics, learner_metrics=learner_metrics,
        sampler=metrics_lib.records.sampler_delta(sampler_before, run.sampler_stats()),
        group_size=config.rollout.group_size, decode=run.tokenizer.decode, trained_version=trained_version,
        extra={
            **source_stats, "version": run.version, "learner_step": int(state.step),
            "trained_tokens_total": run.trained_tokens_total,
            "sample_seconds": sample_seconds,  # the learner's idle time: waiting for rollouts
            "learn_seconds": learn_seconds,
            "effective_samples_per_second": len(batch) / iteration_seconds,
            "trained_tokens_per_second": trained_tokens / iteration_seconds,
            **({"sampler_server_restarts": run.servers.restarts} if run.servers is not None else {}),
            **({"sampler_rejoined": run.sampler.stats["rejoined"]} if config.sampler.addresses else {}),
            **judge_metrics,
            **run.environments.stats(),
            **(metrics_lib.records.delegation_metrics([t for g in groups for t in g])
               if run.subagent_sampler is not None else {}),
        })
    # With several processes, the job's numbers (every process gets the same record back).
    record = metrics_lib.job_record(record, keep=tuple(learner_metrics))
    outcome = invariants.monitor.step(run.invariant_settings, run.invariants, record,
                                      num_levels=min(len(v) for v in run.train_levels.values()))
    for warning in outcome.warnings:
        run.writer.say(warning)
    record.update(outcome.metrics)
    run.invariants = outcome.state
    if run.invariant_settings.respond:
        _steer(run, source)
    eta = run_schedule.eta_seconds(config.rl, iteration, iteration_seconds, run.elapsed_seconds())
    run.log("rl", iteration, record, console=metrics_lib.console_line(
        iteration, config.rl.iterations, record, seconds=iteration_seconds, eta_seconds=eta) + f" | {outcome.state_line}")
    for event in outcome.events:
        run.log(event.stage, iteration, event.record, console=event.console)
    run.writer.console.advance(1, {"success": record["success"], "reward": record["reward"],
                                   "tok/s": round(record["trained_tokens_per_second"]),
                                   "budget_eta": f"{eta / 60:.1f}min"})
    message = learner.skip_stop_message(run.consecutive_skips, config.learner.max_consecutive_skips, iteration)
    if message is not None:
        run.log("rl_end", iteration, {"reason": "non_finite_updates", "iterations": iteration,
                                      "elapsed_seconds": run.elapsed_seconds()}, console=f"error: {message}")
        raise RunStopped(message)
    if _every(config.checkpoint.every, iteration) or iteration == config.rl.iterations:
        run.save("rl", iteration, state, source)
    if _every(config.eval.every, iteration) or iteration == config.rl.iterations:
        run.log("rl_eval", iteration, run.evaluate())
    return state


def _steer(run: Run, source) -> None:
    """Puts the responses' controls into the parts they steer: the source's submission (dynamic
    sampling, training levels) and the async staleness bound. The learner's (entropy bonus,
    IcePop) travel with each batch."""
    controls = run.invariants.controls
    source.apply_controls(controls, run.train_levels)
    if run.postprocess.max_staleness is not None:
        run.postprocess = dataclasses.replace(run.postprocess, max_staleness=controls.max_staleness)


summarize = metrics_lib.summarize


def train_and_evaluate(config, workdir: str | None = None, *, quiet: bool = False,
                       objective: losses.Objective | None = None, reward_fn: Callable | None = None) -> str:
    """Runs SFT then RL as configured (a stage list, `config.stages`: each stage so, in order,
    `stages.run_stages`); returns the path of the metrics file.

    objective: a `losses.Objective` to train with instead of the config's (`rl.objective*`).
    reward_fn: `fn(trajectory) -> float | {name: float}` instead of `reward.fn` (see RewardShaping).
    """
    workdir = workdir or config.workdir
    if str(config.stages).strip():  # a stage list: each stage is one such run
        from jaxrl_agent import stages

        return stages.run_stages(config, workdir, quiet=quiet, objective=objective, reward_fn=reward_fn)
    run = build_run(config, workdir, quiet=quiet, objective=objective, reward_fn=reward_fn)
    try:
        run.writer.write_config(config)
        history, history_note = build.template_history(config, run.template)
        run.log("start", 0, {"params": models.count_params(run.params), "devices": jax.device_count(),
                             "processes": jax.process_count(), "objective": run.objective.name,
                             "environments": ",".join(run.environments.environments), **history},
                global_step=0 if run.resume is None else config.sft.steps + run.resume.iteration)
        if history_note:
            run.writer.say(history_note)
        for step, reason in run.skipped_checkpoints:
            run.log("checkpoint_skipped", step - config.sft.steps, {"checkpoint_step": step, "error": reason},
                    global_step=step, console=f"warning: checkpoint step {step} does not restore ({reason}); resuming "
                                              f"from the newest one that does"
                                              f"{' (step ' + str(run.checkpointer.step) + ')' if run.resume else ''}")
        if run.resume is None:
            run.log("initial_eval", 0, run.evaluate())
        run_sft(run)
        run_rl(run)
        summary = summarize(run.writer.read()) if run.writer.active else {}
        if summary:
            run.log("summary", run.version, summary, global_step=run.global_step, console=(
                f"held-out success (greedy pass@1, levels {config.env.train_difficulties}): after SFT "
                f"{summary['after_sft/success']:.3f} -> final {summary['final/success']:.3f} "
                f"({summary['gain_points']:+.1f} points)"))
    finally:
        run.close()
    return run.writer.path
