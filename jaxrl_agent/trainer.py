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
import time
from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl_agent import (build, checkpoint, heap, invariants, learner, losses, models, replay, rewards, rollout, run_schedule,
                         sharding)
from jaxrl_agent import metrics as metrics_lib
from jaxrl_agent.run import Run, RunStopped, build_run  # noqa: F401 - the run's parts; RunStopped for callers
from jaxrl_agent.shape_reuse import ShapeReuse

# Demonstration tasks use their own seed range: disjoint from RL's task stream (0, 1, ...) and from
# the held-out evaluation seeds (envs.HELD_OUT_SEED_OFFSET + i).
DEMONSTRATION_SEED_OFFSET = 2_000_000

STOP_REASONS = run_schedule.STOP_REASONS
stop_reason = run_schedule.stop_reason
_every = run_schedule.every


# ------------------------------------------------------------------------------------------- SFT
def run_sft(run: Run) -> None:
    """Cold start: masked cross-entropy on scripted-expert episodes, rendered as sampled ones are."""
    config, c = run.config, run.config.sft
    if c.steps <= 0 or run.resume is not None:
        return
    state, step_fn = build.build_learner(config, run.model_config, run.mesh, run.params, sft=True)
    row_multiple = learner.row_multiple_for(run.mesh, config.learner.row_multiple,
                                            microbatches=build.sft_microbatches(config))
    # With several processes each draws its own demonstrations (its own seed range).
    demonstrations = build.build_demonstrations(config, run.environments, run.sft_levels, run.tokenizer, run.template,
                                                first_seed=DEMONSTRATION_SEED_OFFSET + jax.process_index() * 10_000_000)
    if demonstrations.info is not None:
        run.log("data", 0, demonstrations.info)
    local_multiple = learner.local_row_multiple(row_multiple)
    batches = build.build_sft_batches(config, demonstrations, run.rng, local_multiple)
    if batches.rows is not None:
        run.log("data", 0, {"sft_rows_per_update": batches.rows})
    start = time.perf_counter()
    run.writer.console.bar("sft", c.steps, unit="step")
    for step in range(1, c.steps + 1):
        fitting = batches.next()  # skipped (batches.skipped): demonstrations longer than a learner row
        batch, _ = replay.pack(fitting, config.learner.row_length, row_multiple=local_multiple,
                               min_rows=batches.rows or 1, decreasing=batches.rows is None,
                               target_multiple=config.learner.target_multiple)
        state, metrics = step_fn(state, learner.global_batch(batch, run.mesh))
        postfix = None
        if _every(c.log_every, step) or step == c.steps:
            metrics = jax.device_get(metrics)
            run.log("sft", step, {"loss": metrics["loss"], "entropy": metrics["entropy"],
                                  "grad_norm": metrics["grad_norm"], "skipped_demonstrations": batches.skipped,
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
    # The drift measurement's log-probs before the update come from the first step's forward pass
    # (or, under the decoupled correction, from its proximal pass).
    step_logprobs = config.invariants.drift_every > 0 and not run.objective.needs_proximal
    state, step_fn = build.build_learner(config, run.model_config, run.mesh, run.params, objective=run.objective,
                                         ref_params=reference, teacher_params=teacher, token_logprobs=step_logprobs)
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
    shapes = ShapeReuse(config.learner.shape_reuse_calls)  # the RL step's compiled batch shapes
    durations: list[float] = []  # RL iterations' wall time, evaluations and checkpoints included
    run.writer.console.bar("rl", c.iterations, initial=first_iteration - 1)
    heap.freeze_built()  # the learner and rollout parts just built: out of every later collection
    try:
        for iteration in range(first_iteration, c.iterations + 1):
            iteration_started = time.monotonic()
            state = rl_iteration(run, source, iteration, state, step_fn, proximal, logprobs_fn, step_logprobs,
                                 shapes=shapes)
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
                 logprobs_fn=None, step_logprobs: bool = False, shapes: ShapeReuse | None = None):
    """Source -> post-processing -> replay -> learner -> metrics -> new weights. `step_logprobs`:
    `step_fn` returns its starting log-probs (`build_learner(token_logprobs=True)`). `shapes`: the
    step's compiled batch shapes, kept across iterations (`learner.global_batch`)."""
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
        row_multiple=learner.row_multiple_for(run.mesh, config.learner.row_multiple, config.rl.row_multiple,
                                              microbatches=config.learner.microbatches),
        target_multiple=config.learner.target_multiple, mesh=run.mesh, proximal_logprobs=proximal,
        **({"logprobs_fn": logprobs_fn, "current_version": run.version}
           if _every(config.invariants.drift_every, iteration) else {}),
        loss_controls=(run.invariants.controls.entropy_coef, float(run.invariants.controls.icepop), 0.0)
        if run.invariant_settings.respond else None, summary_weight=config.learner.summary_weight,
        distill_envs=run.postprocess.distill_only_envs, step_logprobs=step_logprobs, shapes=shapes)
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
        distill_only_envs=run.postprocess.distill_only_envs,
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
                             "environments": ",".join(run.environments.environments),
                             "env_service": run.environments.service_name + (" (auto)" if config.env.service == "auto"
                                                                             else ""), **history,
                             **build.decode_options_record(run.sampler)},
                global_step=0 if run.resume is None else config.sft.steps + run.resume.iteration)
        if history_note:
            run.writer.say(history_note)
        for step, reason in run.skipped_checkpoints:
            run.log("checkpoint_skipped", step - config.sft.steps, {"checkpoint_step": step, "error": reason},
                    global_step=step, console=f"warning: checkpoint step {step} does not restore ({reason}); resuming "
                                              f"from the newest one that does"
                                              f"{' (step ' + str(run.checkpointer.step) + ')' if run.resume else ''}")
        if run.resume is None and run_schedule.evaluates_initial(config):
            run.log("initial_eval", 0, run.evaluate())
        with heap.frozen_heap():
            run_sft(run)
            run_rl(run)
        summary = summarize(run.writer.read()) if run.writer.active else {}
        if summary:
            run.log("summary", run.version, summary, global_step=run.global_step, console=(
                f"held-out success (greedy pass@1, levels {config.env.train_difficulties}): after SFT "
                f"{summary['after_sft/success']:.3f} -> final {summary['final/success']:.3f} "
                f"({summary['gain_points']:+.1f} points"
                + (f"; +15 after {summary['seconds_to_15_points'] / 60:.1f} min" if "seconds_to_15_points" in summary
                   else "") + ")"))
    finally:
        run.close()
    return run.writer.path
