"""Token-level trajectories, their validation, the replay buffer, and packing into learner batches."""

from jaxrl_agent.replay.buffer import ReplayBuffer
from jaxrl_agent.replay.packing import first_fit, minibatch_dataset, minibatch_sizes, pack, pad_batch, target_index
from jaxrl_agent.replay.trajectory import SCHEMA_VERSION, PartialRollout, Trajectory, validate

__all__ = ["PartialRollout", "ReplayBuffer", "SCHEMA_VERSION", "Trajectory", "first_fit", "minibatch_dataset", "minibatch_sizes", "pack", "pad_batch", "target_index", "validate"]
