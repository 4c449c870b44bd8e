"""Metrics: the invariant metrics (exploration, learning signal), pure record builders, the writer."""

from jaxrl_agent.invariants.measures import (
    distinct_solutions,
    entropy_by_env,
    group_signal,
    mean_pass_at_k,
    pass_at_k,
    solution_signature,
)
from jaxrl_agent.metrics.records import (combine_process_records, console_line, eval_console_line, iteration_record,
                                         job_record, seconds_to_gain, summarize)
from jaxrl_agent.metrics.console import Console
from jaxrl_agent.metrics.writer import MetricsWriter, TensorBoardWriter, WandbWriter, flatten, plain

__all__ = ["Console", "MetricsWriter", "TensorBoardWriter", "WandbWriter", "combine_process_records", "console_line", "eval_console_line", "distinct_solutions", "entropy_by_env", "flatten",
           "group_signal", "iteration_record", "job_record", "mean_pass_at_k", "pass_at_k", "plain", "seconds_to_gain",
           "solution_signature", "summarize"]
