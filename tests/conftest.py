"""Test setup: 8 simulated CPU devices (for mesh tests), XLA's backend optimisation off in this
process, and JAX's persistent compilation cache.

All must be configured before JAX initialises its backend, hence at import time here.

The suite compiles hundreds of tiny programs and runs each a few times: on a clean clone (CI, an
empty cache) compiling is most of its time. With `--xla_backend_optimization_level=0` (XLA's HLO
passes and fusions as before, LLVM's optimisation of the machine code off; every test passes
alike) the suite took 11:15 from an empty cache against 16:40, and warm no longer (5:58 against
6:13 with every process at level 0; AMD EPYC, 2 cores; benchmarks/RESULTS.md). It applies to this
process only: XLA reads its flags when the backend starts, after which XLA_FLAGS is put back, so
the processes tests start (trainer runs, servers) compile as a user's do, and measure and cache
what a user's would. This process's compilations go to a cache folder of their own (the cache
keys them by the environment's XLA_FLAGS, which no longer name the level). A user who sets
XLA_FLAGS runs the suite with exactly those flags.
"""

import os

DEFAULT_XLA_FLAGS = "--xla_force_host_platform_device_count=8"
UNOPTIMISED_FLAG = "--xla_backend_optimization_level=0"
# Set when this file chose XLA_FLAGS, so that pytest-xdist's workers (which inherit the flags as put
# back below) choose alike.
DEFAULTED = "JAXRL_AGENT_TEST_DEFAULT_XLA_FLAGS"


def xla_flags_for_the_suite(environ) -> tuple[str, str, bool]:
    """(the flags this process starts its backend with, those the processes it starts inherit,
    whether this process compiles unoptimised) for an environment `environ`."""
    if "XLA_FLAGS" in environ and environ.get(DEFAULTED) != "1":
        return environ["XLA_FLAGS"], environ["XLA_FLAGS"], False  # the user's, as they are
    return f"{DEFAULT_XLA_FLAGS} {UNOPTIMISED_FLAG}", DEFAULT_XLA_FLAGS, True


_PROCESS_XLA_FLAGS, CHILD_XLA_FLAGS, UNOPTIMISED = xla_flags_for_the_suite(os.environ)
if UNOPTIMISED:
    os.environ[DEFAULTED] = "1"
os.environ["XLA_FLAGS"] = _PROCESS_XLA_FLAGS
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The shared token sampler and env servers require (inherited by the servers tests start).
os.environ.setdefault("JAXRL_AGENT_TOKEN", "test-token-" + os.urandom(8).hex())

import jax  # noqa: E402

jax.devices()  # the backend starts here and reads XLA_FLAGS
os.environ["XLA_FLAGS"] = CHILD_XLA_FLAGS  # what the processes tests start inherit

_CACHE_DIR = os.environ.get(
    "JAXRL_AGENT_TEST_CACHE", os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache")
)
# Processes tests start may share _CACHE_DIR; this process's unoptimised programs stay apart.
PROCESS_CACHE_DIR = os.path.join(_CACHE_DIR, "backend_optimization_level_0") if UNOPTIMISED else _CACHE_DIR
jax.config.update("jax_compilation_cache_dir", PROCESS_CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


import pytest  # noqa: E402


def _openssl(*args, cwd):
    import subprocess

    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory):
    """A test CA, a server certificate it signed for 127.0.0.1/localhost, and an unrelated CA:
    {'ca', 'cert', 'key', 'other_ca'} paths (made with the openssl command line)."""
    folder = tmp_path_factory.mktemp("tls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for name in ("ca", "other_ca"):
        _openssl("req", "-x509", *ec, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
                 "-subj", f"/CN=jaxrl-agent test {name}", cwd=folder)
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=folder)
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-extfile", "san.ext", cwd=folder)
    return {"ca": str(folder / "ca.pem"), "cert": str(folder / "server.pem"), "key": str(folder / "server.key"),
            "other_ca": str(folder / "other_ca.pem")}


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory):
    """A Qwen3 tokenizer folder on Qwen's real vocabulary with a Qwen3-style chat template."""
    from tests import real_vocab

    return real_vocab.qwen3_folder(str(tmp_path_factory.mktemp("qwen3_tokenizer")))


@pytest.fixture(scope="session")
def llama31_tokenizer_dir(tmp_path_factory):
    """A Llama-3.1-style tokenizer folder (Llama 3.1's special tokens on Qwen's vocabulary)."""
    from tests import real_vocab

    return real_vocab.llama31_folder(str(tmp_path_factory.mktemp("llama31_tokenizer")))
