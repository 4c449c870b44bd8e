"""Serves environments to trainers on other hosts.

  python launch/env_server.py --port 7100 --workers 8 [--host 0.0.0.0] [--import my_envs]

Trainers connect with `jaxrl_agent.envs.remote.RemoteEnvPool(host, port)`. Prints
`env server listening on HOST:PORT` once ready (`--port 0` picks a free port).
"""

import argparse
import asyncio
import importlib
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="Interface to bind (127.0.0.1: this host only).")
    parser.add_argument("--port", type=int, default=7100, help="TCP port; 0 picks a free one.")
    parser.add_argument("--workers", type=int, default=4, help="Environment worker processes.")
    parser.add_argument("--step_timeout_s", type=float, default=30.0, help="Per-step timeout before a worker is replaced.")
    parser.add_argument("--worker_memory_mb", type=int, default=4096, help="Address-space limit per worker.")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        help="Module that registers extra environments (repeatable).")
    args = parser.parse_args(argv)
    for module in args.imports:
        importlib.import_module(module)
    from jaxrl_agent.envs import pool, remote

    env_pool = pool.EnvPool(args.workers, step_timeout_s=args.step_timeout_s,
                            worker_memory_mb=args.worker_memory_mb, imports=args.imports)

    def ready(port):
        print(f"env server listening on {args.host}:{port}", flush=True)

    try:
        asyncio.run(remote.serve(env_pool, args.host, args.port, ready))
    except KeyboardInterrupt:
        pass
    finally:
        env_pool.close()


if __name__ == "__main__":
    sys.exit(main())
