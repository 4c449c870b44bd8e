"""Run state and resume: Orbax checkpoints of the learner state plus a `RunState` record.

`RunState` is everything besides the arrays that a run needs to continue the same schedule: the
stage and iteration, policy version, wall time so far, trained tokens, the task source (task stream
position, allocator posteriors, groups sampled but not yet trained), the replay buffer and the
trainer's RNG. `Checkpointer.save(step, state, run_state)` writes both; `restore_state` reads the
learner state back into a target's shapes and shardings; `restore_params` reads only the parameters
(a post-SFT checkpoint, whose optimizer state belongs to the SFT optimizer).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RunState:
    stage: str  # 'sft_done' or 'rl'
    iteration: int  # the last finished RL iteration (0 after SFT)
    version: int  # policy version of the parameters saved
    elapsed_seconds: float  # wall time of the run so far (all segments)
    trained_tokens_total: int
    source: dict  # rollout.source.RolloutSource.state_dict()
    replay: dict  # replay.ReplayBuffer.state_dict()
    rng: list  # the trainer's numpy RandomState (minibatch order, demonstrations)
    # The invariants' alarm states ({name: [active, streak]}); checkpoints written before they
    # existed restore with none active.
    invariants: dict = dataclasses.field(default_factory=dict)
    # With several processes, each one's own {source, replay, rng} in process order (the fields
    # above then hold process 0's); [] with one process.
    processes: list = dataclasses.field(default_factory=list)

    def for_process(self, index: int) -> "RunState":
        """This run state with process `index`'s own source, replay and rng (itself with one process)."""
        if not self.processes:
            return self
        if index >= len(self.processes):
            raise ValueError(f"the checkpoint holds {len(self.processes)} processes' states; process {index} has "
                             "none (resume with the number of processes that wrote it)")
        own = self.processes[index]
        return dataclasses.replace(self, source=own["source"], replay=own["replay"], rng=own["rng"])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunState":
        fields = {f.name for f in dataclasses.fields(cls)}
        optional = {"invariants", "processes"}
        missing = sorted(fields - optional - set(d))
        if missing:
            raise ValueError(f"checkpoint run state lacks {missing}: written by an incompatible version")
        return cls(**{k: d[k] for k in fields if k in d})


def run_state(*, stage: str, iteration: int, version: int, elapsed_seconds: float, trained_tokens_total: int,
              source: dict, replay: dict, rng, invariants: dict) -> RunState:
    """The RunState of this moment (`rng`: the trainer's numpy RandomState). With several processes,
    each one's own {source, replay, rng} is gathered into `processes` (a collective every process
    calls), so that each resumes its own; the top-level fields hold this process's."""
    own = {"source": source, "replay": replay, "rng": rng_state(rng)}
    if jax.process_count() > 1:
        from jaxrl_agent import sharding

        processes = sharding.gather_objects(own)
    else:
        processes = []
    return RunState(stage=stage, iteration=iteration, version=version, elapsed_seconds=elapsed_seconds,
                    trained_tokens_total=trained_tokens_total, **own, invariants=invariants, processes=processes)


def rng_state(rng) -> list:
    kind, keys, pos, has_gauss, cached = rng.get_state()
    return [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def set_rng_state(rng, state: list) -> None:
    import numpy as np

    kind, keys, pos, has_gauss, cached = state
    rng.set_state((kind, np.asarray(keys, np.uint32), pos, has_gauss, cached))


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; `record` is what the run logs about it."""

    def __init__(self, step: int, kept: int | None, cause: BaseException):
        error = f"{type(cause).__name__}: {cause}"
        super().__init__(f"checkpoint step {step} could not be written ({error}); stopping. The previous checkpoint "
                         f"({'step ' + str(kept) if kept is not None else 'none'}) is kept: free space and rerun with "
                         "--config.resume=True")
        self.record = {"checkpoint_step": step, "error": error, "kept_step": -1 if kept is None else kept}


class Checkpointer:
    """Orbax `CheckpointManager` over workdir/checkpoints: the learner state (params, optimizer
    state, step) and the RunState as JSON, saved together under one step number."""

    def __init__(self, directory: str, keep: int):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        several = jax.process_count() > 1
        if several:
            # Orbax's default barrier is a device collective issued from its background threads,
            # which interleaves with the run's own collectives differently on each process (a
            # mismatch aborts the job); the coordination service's barrier does not touch devices.
            from absl import flags

            flags.FLAGS["experimental_orbax_use_distributed_barrier"].value = True
        self.manager = ocp.CheckpointManager(
            os.path.abspath(directory), options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=not several))

    def save(self, step: int, state: dict[str, Any], run_state: RunState) -> None:
        """Writes one checkpoint; raises CheckpointWriteError (naming the step kept) when it cannot
        be written — orbax writes to a temporary folder and renames it at the end, so the previous
        checkpoint stays whole."""
        ocp = self._ocp
        try:
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                            meta=ocp.args.JsonSave(run_state.to_dict())), force=True)
            self.manager.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - OSError (ENOSPC, EIO) or orbax's wrapping of it
            raise CheckpointWriteError(step, self.manager.latest_step(), err) from err

    def latest(self) -> RunState | None:
        """The run state of the newest checkpoint that restores whole (its run state and every array
        read back); newer ones that do not — a truncated or corrupted write — are skipped, listed in
        `self.skipped` as (step, reason) and moved to `<workdir>/unrestorable_checkpoints/`;
        `self.step` is the one chosen. None when no checkpoint restores."""
        ocp = self._ocp
        self.skipped: list[tuple[int, str]] = []
        self.step = None
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                run_state = RunState.from_dict(meta)
                arrays = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(None)))["state"]
                jax.block_until_ready(arrays)
                del arrays
            except Exception as err:  # noqa: BLE001 - any failure to read it back disqualifies the checkpoint
                self.skipped.append((step, f"{type(err).__name__}: {str(err)[:300]}"))
                continue
            self.step = step
            self._set_aside(step)
            return run_state
        return None

    def select(self, step: int) -> RunState:
        """Chooses checkpoint `step` (instead of the newest) for the restores; its run state.
        Raises FileNotFoundError naming the steps there are."""
        steps = sorted(self.manager.all_steps())
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint step {step} in {self.manager.directory}; steps: {steps}")
        meta = self.manager.restore(step, args=self._ocp.args.Composite(meta=self._ocp.args.JsonRestore()))["meta"]
        self.step = step
        return RunState.from_dict(meta)

    def _set_aside(self, chosen: int) -> None:
        """Moves the unrestorable checkpoints newer than `chosen` out of the manager's folder (to
        `<workdir>/unrestorable_checkpoints/`), so the resumed run can write those steps again."""
        newer = [step for step, _ in self.skipped if step > chosen]
        if not newer:
            return
        directory = os.fspath(self.manager.directory)
        aside = os.path.join(os.path.dirname(directory.rstrip(os.sep)), "unrestorable_checkpoints")
        os.makedirs(aside, exist_ok=True)
        for step in newer:
            target = os.path.join(aside, f"{step}-{int(time.time())}")
            os.rename(os.path.join(directory, str(step)), target)
        self.manager.reload()

    def _chosen_step(self) -> int:
        if getattr(self, "step", None) is None and self.latest() is None:
            raise FileNotFoundError(f"no checkpoint in {self.manager.directory} restores")
        return self.step

    def restore_state(self, target: dict[str, Any]) -> dict[str, Any]:
        """The state of the checkpoint `latest()` chose, in the shapes, dtypes and shardings of `target`."""
        ocp = self._ocp
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        return self.manager.restore(self._chosen_step(),
                                    args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]

    def restore_params(self, params_target, name: str = "params"):
        """Only the parameters of the checkpoint `latest()` chose, cast to `params_target`'s dtypes
        (its optimizer state may belong to another optimizer); `name` another set of weights it
        keeps (`learner_arrays`: e.g. 'subagent_params'), KeyError naming those it has if absent."""
        ocp = self._ocp
        restored = self.manager.restore(self._chosen_step(),
                                        args=ocp.args.Composite(state=ocp.args.StandardRestore(None)))["state"]
        if name not in restored:
            raise KeyError(f"checkpoint {self._chosen_step()} in {self.manager.directory} has no {name!r} "
                           f"(it has {sorted(restored)})")
        return jax.tree.map(lambda target, value: jnp.asarray(value, target.dtype), params_target, restored[name])

    def close(self) -> None:
        self.manager.close()


def restore_policy(directory: str, params_target, *, keep: int, step: int | None = None, name: str = "params"):
    """(params, step, run state) of a run's checkpoint in `directory` (`<workdir>/checkpoints`): the
    newest that restores, or `step`; the parameters (`name`: another set of weights it keeps) cast
    to `params_target`'s dtypes. Raises FileNotFoundError when there is no checkpoint, none
    restores, or `step` is not there."""
    if not os.path.isdir(directory) or not os.listdir(directory):
        raise FileNotFoundError(f"no checkpoints in {directory!r} (expected {directory}/<step>)")
    checkpointer = Checkpointer(directory, keep=keep)
    try:
        if step is None:
            run_state = checkpointer.latest()
            if run_state is None:
                raise FileNotFoundError(f"no checkpoint in {directory} restores: {checkpointer.skipped}")
        else:
            run_state = checkpointer.select(step)
        return checkpointer.restore_params(params_target, name), checkpointer.step, run_state
    finally:
        checkpointer.close()


def learner_arrays(state, frozen: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The arrays a checkpoint holds: the learner state, its frozen reference and teacher weights,
    and `frozen` ({name: weights}, e.g. the judge's and the sub-agents') where not None — a resumed
    run must judge, regularise, distil and delegate against the same ones."""
    arrays = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
    if state.ref_params is not None:
        arrays["ref_params"] = state.ref_params
    if getattr(state, "master_params", None) is not None:
        arrays["master_params"] = state.master_params
    if getattr(state, "teacher_params", None) is not None:
        arrays["teacher_params"] = state.teacher_params
    for name, weights in (frozen or {}).items():
        if weights is not None:
            arrays[name] = weights
    return arrays


def restore_learner(checkpointer: Checkpointer, state, frozen: Mapping[str, Any] | None = None):
    """(state, {name: frozen weights}) from the latest checkpoint, in the shapes and shardings of
    the given ones (a frozen entry that is None stays None)."""
    restored = checkpointer.restore_state(learner_arrays(state, frozen))
    state = state.replace(params=restored["params"], opt_state=restored["opt_state"], step=restored["step"],
                          ref_params=restored.get("ref_params", state.ref_params),
                          master_params=restored.get("master_params", state.master_params),
                          teacher_params=restored.get("teacher_params", state.teacher_params))
    return state, {name: restored.get(name, weights) for name, weights in (frozen or {}).items()}


def check_workdir(workdir: str, *, resume: bool) -> None:
    """A workdir that already holds a run is continued (resume=True) or refused: a new run never
    appends to another's metrics or collides with its checkpoint steps."""
    if resume:
        return
    held = [name for name in ("metrics.jsonl", "checkpoints") if os.path.exists(os.path.join(workdir, name))
            and (name != "checkpoints" or os.listdir(os.path.join(workdir, name)))]
    if jax.process_count() > 1:  # every process refuses together (each looked before any of them wrote)
        from jaxrl_agent import sharding

        if sharding.agree_max([len(held)])[0] and not held:
            held = ["another process's view of it"]
    if held:
        from jaxrl_agent.build import ConfigError

        raise ConfigError(
            f"workdir={workdir!r} already holds a run ({', '.join(held)}): pass --config.resume=True to continue "
            "it, or choose another --config.workdir (or delete that folder) to start a new one")
