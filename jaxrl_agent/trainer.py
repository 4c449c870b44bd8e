"""Wires the closed loop from a config: SFT cold start on scripted-expert data, then RL.

RL iteration (synchronous schedule, on-policy):
  1. push the learner's weights to the sampler (tagged with the policy version);
  2. sample G episodes for each of P tasks (coroutines over the environment and the sampler);
  3. group advantages; drop groups whose rewards are all equal (they carry no gradient);
  4. validate into the replay buffer, pack into [B, T] rows, and run `minibatches` updates of the
     objective (default: token-level mirror descent + token clipping + TIS);
  5. log metrics; evaluate greedy pass@1 on held-out tasks every `eval.every` iterations;
     checkpoint every `checkpoint.every` iterations and at the end.
RL ends after `rl.iterations`, or earlier once `rl.stop_after_trained_tokens` tokens were trained,
or at the last iteration boundary that keeps the run within `rl.time_budget_minutes` of wall time
(counted across resumed segments; the final checkpoint and evaluation included).
`train_and_evaluate(config, workdir)` is importable from a notebook; `launch/tpu_run.py` calls it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agent import build, envs, learner, losses, replay, rollout
from jaxrl_agent import metrics as metrics_lib
from jaxrl_agent import rewards as rewards_lib
from jaxrl_agent import tokenizer as tokenizer_lib
from jaxrl_agent.sampling import LocalSampler, SamplingParams


class MetricsWriter:
    """Every record goes to a console line, to workdir/metrics.jsonl (one JSON object per record,
    with `stage`, `step` and `time`) and, when enabled, to TensorBoard event files under
    workdir/tensorboard as scalars tagged `<stage>/<key>` (nested dicts flattened with `/`)."""

    def __init__(self, workdir: str, quiet: bool = False, tensorboard: bool = False):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.quiet = quiet
        self._tb = None
        if tensorboard:
            # TensorBoard's own event writer and protos: no TensorFlow session or device involved.
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self._pb = (event_pb2, summary_pb2)
            self._tb = EventFileWriter(os.path.join(workdir, "tensorboard"))

    def write(self, stage: str, step: int, metrics: dict[str, Any]) -> None:
        record = {"stage": stage, "step": step, "time": time.time(),
                  **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            event_pb2, summary_pb2 = self._pb
            values = [summary_pb2.Summary.Value(tag=f"{stage}/{key}", simple_value=value)
                      for key, value in _flatten(metrics).items()]
            self._tb.add_event(event_pb2.Event(wall_time=record["time"], step=int(step),
                                               summary=summary_pb2.Summary(value=values)))
            self._tb.flush()
        if not self.quiet:
            shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
                             if k not in ("stage", "step", "time") and not isinstance(v, (list, dict)))
            print(f"[{stage} {step}] {shown}", flush=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested dicts as {'a/b': value}; strings and lists are left out."""
    out = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "/"))
        elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


class Checkpointer:
    """Orbax checkpoints of the learner state plus a JSON record of everything else a run needs to
    continue the same schedule: stage, iteration, policy version, task-stream position, RNG state
    and the replay buffer."""

    def __init__(self, directory: str, keep: int):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.manager = ocp.CheckpointManager(
            os.path.abspath(directory), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def save(self, step: int, state, meta: dict) -> None:
        ocp = self._ocp
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)
        self.manager.wait_until_finished()

    def latest_meta(self) -> dict | None:
        step = self.manager.latest_step()
        if step is None:
            return None
        ocp = self._ocp
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore_state(self, target):
        ocp = self._ocp
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        step = self.manager.latest_step()
        return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]

    def close(self) -> None:
        self.manager.close()


def _plain(value):
    """JSON-able: numbers as float, containers as they are."""
    if isinstance(value, (dict, list, tuple, str)):
        return value
    return float(value)


# Demonstration tasks use their own seed range: disjoint from RL's task stream (0, 1, ...) and from
# the held-out evaluation seeds (envs.HELD_OUT_SEED_OFFSET + i).
DEMONSTRATION_SEED_OFFSET = 2_000_000


def _every(period: int, iteration: int) -> bool:
    """Whether a periodic action (`eval.every`, `checkpoint.every`, `sft.log_every`, ...) falls on
    `iteration`; a period of 0 means never periodically (the run still logs, evaluates and
    checkpoints at its end)."""
    return period > 0 and iteration % period == 0


def _success(trajectory) -> float:
    return float(trajectory.reward_components.get("success", 0.0))


def _actions(trajectory, tokenizer) -> list[str]:
    """The text of each assistant turn (contiguous sampled spans), end markers included."""
    mask = np.asarray(trajectory.loss_mask)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [tokenizer.decode(trajectory.tokens[a:b]) for a, b in zip(edges[::2], edges[1::2])]


def _difficulties(value) -> tuple[int, ...]:
    return tuple(int(d) for d in (value.split(",") if isinstance(value, str) else value))


def _to_device(batch: learner.PackedBatch, mesh) -> learner.PackedBatch:
    from jaxrl_agent import sharding

    return jax.device_put(batch, sharding.batch_sharding(mesh))


class Trainer:
    """The pieces of a run, built once from the config."""

    def __init__(self, config, workdir: str, *, quiet: bool = False):
        building = time.monotonic()  # the run's clock starts here (sampler servers start below)
        self.config = config
        self.workdir = workdir
        self.writer = MetricsWriter(workdir, quiet=quiet, tensorboard=config.metrics.tensorboard)
        self.tokenizer = build.build_tokenizer(config)
        self.template = tokenizer_lib.make_template(config.tokenizer.template)
        self.mesh = build.build_mesh(config)
        # Learner rows are split over ('data', 'fsdp'): their count must divide evenly.
        self.row_multiple = math.lcm(config.learner.row_multiple, self.mesh.shape["data"] * self.mesh.shape["fsdp"])
        self.model_config, params = build.build_model(config, self.mesh)
        self.env = envs.make(config.env.name)
        # Environment steps run on these threads (a slow tool must not stall the event loop).
        self.env_threads = concurrent.futures.ThreadPoolExecutor(config.env.step_threads, "env-step")
        self.expert = envs.expert_policy(config.env.name)
        self.train_difficulties = _difficulties(config.env.train_difficulties)
        self.sft_difficulties = _difficulties(config.sft.difficulties or config.env.train_difficulties)
        self.eval_difficulties = _difficulties(config.env.eval_difficulties)
        if config.rollout.max_context > config.learner.row_length:
            raise ValueError(f"rollout.max_context={config.rollout.max_context} exceeds learner.row_length="
                             f"{config.learner.row_length}: episodes that long could never be trained on")
        if config.learner.logits_chunk < 0:
            raise ValueError(f"learner.logits_chunk={config.learner.logits_chunk}: expected >= 0 (0 = whole rows)")
        if config.learner.target_multiple < 0:
            raise ValueError(f"learner.target_multiple={config.learner.target_multiple}: expected >= 0 "
                             "(0 = logits at every position)")
        for name in ("eval.every", "checkpoint.every", "sft.eval_every", "sft.log_every"):
            section, field = name.split(".")
            if config[section][field] < 0:
                raise ValueError(f"{name}={config[section][field]}: expected >= 0 (0 = only at the end)")
        if config.sampler.pipeline_depth < 1:
            raise ValueError(f"sampler.pipeline_depth={config.sampler.pipeline_depth}: expected >= 1 "
                             "(generate calls a sampler server dispatches ahead of its detokenize thread)")
        if config.rl.time_budget_minutes < 0:
            raise ValueError(f"rl.time_budget_minutes={config.rl.time_budget_minutes}: expected >= 0 (0 = no limit)")
        self.servers = None
        if config.sampler.num_servers > 0:
            # JetStream server processes; the learner pushes weights to them over gRPC.
            self.servers = build.SamplerServers(config, config.sampler.num_servers, workdir)
            self.sampler = self.servers.client
            self.sampler.update_weights(params, 0)
        else:
            self.engine = build.build_engine(config, self.model_config, params, self.tokenizer)
            self.sampler = LocalSampler(self.engine)
        self.buffer = replay.ReplayBuffer(vocab_size=self.model_config.vocab_size,
                                          max_length=config.learner.row_length)
        self.rng = np.random.RandomState(config.seed)
        self.params = params
        self.version = 0
        self.task_seed = 0
        self.sft_skipped = 0
        self.trained_tokens_total = 0
        self.runner = None
        self.allocator = self._make_allocator()
        self.nonzero_share = 1.0  # running share of groups with signal (DAPO over-sampling)
        self.checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), config.checkpoint.keep)
        self.resume_meta = self.checkpointer.latest_meta() if config.resume else None
        # Wall time of the run so far: this process since it started building, plus what earlier
        # segments of a resumed run recorded in their last checkpoint.
        self.started = building - (float(self.resume_meta.get("elapsed_seconds", 0.0))
                                   if self.resume_meta is not None else 0.0)
        self.last_eval_seconds = 0.0

    # ---------------------------------------------------------------- helpers
    def _make_allocator(self):
        """The RL task pool and its allocation rule (`config.allocation`); None = a fresh task per group."""
        a, r = self.config.allocation, self.config.rollout
        if a.task_pool <= 0:
            if a.strategy != "uniform":
                raise ValueError(f"allocation.strategy={a.strategy!r} needs a revisited task pool: set "
                                 f"allocation.task_pool > 0 (got {a.task_pool})")
            return None
        if a.strategy == "until_mixed" and (r.schedule != "sync" or r.token_budget > 0):
            raise ValueError("allocation.strategy='until_mixed' samples in rounds within an iteration: it needs "
                             f"rollout.schedule='sync' and rollout.token_budget=0 (got {r.schedule!r}, {r.token_budget})")
        levels = self.train_difficulties
        pool = [self.env.sample_task(i, levels[i % len(levels)]) for i in range(a.task_pool)]
        return rollout.TaskAllocator(
            pool, a.strategy, r.group_size, candidates=a.candidates, max_group=a.max_group, decay=a.decay,
            min_group=max(2, r.group_size // 2) if a.strategy == "until_mixed" else None,
            retire_threshold=a.retire_threshold, retire_min_evidence=a.retire_min_evidence,
            revisit_prob=a.revisit_prob, seed=self.config.seed + 1)

    def _submit(self, num_groups: int) -> None:
        """Starts about `num_groups` groups' worth of rollouts: fresh tasks of group_size episodes,
        or the allocator's choice of pool tasks and group sizes for that budget."""
        if num_groups <= 0:
            return
        if self.allocator is None:
            self.runner.submit(self._tasks(num_groups))
        else:
            proposals = self.allocator.propose(num_groups)
            self.runner.submit([t for t, _ in proposals], [n for _, n in proposals])

    def _tasks(self, n: int, difficulties: tuple[int, ...] | None = None) -> list[envs.Task]:
        difficulties = difficulties or self.train_difficulties
        tasks = []
        for _ in range(n):
            difficulty = difficulties[self.rng.randint(len(difficulties))]
            tasks.append(self.env.sample_task(self.task_seed, difficulty))
            self.task_seed += 1
        return tasks

    def _episode_settings(self, temperature: float) -> rollout.EpisodeSettings:
        c = self.config.rollout
        return rollout.EpisodeSettings(
            sampling=SamplingParams(temperature=temperature, max_tokens=c.max_tokens_per_turn),
            max_context=c.max_context, include_system_prompt=c.include_system_prompt, max_turns=c.max_turns)

    def _make_env(self, task):
        env = envs.make(self.config.env.name)
        if self.config.env.tool_latency_s > 0:
            from jaxrl_agent.envs.testing import ToolLatency

            env = ToolLatency(env, self.config.env.tool_latency_s, alpha=self.config.env.tool_latency_alpha)
        return rollout.InProcessEnv(env, executor=self.env_threads)

    def elapsed_seconds(self) -> float:
        return time.monotonic() - self.started

    def _meta(self, stage: str, iteration: int) -> dict:
        kind, keys, pos, has_gauss, cached = self.rng.get_state()
        return {"stage": stage, "iteration": iteration, "version": self.version, "task_seed": self.task_seed,
                "elapsed_seconds": self.elapsed_seconds(),
                "trained_tokens_total": self.trained_tokens_total,
                "rng": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
                "replay": self.buffer.state_dict(), "nonzero_share": self.nonzero_share,
                "allocator": self.allocator.state_dict() if self.allocator is not None else None,
                "pending": self.runner.pending_state() if self.runner is not None else None}

    def _load_meta(self, meta: dict) -> None:
        self.version = int(meta["version"])
        self.task_seed = int(meta["task_seed"])
        self.trained_tokens_total = int(meta.get("trained_tokens_total", 0))
        kind, keys, pos, has_gauss, cached = meta["rng"]
        self.rng.set_state((kind, np.asarray(keys, np.uint32), pos, has_gauss, cached))
        self.buffer.load_state_dict(meta["replay"])
        self.nonzero_share = float(meta.get("nonzero_share", 1.0))
        if self.allocator is not None and meta.get("allocator"):
            self.allocator.load_state_dict(meta["allocator"])

    def _checkpoint(self, stage: str, iteration: int, state) -> None:
        self.checkpointer.save(self.config.sft.steps + iteration, {"params": state.params,
                                                                   "opt_state": state.opt_state,
                                                                   "step": state.step}, self._meta(stage, iteration))

    def _restore(self, state):
        restored = self.checkpointer.restore_state({"params": state.params, "opt_state": state.opt_state,
                                                    "step": state.step})
        self._load_meta(self.resume_meta)
        self.params = restored["params"]
        self.sampler.update_weights(self.params, self.version)
        return state.replace(params=restored["params"], opt_state=restored["opt_state"], step=restored["step"])

    def _sampler_stats(self) -> dict[str, float]:
        """The sampler's counters: the in-process sampler's own, or the servers' over `Info`."""
        try:
            return self.sampler.sampler_stats()
        except Exception as err:  # noqa: BLE001 - metrics must not stop the run (a server may be down)
            print(f"warning: sampler stats unavailable: {err}", flush=True)
            return {}

    def _push_weights(self, params) -> None:
        self.version += 1
        self.params = params
        self.sampler.update_weights(params, self.version)

    # ---------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, float]:
        c = self.config.eval
        started = time.monotonic()
        results = {}
        for d in self.eval_difficulties:
            tasks = [self.env.sample_task(envs.HELD_OUT_SEED_OFFSET + i, d) for i in range(c.tasks_per_difficulty)]
            groups = asyncio.run(rollout.collect_groups(
                self.sampler, self._make_env, tasks, 1, self.tokenizer, self.template,
                self._episode_settings(temperature=0.0), seed=10**6))
            results[f"eval/pass@1/d{d}"] = float(np.mean([_success(g[0]) for g in groups]))
            if c.pass_k > 1:
                # k samples per task at the training temperature: unbiased pass@1 and pass@k.
                groups = asyncio.run(rollout.collect_groups(
                    self.sampler, self._make_env, tasks, c.pass_k, self.tokenizer, self.template,
                    self._episode_settings(temperature=self.config.rollout.temperature), seed=2 * 10**6))
                successes = [[_success(t) > 0 for t in g] for g in groups]
                results[f"eval/sampled_pass@1/d{d}"] = metrics_lib.mean_pass_at_k(successes, 1)
                results[f"eval/pass@{c.pass_k}/d{d}"] = metrics_lib.mean_pass_at_k(successes, c.pass_k)
        trained = [results[f"eval/pass@1/d{d}"] for d in self.eval_difficulties if d in self.train_difficulties]
        # The headline number: greedy success on held-out tasks of the levels RL trains on.
        results["eval/success"] = float(np.mean(trained)) if trained else 0.0
        self.last_eval_seconds = time.monotonic() - started
        return results

    # ---------------------------------------------------------------- SFT
    def run_sft(self) -> None:
        c = self.config.sft
        if c.steps <= 0 or self.resume_meta is not None:
            return
        optimizer = learner.make_optimizer(learning_rate=c.learning_rate, warmup_steps=c.warmup_steps,
                                           total_steps=c.steps, grad_clip_norm=self.config.learner.grad_clip_norm)
        state = learner.init_state(self.params, optimizer, seed=self.config.seed)
        step_fn, _ = learner.jit_train_step(
            learner.make_train_step(self.model_config, optimizer, sft=True,
                                    microbatches=self.config.learner.microbatches,
                                    logits_chunk=self.config.learner.logits_chunk), state, self.mesh)
        start = time.perf_counter()
        demonstrate = lambda task: rollout.expert_trajectory(
            self.env, task, self.expert, self.tokenizer, self.template,
            include_system_prompt=self.config.rollout.include_system_prompt)
        # A finite set of demonstrations (sft.num_demonstrations > 0), revisited over epochs, or
        # fresh ones every step.
        pool = [demonstrate(self.env.sample_task(DEMONSTRATION_SEED_OFFSET + i,
                                                 self.sft_difficulties[i % len(self.sft_difficulties)]))
                for i in range(c.num_demonstrations)]
        for step in range(1, c.steps + 1):
            if pool:
                trajectories = [pool[i] for i in self.rng.randint(len(pool), size=c.batch_size)]
            else:
                trajectories = [demonstrate(task) for task in self._tasks(c.batch_size, self.sft_difficulties)]
            # Demonstrations longer than a learner row cannot be trained on: skip them, counted.
            fitting = [t for t in trajectories if t.length <= self.config.learner.row_length]
            self.sft_skipped += len(trajectories) - len(fitting)
            batch, _ = replay.pack(fitting, self.config.learner.row_length, row_multiple=self.row_multiple,
                                   target_multiple=self.config.learner.target_multiple)
            state, metrics = step_fn(state, _to_device(batch, self.mesh))
            if _every(c.log_every, step) or step == c.steps:
                metrics = jax.device_get(metrics)
                self.writer.write("sft", step, {"loss": metrics["loss"], "entropy": metrics["entropy"],
                                                "grad_norm": metrics["grad_norm"],
                                                "skipped_demonstrations": self.sft_skipped,
                                                "seconds": time.perf_counter() - start})
            if _every(c.eval_every, step) and step != c.steps:
                self.sampler.update_weights(state.params, self.version)
                self.writer.write("sft_eval", step, self.evaluate())
        self._push_weights(state.params)
        self._checkpoint("sft_done", 0, state)
        self.writer.write("sft_eval", c.steps, self.evaluate())

    # ---------------------------------------------------------------- RL
    def run_rl(self) -> None:
        c, r = self.config.rl, self.config.rollout
        if c.iterations <= 0:
            return
        updates = c.iterations * c.minibatches
        optimizer = learner.make_optimizer(learning_rate=c.learning_rate, warmup_steps=c.warmup_steps,
                                           total_steps=updates, grad_clip_norm=self.config.learner.grad_clip_norm)
        state = learner.init_state(self.params, optimizer, seed=self.config.seed)
        spec = losses.ObjectiveSpec(
            terms=(losses.PolicyTerm("mirror_descent", tau=c.tau, level="token", clip_eps_low=c.clip_eps,
                                     clip_eps_high=c.clip_eps),),
            corrections=(losses.TIS(cap=c.tis_cap),))
        step_fn, _ = learner.jit_train_step(
            learner.make_train_step(self.model_config, optimizer, objective=losses.make_objective(spec),
                                    microbatches=self.config.learner.microbatches, temperature=r.temperature,
                                    logits_chunk=self.config.learner.logits_chunk),
            state, self.mesh)
        first_iteration = 1
        if self.resume_meta is not None:
            # The latest checkpoint: after SFT (start RL fresh from those weights) or mid-RL.
            if self.resume_meta["stage"] == "rl":
                state = self._restore(state)
                first_iteration = int(self.resume_meta["iteration"]) + 1
            else:
                self._load_meta(self.resume_meta)
                params = self._restore_params_only(state.params)
                state = learner.init_state(params, optimizer, seed=self.config.seed)
                self.params = params
                self.sampler.update_weights(params, self.version)
            self.writer.write("resume", first_iteration - 1, {"from_stage": self.resume_meta["stage"],
                                                               "version": self.version})
        schedule = rollout.Schedule(mode=r.schedule, window=r.window, max_staleness=r.max_staleness,
                                    stale_policy=r.stale_policy, token_budget=r.token_budget,
                                    groups_in_flight=r.groups_in_flight)
        self.runner = rollout.RolloutRunner(self.sampler, self._make_env, self.tokenizer, self.template,
                                            self._episode_settings(r.temperature), r.group_size,
                                            token_budget=schedule.token_budget, seed=self.config.seed)
        if self.resume_meta is not None and self.resume_meta.get("pending"):
            self.runner.restore_pending(self.resume_meta["pending"])
        durations: list[float] = []  # RL iterations' wall time, evaluations and checkpoints included
        try:
            for iteration in range(first_iteration, c.iterations + 1):
                iteration_started = time.monotonic()
                state = self._rl_iteration(iteration, schedule, state, step_fn)
                durations.append(time.monotonic() - iteration_started)
                reason = None
                if c.stop_after_trained_tokens and self.trained_tokens_total >= c.stop_after_trained_tokens:
                    reason = "trained_tokens"
                elif iteration < c.iterations and not self._time_for_another_iteration(durations):
                    reason = "time_budget"
                if reason is not None:
                    # End as a finished run does: a checkpoint and an evaluation of this iteration
                    # (unless the iteration's schedule already made them).
                    if not _every(self.config.checkpoint.every, iteration) and iteration != c.iterations:
                        self._checkpoint("rl", iteration, state)
                    if not _every(self.config.eval.every, iteration) and iteration != c.iterations:
                        self.writer.write("rl_eval", iteration, self.evaluate())
                    self.writer.write("rl_end", iteration, {"reason": reason, "iterations": iteration,
                                                            "elapsed_seconds": self.elapsed_seconds()})
                    break
        finally:
            self.runner.close()
            self.runner = None

    def _time_for_another_iteration(self, durations: list[float]) -> bool:
        """Whether one more RL iteration, then the final checkpoint and evaluation, still fit in
        `rl.time_budget_minutes` (0 = always). The next iteration is estimated as the slowest of
        the last five (an evaluation or checkpoint may fall in it), the final evaluation as the
        last one's duration."""
        budget = 60.0 * self.config.rl.time_budget_minutes
        if budget <= 0:
            return True
        next_iteration = max(durations[-5:])
        return self.elapsed_seconds() + next_iteration + self.last_eval_seconds <= budget

    def _exploration_guards(self, record: dict) -> dict:
        """Flags exploration collapse: sampled-token entropy or distinct solutions per task below
        the configured floors (`exploration.*`); a console warning and `guard/*` = 1 in the record."""
        c = self.config.exploration
        flags = {}
        entropies = [v for k, v in record.items() if k.startswith("sampled_entropy/")]
        if entropies and min(entropies) < c.entropy_floor:
            flags["guard/entropy_collapse"] = 1.0
        if record["groups"] and record["distinct_solutions"] < c.distinct_solutions_floor:
            flags["guard/solution_collapse"] = 1.0
        for name in flags:
            print(f"warning: {name} (entropy {min(entropies) if entropies else float('nan'):.4f}, distinct "
                  f"solutions per task {record['distinct_solutions']:.2f})", flush=True)
        return flags

    def _select_groups(self, schedule) -> list[int]:
        """Submits groups as the schedule asks, waits for trainable ones, returns their indices."""
        r, runner = self.config.rollout, self.runner
        if schedule.mode == "sync":
            # A barrier: top up to P open groups (partial rollouts carried over count), then wait
            # until every episode has finished or spent this iteration's token budget.
            wanted = r.prompts_per_iteration
            if self.config.allocation.dynamic_sampling:
                # DAPO: over-sample so that about P groups survive the all-equal filter.
                wanted = rollout.allocation.dynamic_sampling_prompts(r.prompts_per_iteration, self.nonzero_share)
            self._submit(wanted - len(runner.unfinished()) - len(runner.finished()))
            runner.wait(runner.quiescent)
            return runner.finished()

        def selectable():
            finished, unfinished = runner.finished_unlocked(), runner.unfinished_unlocked()
            if schedule.mode == "windowed_fifo":
                return rollout.windowed_fifo_selectable(finished, unfinished, schedule.window)
            return finished

        # Train as soon as a batch's worth of groups is trainable (or nothing more can finish).
        self._top_up(schedule)
        while not runner.wait(lambda: len(selectable()) >= r.prompts_per_iteration or runner.quiescent(),
                              timeout=0.2):
            self._top_up(schedule)
        with runner.lock:
            return selectable()[: r.prompts_per_iteration]

    def _top_up(self, schedule) -> None:
        """Non-sync schedules: keeps P + ahead groups open (submitted, not yet taken by the learner)."""
        r, runner = self.config.rollout, self.runner
        ahead = schedule.groups_in_flight or r.prompts_per_iteration
        self._submit(r.prompts_per_iteration + ahead - len(runner.unfinished()) - len(runner.finished()))

    def _until_mixed_groups(self) -> list[list]:
        """Reinforce-Ada's sequential sampling under the iteration's budget of P x G rollouts.

        Round 1: min_group rollouts for each of P tasks. Each later round adds min_group rollouts
        to every task whose outcomes are still all equal (`allocation.until_mixed_done`, capped at
        allocation.max_group), and when none is left, starts fresh tasks, until the budget is spent.
        A task's rollouts from all rounds form one group.
        """
        r, runner, allocator = self.config.rollout, self.runner, self.allocator
        step, cap = allocator.min_group, max(self.config.allocation.max_group, allocator.min_group)
        budget = r.prompts_per_iteration * r.group_size
        merged: dict[str, list] = {}
        tasks: dict[str, Any] = {}
        batch = [task for task, _ in allocator.propose(r.prompts_per_iteration)]
        spent = 0
        while batch:
            indices = runner.submit(batch, [step] * len(batch))
            spent += step * len(batch)
            runner.wait(runner.quiescent)
            for task, group in zip(batch, runner.take(indices)):
                tasks[task.id] = task
                merged.setdefault(task.id, []).extend(group)
            rounds_left = (budget - spent) // step
            batch = [tasks[task_id] for task_id, group in merged.items()
                     if not rollout.allocation.until_mixed_done([_success(t) for t in group], cap)][:rounds_left]
            if not batch and rounds_left:
                batch = allocator.draw(rounds_left, exclude=list(merged))
        return list(merged.values())

    def _shape_rewards(self, trajectories, iteration: int) -> None:
        """Adds the configured reward components (`config.reward`) to each trajectory's reward."""
        c = self.config.reward
        if c.overlong_factor <= 0:
            return
        budget_phase = c.toggle_period <= 0 or rewards_lib.toggle_phase(iteration, c.toggle_period) == "budget"
        for t in trajectories:
            penalty = rewards_lib.overlong_penalty(t.generated_tokens, self.config.rollout.max_context,
                                                   c.overlong_buffer, c.overlong_factor) if budget_phase else 0.0
            t.reward = float(t.reward + penalty)
            t.reward_components = {**t.reward_components, "overlong": float(penalty)}

    def _rl_iteration(self, iteration: int, schedule, state, step_fn):
        c, r = self.config.rl, self.config.rollout
        started = time.perf_counter()
        sampler_before = self._sampler_stats()
        if self.allocator is not None and self.allocator.strategy == "until_mixed":
            groups = self._until_mixed_groups()
        else:
            groups = self.runner.take(self._select_groups(schedule))
            if schedule.mode != "sync":
                # Refill what was just taken before the update, not after it: otherwise the sampler
                # works through the learner's step with P fewer groups open and runs dry (measured:
                # idle ~1 s of a ~4.5 s asynchronous iteration).
                self._top_up(schedule)
        sample_seconds = time.perf_counter() - started
        all_trajectories = [t for g in groups for t in g]
        self._shape_rewards(all_trajectories, iteration)
        if self.allocator is not None:
            for g in groups:
                self.allocator.observe(g[0].task_id, [_success(t) for t in g])
        stale_dropped = 0
        if schedule.mode == "async":
            # The staleness bound, against the version these tokens will be trained at.
            kept_groups = []
            for g in groups:
                kept = [rollout.apply_staleness(t, self.version, schedule.max_staleness, schedule.stale_policy)
                        for t in g]
                stale_dropped += sum(t is None for t in kept)
                kept = [t for t in kept if t is not None]
                if kept:
                    kept_groups.append(kept)
            groups = kept_groups
        signal = rollout.assign_advantages(groups, normalize_std=r.normalize_std)
        if groups:
            self.nonzero_share = 0.8 * self.nonzero_share + 0.2 * signal["nonzero_advantage_group_share"]
        kept = [t for g in groups if not r.drop_zero_advantage_groups or any(t.advantage != 0 for t in g)
                for t in g]
        self.buffer.insert(kept, current_version=self.version)
        batch_trajectories = self.buffer.take()
        learn_started = time.perf_counter()
        metrics: dict[str, Any] = {}
        trained_version = self.version
        if batch_trajectories:
            order = self.rng.permutation(len(batch_trajectories))
            for part in np.array_split(order, c.minibatches):
                if len(part) == 0:
                    continue
                batch, _ = replay.pack([batch_trajectories[i] for i in part], self.config.learner.row_length,
                                       row_multiple=math.lcm(self.row_multiple, c.row_multiple),
                                       target_multiple=self.config.learner.target_multiple)
                state, metrics = step_fn(state, _to_device(batch, self.mesh))
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            self._push_weights(state.params)
        learn_seconds = time.perf_counter() - learn_started
        suspended = self.runner.clock.suspended  # episodes that spent this iteration's token budget
        self.runner.next_iteration()  # suspended partial rollouts resume, on the new weights
        lag = np.concatenate([trained_version - t.policy_version[t.loss_mask == 1] for t in batch_trajectories]) \
            if batch_trajectories else np.zeros(0)
        successes = [[_success(t) > 0 for t in g] for g in groups]
        clusters = {g[0].task_id: [metrics_lib.solution_signature(_actions(t, self.tokenizer)) for t in g]
                    for g in groups}
        trained_tokens = int(sum(int(t.loss_mask.sum()) for t in batch_trajectories))
        self.trained_tokens_total += trained_tokens
        iteration_seconds = time.perf_counter() - started
        sampler_after = self._sampler_stats()
        sampler_delta = {k: sampler_after.get(k, 0) - sampler_before.get(k, 0)
                         for k in ("idle_seconds", "prefill_tokens", "reused_tokens", "generate_calls",
                                   "decode_seconds", "admit_seconds", "live_slots", "decoded_slots")}
        calls = max(sampler_delta["generate_calls"], 1)
        record = {
            **signal,
            "success": float(np.mean([_success(t) for t in all_trajectories])) if all_trajectories else 0.0,
            f"pass@{r.group_size}": metrics_lib.mean_pass_at_k(
                [s for s in successes if len(s) == r.group_size], r.group_size),
            "distinct_solutions": metrics_lib.distinct_solutions(clusters),
            **{f"sampled_entropy/{env}": v for env, v in metrics_lib.entropy_by_env(all_trajectories).items()},
            "reward": float(np.mean([t.reward for t in all_trajectories])) if all_trajectories else 0.0,
            **{f"reward/{name}": float(np.mean([t.reward_components.get(name, 0.0) for t in all_trajectories]))
               for name in sorted({k for t in all_trajectories for k in t.reward_components})},
            "trained_trajectories": len(batch_trajectories),
            "rollouts": len(all_trajectories),
            **({"allocation/retired_tasks": self.allocator.retired_count()} if self.allocator is not None else {}),
            "stale_dropped": stale_dropped,
            # Schedule position after this iteration (a resumed run must continue it exactly).
            "version": self.version, "task_seed": self.task_seed, "learner_step": int(state.step),
            "generated_tokens": int(sum(t.generated_tokens for t in all_trajectories)),
            "trained_tokens": trained_tokens,
            "trained_tokens_total": self.trained_tokens_total,
            "policy_lag_mean": float(lag.mean()) if lag.size else 0.0,
            "policy_lag_max": int(lag.max()) if lag.size else 0,
            "groups_pending": len(self.runner.unfinished()) + len(self.runner.finished()),
            "suspended_episodes": suspended,
            "sample_seconds": sample_seconds,  # the learner's idle time: waiting for rollouts
            "learn_seconds": learn_seconds,
            "sampler_idle_seconds": sampler_delta["idle_seconds"],
            # Prompt tokens run through the model, and those taken from the prefix cache instead.
            "sampler_prefill_tokens": sampler_delta["prefill_tokens"],
            "sampler_reused_tokens": sampler_delta["reused_tokens"],
            # Where the sampler's time went and how full its decode calls were: live requests and
            # slots run, per generate call (remote servers' counters summed over the servers).
            "sampler_decode_seconds": sampler_delta["decode_seconds"],
            "sampler_admit_seconds": sampler_delta["admit_seconds"],
            "sampler_generate_calls": sampler_delta["generate_calls"],
            "sampler_live_per_call": sampler_delta["live_slots"] / calls,
            "sampler_rows_per_call": sampler_delta["decoded_slots"] / calls,
            "effective_samples_per_second": len(batch_trajectories) / iteration_seconds,
            "trained_tokens_per_second": trained_tokens / iteration_seconds,
            "finish_reasons": dict(collections.Counter(t.finish_reason for t in all_trajectories)),
            "replay_rejected": dict(self.buffer.rejected),
            **{k: v for k, v in metrics.items() if k in ("loss", "entropy", "grad_norm", "masked_token_share",
                                                          "drift/sampler_abs_diff_max", "drift/sampler_abs_diff_mean",
                                                          "mirror_descent/clip_frac_low",
                                                          "mirror_descent/clip_frac_high", "tis/weight_mean")},
        }
        record.update(self._exploration_guards(record))
        self.writer.write("rl", iteration, record)
        if _every(self.config.checkpoint.every, iteration) or iteration == c.iterations:
            self._checkpoint("rl", iteration, state)
        if _every(self.config.eval.every, iteration) or iteration == c.iterations:
            self.writer.write("rl_eval", iteration, self.evaluate())
        return state

    def _restore_params_only(self, params_target):
        """Parameters from a post-SFT checkpoint (its optimizer state belongs to the SFT optimizer)."""
        import orbax.checkpoint as ocp

        step = self.checkpointer.manager.latest_step()
        restored = self.checkpointer.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(None)))["state"]
        return jax.tree.map(lambda target, value: jnp.asarray(value, target.dtype), params_target, restored["params"])

    def close(self) -> None:
        self.env_threads.shutdown(wait=False, cancel_futures=True)
        if self.servers is not None:
            self.servers.close()
        else:
            self.sampler.close()
        self.checkpointer.close()
        self.writer.close()


def summarize(records: list[dict]) -> dict[str, float]:
    """The run's headline, from its metrics records (all processes of a resumed run): held-out
    success after the cold start (the last `sft_eval`, else the initial evaluation) and at the end
    (the last evaluation of any stage), per level and overall, and the gain in points."""
    evals = [r for r in records if r.get("stage") in ("initial_eval", "sft_eval", "rl_eval")]
    if not evals:
        return {}
    cold = [r for r in evals if r["stage"] == "sft_eval"] or [r for r in evals if r["stage"] == "initial_eval"] \
        or evals[:1]
    before, after = cold[-1], evals[-1]
    keys = [k for k in after if k.startswith("eval/pass@1/") or k == "eval/success"]
    summary = {}
    for key in keys:
        name = key[len("eval/"):]
        summary[f"after_sft/{name}"] = float(before.get(key, 0.0))
        summary[f"final/{name}"] = float(after[key])
    summary["gain_points"] = 100.0 * (summary.get("final/success", 0.0) - summary.get("after_sft/success", 0.0))
    return summary


def train_and_evaluate(config, workdir: str | None = None, *, quiet: bool = False) -> str:
    """Runs SFT then RL as configured; returns the path of the metrics file."""
    workdir = workdir or config.workdir
    trainer = Trainer(config, workdir, quiet=quiet)
    try:
        trainer.writer.write("start", 0, {"params": build.models.count_params(trainer.params),
                                           "devices": jax.device_count()})
        if trainer.resume_meta is None:
            trainer.writer.write("initial_eval", 0, trainer.evaluate())
        trainer.run_sft()
        trainer.run_rl()
        with open(trainer.writer.path) as f:
            summary = summarize([json.loads(line) for line in f if line.strip()])
        if summary:
            trainer.writer.write("summary", trainer.version, summary)
            if not quiet:
                print(f"held-out success (greedy pass@1, levels {config.env.train_difficulties}): after SFT "
                      f"{summary['after_sft/success']:.3f} -> final {summary['final/success']:.3f} "
                      f"({summary['gain_points']:+.1f} points)", flush=True)
    finally:
        trainer.close()
    return trainer.writer.path
