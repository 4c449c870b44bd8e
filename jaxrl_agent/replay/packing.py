"""Packing variable-length trajectories into fixed [B, T] learner rows.

First-fit decreasing: longest first, each into the first row with room (or first fit in the given
order, `decreasing=False`). Each learner sequence of a trajectory (one, or one per
`Trajectory.segments` entry) becomes one attention segment (ids 1, 2, ... within a row; 0 =
padding) with positions restarting at 0, so attention never crosses sequences
(`models.forward(..., segment_ids=...)`). Rows are padded to a multiple of `row_multiple` so that
the jitted train step sees few distinct shapes; `first_fit` fills a fixed number of rows from a
stream (SFT's updates: one shape).

The learner reads an iteration's trajectories through grain (`minibatch_dataset`): a seeded
shuffle, cut into minibatches, each packed when it is read.
"""

from __future__ import annotations

from typing import Callable, Sequence

import grain
import numpy as np

from jaxrl_agent.learner.step import PackedBatch
from jaxrl_agent.replay.trajectory import Trajectory


def pack(trajectories: Sequence[Trajectory], row_length: int, *, row_multiple: int = 1,
         min_rows: int = 1, target_multiple: int = 0, summary_weight: float = 1.0,
         distill_envs: frozenset[str] | set[str] = frozenset(), decreasing: bool = True
         ) -> tuple[PackedBatch, list[list[int]]]:
    """Returns (PackedBatch of numpy arrays, rows: for each row the indices of its trajectories, one
    entry per packed sequence).

    decreasing=False packs first fit in the given order instead (the rows `first_fit` counts).

    target_multiple > 0 also fills `target_index` ([B, K]: each row's trained positions, padded
    with 0), K being the most trained tokens in a row rounded up to a multiple of target_multiple
    (at most row_length), so that the learner sees few distinct shapes; 0 = no index.

    summary_weight scales the advantage of the policy's summary tokens (`Trajectory.summary_spans`,
    context strategy 'summarize'): A_t = w * A for t in a summary turn. Every policy-gradient
    surrogate here is linear in A_t (the clipped one too, for w > 0), so this weights the summary
    tokens' term of the loss by w against the action tokens': FoldAct's separate loss on summary
    tokens (against their gradient dilution) as a per-token weight, under the objective's own
    reduction.

    distill_envs (`rl.distill_envs`), when not empty, also fills `distill_mask`: the loss mask on
    the episodes of those environments, 0 elsewhere (the distillation term covers only them).
    """
    pieces = [(i, a, b) for i, t in enumerate(trajectories) for a, b in t.segments]
    order = sorted(range(len(pieces)), key=lambda p: -(pieces[p][2] - pieces[p][1])) if decreasing \
        else range(len(pieces))
    rows: list[list[int]] = []
    members: list[list[tuple[int, int, int]]] = []
    room: list[int] = []
    for p in order:
        i, a, b = pieces[p]
        r = _place(room, b - a, row_length, trajectories[i].task_id)
        if r == len(rows):
            rows.append([])
            members.append([])
        rows[r].append(i)
        members[r].append(pieces[p])
    count = max(len(rows), min_rows)
    count = -(-count // row_multiple) * row_multiple
    shape = (count, row_length)
    out = {name: np.zeros(shape, dtype) for name, dtype in (
        ("tokens", np.int32), ("segment_ids", np.int32), ("positions", np.int32), ("loss_mask", np.int32),
        ("advantages", np.float32), ("sampler_logprobs", np.float32), ("policy_version", np.int32),
        ("distill_mask", np.float32))}
    out["policy_version"][:] = -1
    for r, row in enumerate(members):
        start = 0
        for segment, (i, a, b) in enumerate(row, start=1):
            t, n = trajectories[i], b - a
            sl, mask = slice(start, start + n), t.loss_mask[a:b]
            out["tokens"][r, sl] = t.tokens[a:b]
            out["segment_ids"][r, sl] = segment
            out["positions"][r, sl] = np.arange(n)
            out["loss_mask"][r, sl] = mask
            out["advantages"][r, sl] = t.advantage * mask
            if t.env in distill_envs:
                out["distill_mask"][r, sl] = mask
            if summary_weight != 1.0:
                for lo, hi in t.summary_spans:
                    lo, hi = max(lo, a), min(hi, b)
                    if lo < hi:
                        out["advantages"][r, start + lo - a:start + hi - a] *= summary_weight
            out["sampler_logprobs"][r, sl] = t.sampler_logprobs[a:b] * mask
            out["policy_version"][r, sl] = np.where(mask == 1, t.policy_version[a:b], -1)
            start += n
    batch = PackedBatch(tokens=out["tokens"], segment_ids=out["segment_ids"], positions=out["positions"],
                        loss_mask=out["loss_mask"], advantages=out["advantages"],
                        sampler_logprobs=out["sampler_logprobs"], old_logprobs=out["sampler_logprobs"].copy(),
                        policy_version=out["policy_version"],
                        target_index=target_index(out["loss_mask"], target_multiple) if target_multiple > 0 else None,
                        distill_mask=out["distill_mask"] if distill_envs else None)
    return batch, rows


def _place(room: list[int], n: int, row_length: int, task_id: str) -> int:
    """First fit of a sequence of `n` tokens: the first row of `room` (free tokens per row) with `n`
    free, else a new row (appended); its index. The row's room shrinks by `n`."""
    if n > row_length:
        raise ValueError(f"trajectory {task_id!r}: a sequence of {n} tokens exceeds row_length={row_length}")
    for r, free in enumerate(room):
        if free >= n:
            room[r] -= n
            return r
    room.append(row_length - n)
    return len(room) - 1


def first_fit(trajectories: Sequence[Trajectory], row_length: int, max_rows: int | None = None) -> tuple[int, int]:
    """First fit in the given order: each sequence (`Trajectory.segments`) into the first of the
    rows so far with room, else a new row, at most `max_rows` of them (None = no limit). Returns
    (how many leading trajectories were placed, whole: it stops at the first that does not fit; the
    rows they use). A fixed number of learner rows filled from a stream of trajectories (SFT's
    `sft.rows_per_update`) takes the placed prefix; `pack(..., decreasing=False)` lays it out in the
    same rows."""
    room: list[int] = []
    for placed, trajectory in enumerate(trajectories):
        trial = list(room)
        for a, b in trajectory.segments:
            _place(trial, b - a, row_length, trajectory.task_id)
        if max_rows is not None and len(trial) > max_rows:
            return placed, len(room)
        room = trial
    return len(trajectories), len(room)


def target_index(loss_mask: np.ndarray, multiple: int) -> np.ndarray:
    """`PackedBatch.target_index` for a [B, T] loss mask: [B, K] int32, each row's trained positions
    in increasing order, padded with 0; K = the most trained tokens in a row rounded up to a
    multiple of `multiple` (at least 1, at most T)."""
    mask = np.asarray(loss_mask) == 1
    k = min(max(1, -(-int(mask.sum(axis=1).max()) // multiple) * multiple), mask.shape[1])
    order = np.argsort(~mask, axis=1, kind="stable")[:, :k]  # trained positions first, in order
    return np.where(np.take_along_axis(mask, order, axis=1), order, 0).astype(np.int32)


def pad_batch(batch: PackedBatch, rows: int, targets: int = 0) -> PackedBatch:
    """`batch` with padding rows up to `rows` (segment 0, nothing trained, version -1) and its
    `target_index` padded with 0 columns up to `targets` (0 = padding there too); neither changes
    what is trained. Raises ValueError when `batch` is already larger."""
    have = batch.tokens.shape[0]
    if rows < have or (batch.target_index is not None and targets < batch.target_index.shape[1]):
        raise ValueError(f"cannot pad a batch of {have} rows and "
                         f"{0 if batch.target_index is None else batch.target_index.shape[1]} targets down to "
                         f"{rows} rows and {targets} targets")

    def grow(x, fill=0):
        return np.concatenate([x, np.full((rows - have, *x.shape[1:]), fill, x.dtype)]) if rows > have else x

    padded = {name: grow(np.asarray(getattr(batch, name)), -1 if name == "policy_version" else 0)
              for name in ("tokens", "segment_ids", "positions", "loss_mask", "advantages", "sampler_logprobs",
                           "old_logprobs", "policy_version", "distill_mask") if getattr(batch, name) is not None}
    index = batch.target_index
    if index is not None:
        index = np.asarray(index)
        index = grow(np.pad(index, ((0, 0), (0, targets - index.shape[1]))))
    return batch.replace(**padded, target_index=index)


def minibatch_sizes(count: int, minibatches: int) -> list[int]:
    """How `count` trajectories split into `minibatches` parts: near-equal sizes, the larger first
    (`np.array_split`'s); a part may be 0."""
    if minibatches < 1:
        raise ValueError(f"minibatches={minibatches}: expected >= 1")
    small, extra = divmod(count, minibatches)
    return [small + (i < extra) for i in range(minibatches)]


def minibatch_dataset(trajectories: Sequence[Trajectory], minibatches: int, *, seed: int,
                      pack_fn: Callable[[list[Trajectory]], PackedBatch]) -> grain.MapDataset:
    """The learner's reading of the replay buffer's admitted trajectories, as a grain dataset.

    Element i is minibatch i, `pack_fn` of its trajectories: the trajectories in grain's seeded
    index shuffle, cut into `minibatch_sizes(len(trajectories), minibatches)` consecutive parts. The
    dataset is lazy (a minibatch is packed when it is read), random-access and deterministic in
    `seed`, so an iterator's `get_state()` ({'next_index': i}) is its whole position and
    `set_state` continues from minibatch i with the same contents. Each process reads its own
    buffer's trajectories (the replay is sharded by process); `learner.global_batch` joins them.
    """
    shuffled = grain.MapDataset.source(list(trajectories))
    if len(shuffled):
        shuffled = shuffled.shuffle(seed=seed)
    bounds = np.cumsum([0, *minibatch_sizes(len(shuffled), minibatches)])
    return grain.MapDataset.range(minibatches).map(
        lambda i: pack_fn([shuffled[j] for j in range(bounds[i], bounds[i + 1])]))
