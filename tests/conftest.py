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
