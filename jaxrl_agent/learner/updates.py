"""One RL iteration's updates: the trained trajectories in `minibatches` packed batches, each one
`train_step`, with the proximal log-probs recomputed first when the objective needs them.

`rl_update` is the edge between host records and the jitted step: it reads the trajectories
through grain as packed minibatches (`replay.minibatch_dataset`), places
the batch on the mesh, and — for the decoupled correction — runs `proximal_logprobs` on every
minibatch with the iteration's starting parameters before the first update, so pi_prox is one
policy for the whole iteration (Hilton et al. 2022; AReaL).

Drift, measured apart from learning (given `logprobs_fn` and `current_version`): on the first
minibatch, before any update, the learner's log-probs with the parameters the sampler holds are
compared with the sampler's on the tokens it sampled at that same version — the train/serve gap,
which is numerics alone (≤ 1e-5 in float32); after the iteration's updates, the learner's log-probs
on the same tokens give the policy's movement, the k3 estimate of KL(pi_start || pi_end) (Schulman
2020) over the sampled tokens.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import numpy as np

from jaxrl_agent import models, sharding
from jaxrl_agent.invariants import measures
from jaxrl_agent.learner.step import PackedBatch, TrainState, sequence_logprobs
from jaxrl_agent.shape_reuse import ShapeReuse


def make_proximal_logprobs(config: models.ModelConfig, mesh: jax.sharding.Mesh, *, temperature: float,
                           logits_chunk: int = 0) -> Callable[[object, PackedBatch], jax.Array]:
    """jit(params, batch) -> log pi_params(tokens) [B, T], as the train step computes them."""

    def logprobs(params, batch: PackedBatch):
        return sequence_logprobs(config, params, batch, temperature=temperature, logits_chunk=logits_chunk, mesh=mesh)[0]

    return jax.jit(logprobs, out_shardings=sharding.batch_sharding(mesh))


def rl_update(state: TrainState, step_fn, trajectories: Sequence, *, rng: np.random.RandomState, minibatches: int,
              row_length: int, row_multiple: int, target_multiple: int, mesh: jax.sharding.Mesh,
              proximal_logprobs: Callable | None = None, logprobs_fn: Callable | None = None,
              current_version: int | None = None, loss_controls: Sequence[float] | None = None,
              summary_weight: float = 1.0, distill_envs: frozenset[str] = frozenset(), step_logprobs: bool = False,
              shapes: ShapeReuse | None = None) -> tuple[TrainState, dict[str, float]]:
    """Shuffles the trajectories into `minibatches` parts and takes one step on each; returns the
    new state and the last step's metrics as floats ({} when there is nothing to train on), with
    `update_skipped` the number of this call's steps that were skipped as non-finite,
    `update_skipped_flags` each step's flag in order, and `skipped_steps_total` the state's count.

    With `logprobs_fn` (`make_proximal_logprobs`) and `current_version` (the policy version of
    `state.params`, which the sampler holds): the drift metrics of the module docstring,
    'invariants/drift/serve_gap_mean|p99|max' over the first minibatch's tokens sampled at
    `current_version` ('serve_gap_tokens' of them; absent when there are none) and
    'invariants/drift/policy_kl' over all its sampled tokens. `loss_controls`: the step's
    `PackedBatch.loss_controls` row (entropy bonus, IcePop on, 0), put on every row.
    `summary_weight`: the weight of summary tokens' advantages (`replay.pack`); `distill_envs`: the
    environments whose episodes alone the distillation term covers (`replay.pack`; empty = all).
    `step_logprobs`: `step_fn` returns metrics['token_logprobs'] (`make_train_step(token_logprobs=True)`),
    the first minibatch's log-probs under the starting parameters, which the drift measurement then
    takes instead of a forward pass of `logprobs_fn` of its own (one of its two). `shapes`: the
    step's compiled batch shapes (`global_batch`), kept across calls."""
    from jaxrl_agent import replay

    # With several processes (jax.distributed) each holds its own trajectories, and the global batch
    # of a step is every process's rows: the processes agree on the number of steps and on each
    # batch's shape first (the largest of theirs; padding rows and target columns train nothing).
    if jax.process_count() == 1 and not trajectories:
        return state, {}
    sizes = sharding.agree_max(replay.minibatch_sizes(len(trajectories), minibatches))
    if not sizes.any():
        return state, {}
    # The replay's trajectories read through grain: a seeded shuffle (the seed drawn from the run's
    # checkpointed RNG), cut into minibatches, each packed as it is read.
    dataset = replay.minibatch_dataset(
        trajectories, minibatches, seed=int(rng.randint(0, 2**31 - 1)),
        pack_fn=lambda part: replay.pack(part, row_length, row_multiple=local_row_multiple(row_multiple),
                                         target_multiple=target_multiple, summary_weight=summary_weight,
                                         distill_envs=distill_envs)[0])
    batches = [global_batch(batch, mesh, loss_controls, shapes) for batch, size in zip(dataset, sizes) if size]
    if proximal_logprobs is not None:
        batches = [b.replace(old_logprobs=proximal_logprobs(state.params, b)) for b in batches]
    measure = logprobs_fn is not None and current_version is not None
    # Before any update: the log-probs under the parameters the sampler holds (the step donates
    # them), from the decoupled correction's proximal pass, the first step's own forward pass, or
    # a pass of their own.
    start = None
    if measure and proximal_logprobs is not None:
        start = batches[0].old_logprobs
    elif measure and not step_logprobs:
        start = logprobs_fn(state.params, batches[0])
    metrics, skipped = {}, []
    for i, batch in enumerate(batches):
        state, metrics = step_fn(state, batch)
        token_logprobs = metrics.pop("token_logprobs", None)
        if measure and start is None and i == 0:
            start = token_logprobs
        skipped.append(metrics["update_skipped"])
    if measure:
        start = sharding.to_host(start)
    out = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if measure:
        out.update(_drift(start, sharding.to_host(logprobs_fn(state.params, batches[0])),
                          jax.tree.map(sharding.to_host, batches[0]), current_version))
    # Every step's skip flag (a non-finite loss or gradient leaves the parameters as they were), in order.
    out["update_skipped"] = float(sum(jax.device_get(skipped)))
    out["update_skipped_flags"] = [bool(flag) for flag in jax.device_get(skipped)]
    out["skipped_steps_total"] = float(jax.device_get(state.skipped_steps))
    return state, out


def _drift(start: np.ndarray, end: np.ndarray, batch: PackedBatch, current_version: int) -> dict[str, float]:
    sampled = np.asarray(batch.loss_mask) == 1
    same_version = sampled & (np.asarray(batch.policy_version) == current_version)
    out = {}
    if same_version.any():
        gap = measures.gap_stats(start, np.asarray(batch.sampler_logprobs), same_version)
        out.update({f"invariants/drift/serve_gap_{k}": v for k, v in gap.items()})
        out["invariants/drift/serve_gap_tokens"] = float(same_version.sum())
    if sampled.any():
        x = np.clip((end - start)[sampled].astype(np.float64), -20.0, 20.0)  # log pi_end / pi_start
        out["invariants/drift/policy_kl"] = float(np.mean(np.exp(x) - 1.0 - x))  # k3 of KL(start || end)
    return out


def _targets(batch: PackedBatch) -> int:
    return 0 if batch.target_index is None else batch.target_index.shape[1]


def local_row_multiple(row_multiple: int) -> int:
    """What each process's rows must be a multiple of so that all processes' rows together are a
    multiple of `row_multiple` (`row_multiple` itself with one process)."""
    return row_multiple // math.gcd(row_multiple, jax.process_count())


def global_batch(batch: PackedBatch, mesh: jax.sharding.Mesh, loss_controls: Sequence[float] | None = None,
                 shapes: ShapeReuse | None = None) -> PackedBatch:
    """This process's packed rows as its share of one global batch on `mesh`. With several
    processes every one must call this for the same step: they agree on the shape first (the most
    rows and trained positions of any; padding trains nothing), then each contributes its rows
    (`sharding.put_batch`). `loss_controls`: the step's `PackedBatch.loss_controls` row, put on every row.
    `shapes`: the step's compiled (rows, targets) shapes; a new shape may then run padded up to a
    compiled larger one (`ShapeReuse.choose`: every process sees the same agreed shapes, so they
    choose alike)."""
    from jaxrl_agent import replay

    rows, targets = sharding.agree_max([batch.tokens.shape[0], _targets(batch)])
    if shapes is not None:
        rows, targets = shapes.choose((rows, targets))
    batch = replay.pad_batch(batch, int(rows), int(targets))
    if loss_controls is not None:
        batch = batch.replace(loss_controls=np.tile(np.asarray(loss_controls, np.float32)[None, :],
                                                    (batch.tokens.shape[0], 1)))
    return sharding.put_batch(batch, mesh)


def row_multiple_for(mesh: jax.sharding.Mesh, *multiples: int, microbatches: int = 1) -> int:
    """Learner rows are split over ('data', 'fsdp') and a step's rows into `microbatches` parts:
    row counts must divide by both and by every configured multiple."""
    return math.lcm(mesh.shape["data"] * mesh.shape["fsdp"], microbatches, *multiples)


def consecutive_skips(previous: int, skipped_flags) -> int:
    """The run of skipped (non-finite) updates after `previous` and this call's flags, in order."""
    for skipped in skipped_flags:
        previous = previous + 1 if skipped else 0
    return previous


def skip_stop_message(consecutive: int, limit: int, iteration: int) -> str | None:
    """Why the run must stop after `consecutive` skipped updates (`learner.max_consecutive_skips`,
    0 = never), or None."""
    if limit <= 0 or consecutive < limit:
        return None
    return (f"the last {consecutive} learner updates were skipped (non-finite loss or gradients; "
            f"learner.max_consecutive_skips={limit}): stopping at RL iteration {iteration}. The parameters are "
            "the last finite ones; lower the learning rate or check the objective and rewards")
