"""Test setup: 8 simulated CPU devices (for mesh tests) and JAX's persistent compilation cache.

Both must be configured before JAX initialises its backend, hence at import time here.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The shared token sampler and env servers require (inherited by the servers tests start).
os.environ.setdefault("JAXRL_AGENT_TOKEN", "test-token-" + os.urandom(8).hex())

import jax  # noqa: E402

_CACHE_DIR = os.environ.get(
    "JAXRL_AGENT_TEST_CACHE", os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache")
)
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
