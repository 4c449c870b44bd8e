"""Multi-turn environments, the tool-call protocol, and the environment service. No JAX here.

Built in: `calculator`, `kb_search`, `terminal`, `code`, `chain`, `chain_sum` (each with a scripted expert).
"""

from jaxrl_agent.envs.api import (
    FINISH_REASONS,
    HELD_OUT_SEED_OFFSET,
    Environment,
    Observation,
    Step,
    Task,
    ToolEnvironment,
    ToolError,
    expert_policy,
    make,
    register,
    registered,
    run_episode,
)
from jaxrl_agent.envs.tool_protocol import (
    ParsedAction,
    ToolCall,
    ToolCallError,
    ToolSpec,
    format_answer,
    format_tool_call,
    format_tool_result,
    parse_tool_calls,
)

# Importing the built-in environments registers them.
from jaxrl_agent.envs import calculator, chain, chain_sum, code, kb_search, terminal  # noqa: E402,F401

BUILTIN_ENVS = ("calculator", "kb_search", "terminal", "code", "chain", "chain_sum")

__all__ = [
    "BUILTIN_ENVS", "Environment", "FINISH_REASONS", "HELD_OUT_SEED_OFFSET", "Observation", "ParsedAction", "Step",
    "Task", "ToolCall", "ToolCallError", "ToolEnvironment", "ToolError", "ToolSpec", "expert_policy",
    "format_answer", "format_tool_call", "format_tool_result", "make", "parse_tool_calls", "register",
    "registered", "run_episode",
]
