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
from jaxrl_agent.learner.updates import (consecutive_skips, global_batch, local_row_multiple, make_proximal_logprobs,
                                        rl_update, row_multiple_for, skip_stop_message)

__all__ = ["PackedBatch", "TrainState", "consecutive_skips", "global_batch", "local_row_multiple", "init_state", "jit_train_step", "make_optimizer", "make_train_step",
           "make_proximal_logprobs", "rl_update", "row_multiple_for", "sequence_logprobs", "skip_stop_message",
           "state_shardings"]
