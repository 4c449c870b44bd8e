"""Everything needed to run JetStream 0.2.2 (its last release) on current JAX, in one place.

* Its orchestrator calls `jax.tree_map`, which JAX removed; without the alias the generate thread
  raises and JetStream's thread wrapper SIGKILLs the whole process.
* Importing `jetstream.core.orchestrator` sets the root logger to DEBUG with a stdout handler;
  we undo that so a server's stdout is not flooded with per-step logs.
* It imports `seqio`, and so TensorFlow, whose C++ start-up logs (no CUDA driver, oneDNN) are
  silenced here (`jaxrl_agent.quiet`; JAXRL_AGENT_VERBOSE=1 shows them).
Import JetStream modules only through `import_jetstream()`.
"""

from __future__ import annotations

import logging

import jax


def apply_shims() -> None:
    if not hasattr(jax, "tree_map"):
        jax.tree_map = jax.tree.map  # removed in JAX 0.6; JetStream 0.2.2 still calls it


def import_jetstream():
    """Imports and returns (engine_api, orchestrator, jetstream_pb2, jetstream_pb2_grpc, token_utils)."""
    apply_shims()
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from jaxrl_agent import quiet

    quiet.quiet_environment()
    with quiet.native_stderr_silenced():
        from jetstream.core import orchestrator
        from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
        from jetstream.engine import engine_api, token_utils

    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    logging.getLogger("jetstream").setLevel(logging.WARNING)
    return engine_api, orchestrator, jetstream_pb2, jetstream_pb2_grpc, token_utils
