"""`jaxrl-agent env-server`: environments served to trainers on other hosts.

  jaxrl-agent env-server --port 7100 --workers 8 [--host 127.0.0.1] [--import my_envs]

Trainers connect with `--config.env.service=host:port` (`jaxrl_agent.envs.remote`). Prints
`env server listening on HOST:PORT` once ready (`--port 0` picks a free port). Every request must carry the shared token ($JAXRL_AGENT_TOKEN, or --token_file): the server
refuses to start without one. Bound to another host's interface, give it a certificate
(`--tls_cert_file`, `--tls_key_file`): requests, the token among them, then travel encrypted, and
trainers verify the server with `--config.env.tls_ca_file`. Without TLS, bind to 127.0.0.1 (the
default) or an address on a private network.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys

from jaxrl_agent import quiet


def run(argv=None) -> int:
    quiet.quiet_environment()
    argv = list(argv) if argv is not None else None
    parser = argparse.ArgumentParser(prog=argv[0] if argv else None, description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="Interface to bind (127.0.0.1: this host only).")
    parser.add_argument("--port", type=int, default=7100, help="TCP port; 0 picks a free one.")
    parser.add_argument("--workers", type=int, default=4, help="Environment worker processes.")
    parser.add_argument("--step_timeout_s", type=float, default=30.0, help="Per-step timeout before a worker is replaced.")
    parser.add_argument("--worker_memory_mb", type=int, default=4096, help="Address-space limit per worker.")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        help="Module that registers extra environments (repeatable).")
    parser.add_argument("--token_file", default=None,
                        help="File holding the shared token (default: $JAXRL_AGENT_TOKEN or $JAXRL_AGENT_TOKEN_FILE).")
    parser.add_argument("--max_connections", type=int, default=1024, help="Connections served at once.")
    parser.add_argument("--idle_timeout_s", type=float, default=600.0, help="A connection idle this long is closed.")
    parser.add_argument("--request_threads", type=int, default=256,
                        help="Requests served at once (each waits on its episode's worker; more queue).")
    parser.add_argument("--request_timeout_s", type=float, default=300.0, help="Per-request deadline.")
    parser.add_argument("--tls_cert_file", default="", help="PEM certificate (chain): serve TLS only.")
    parser.add_argument("--tls_key_file", default="", help="The certificate's PEM private key.")
    parser.add_argument("--sandbox_isolation", default="bwrap", choices=("bwrap", "none"),
                        help="How the code sandbox isolates policy code (see jaxrl_agent/envs/sandbox.py).")
    args = parser.parse_args(argv[1:] if argv else None)
    import os

    from jaxrl_agent.envs import sandbox

    os.environ[sandbox.ISOLATION_ENV] = args.sandbox_isolation
    from jaxrl_agent import auth

    try:
        token = auth.load_token(args.token_file)
        ssl_context = (auth.server_ssl_context(args.tls_cert_file, args.tls_key_file)
                       if auth.check_tls_pair(args.tls_cert_file, args.tls_key_file) else None)
    except auth.AuthError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # one descriptor per connection
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    for module in args.imports:
        importlib.import_module(module)
    from jaxrl_agent.envs import pool, remote

    env_pool = pool.EnvPool(args.workers, step_timeout_s=args.step_timeout_s,
                            worker_memory_mb=args.worker_memory_mb, imports=args.imports)

    def ready(port):
        print(f"env server listening on {args.host}:{port}", flush=True)

    try:
        asyncio.run(remote.serve(env_pool, args.host, args.port, ready, token=token,
                                 max_connections=args.max_connections, idle_timeout_s=args.idle_timeout_s,
                                 request_timeout_s=args.request_timeout_s, ssl_context=ssl_context,
                                 request_threads=args.request_threads))
    except KeyboardInterrupt:
        pass
    finally:
        env_pool.close()
    return 0
