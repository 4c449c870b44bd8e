"""The learner: train state, optimizer, pure sharded train step."""

from jaxrl_agent.learner.step import (
    PackedBatch,
    TrainState,
    init_state,
    jit_train_step,
    make_optimizer,
    make_train_step,
    sequence_logprobs,
    state_shardings,
)

__all__ = ["PackedBatch", "TrainState", "init_state", "jit_train_step", "make_optimizer", "make_train_step",
           "sequence_logprobs", "state_shardings"]
