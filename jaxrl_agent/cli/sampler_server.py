"""`jaxrl-agent sampler-server`: our engine behind JetStream's orchestrator and gRPC server.

  jaxrl-agent sampler-server --config configs/calculator_tiny.py --port 9000 [--host 127.0.0.1]

Serves JetStream's `Orchestrator/Decode` (token ids) and `jaxrl_agent.Sampler` (ids, log-probs,
versions, finish reasons, weight updates) on one port. Prints
`sampler server listening on HOST:PORT` when ready (`--port 0` picks a free port). Every call must
carry the shared token ($JAXRL_AGENT_TOKEN or --token_file; the server refuses to start without
one); `LoadCheckpoint` reads only below --checkpoint_root. Serving other hosts, give it a
certificate (--tls_cert_file, --tls_key_file): it then serves TLS only, and clients verify it with
`SamplerClient(..., tls_ca_file=...)`.
"""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from jaxrl_agent import quiet

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/<name>.py file.", lock_config=True)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (0.0.0.0 to serve other hosts).")
_PORT = flags.DEFINE_integer("port", 9000, "gRPC port; 0 picks a free one.")
_TOKEN_FILE = flags.DEFINE_string("token_file", None, "File holding the shared token (default: $JAXRL_AGENT_TOKEN "
                                  "or $JAXRL_AGENT_TOKEN_FILE).")
_CHECKPOINT_ROOT = flags.DEFINE_string("checkpoint_root", None, "LoadCheckpoint reads only below this folder "
                                       "(unset: LoadCheckpoint is disabled).")
_TLS_CERT = flags.DEFINE_string("tls_cert_file", "", "PEM certificate (chain): serve TLS only.")
_TLS_KEY = flags.DEFINE_string("tls_key_file", "", "The certificate's PEM private key.")
_AWAIT_WEIGHTS = flags.DEFINE_bool("await_weights", False, "Answer sampling requests with UNAVAILABLE until weights "
                                   "arrive (StreamWeights or LoadCheckpoint): how the trainer starts its servers.")
flags.mark_flags_as_required(["config"])


def main(argv):
    del argv
    from jaxrl_agent import heap

    try:  # first, before the first computation (as the trainer does)
        heap.set_host_allocator(_CONFIG.value.get("host_allocator", "system"))
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    import asyncio
    import logging
    import sys

    # JetStream logs every decode step at INFO on the root logger.
    logging.getLogger().setLevel(logging.WARNING)

    from jaxrl_agent import auth, build, config_lib
    from jaxrl_agent.sampling import engine as engine_lib, server

    try:
        token = auth.load_token(_TOKEN_FILE.value)
        credentials = (auth.grpc_server_credentials(_TLS_CERT.value, _TLS_KEY.value)
                       if auth.check_tls_pair(_TLS_CERT.value, _TLS_KEY.value) else None)
    except auth.AuthError as err:
        raise SystemExit(f"error: {err}") from None
    _exit_with_parent()
    config = _CONFIG.value
    # The run's persistent compilation cache: servers of one run (and of later runs) share compiled
    # prefill and decode shapes instead of each compiling them while the learner waits.
    config_lib.enable_compilation_cache(config)
    # Laid out as the trainer lays out its own (in-process) engine's parameters: the same compiled
    # programs, so the two share persistent-cache entries.
    model_config, params = build.build_model(config, build.build_mesh(config))
    engine = build.build_engine(config, model_config, params, build.build_tokenizer(config))
    print(f"decode options: {engine.decode_choice.describe()}", file=sys.stderr, flush=True)
    default = engine_lib.SamplingParams(temperature=config.sampler.default_temperature)

    def ready(port):
        print(f"sampler server listening on {_HOST.value}:{port}", flush=True)

    asyncio.run(server.serve(engine, _HOST.value, _PORT.value, token=token, default_sampling=default, ready=ready,
                             pipeline_depth=config.sampler.pipeline_depth, checkpoint_root=_CHECKPOINT_ROOT.value,
                             credentials=credentials, await_weights=_AWAIT_WEIGHTS.value))


def _exit_with_parent() -> None:
    """A server the trainer started (JAXRL_AGENT_PARENT_PID set) exits when the trainer is gone,
    even after a SIGKILL of the trainer, instead of holding its port and memory as an orphan."""
    import os

    from jaxrl_agent import parent_watch

    parent_watch.exit_with_parent(int(os.environ.get("JAXRL_AGENT_PARENT_PID") or 0))


def run(argv=None) -> None:
    quiet.quiet_environment()
    from jaxrl_agent import config_lib

    config_lib.run_app(main, argv)
