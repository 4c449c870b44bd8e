"""An environment worker process: `python -m jaxrl_agent.envs.worker [--memory_mb N] [--import M ...]`.

Reads one JSON request per line on stdin, writes one JSON reply per line on the original stdout
(the environments' own prints are sent to stderr so they cannot corrupt the protocol), and exits at
end of input, or within a second of the process that started it dying (`parent_watch`: a worker
stuck in a hanging step does not outlive a SIGKILLed pool). Started and supervised by `EnvPool`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback


def _handle(request: dict, episodes: dict) -> dict:
    from jaxrl_agent.envs import api

    op = request.get("op")
    if op == "reset":
        for module in request.get("imports", ()):
            importlib.import_module(module)
        old = episodes.pop(request["episode"], None)
        if old is not None:
            old.close()
        env = api.make(request["env"], **request.get("env_kwargs", {}))
        observation = env.reset(api.Task.from_dict(request["task"]), request.get("seed", 0))
        for action in request.get("replay", ()):
            env.step(action)
        episodes[request["episode"]] = env
        return {"ok": observation.to_dict()}
    if op == "step":
        env = episodes.get(request["episode"])
        if env is None:
            return {"error": f"unknown episode {request['episode']!r}", "kind": "service"}
        step = env.step(request["action"])
        if step.done:
            episodes.pop(request["episode"]).close()
        return {"ok": step.to_dict()}
    if op == "close":
        env = episodes.pop(request["episode"], None)
        if env is not None:
            env.close()
        return {"ok": None}
    if op == "ping":
        return {"ok": os.getpid()}
    return {"error": f"unknown op {op!r}", "kind": "service"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory_mb", type=int, default=0)
    parser.add_argument("--import", dest="imports", action="append", default=[])
    parser.add_argument("--parent_pid", type=int, default=0, help="Exit when this process (the pool's) dies.")
    args = parser.parse_args(argv)
    from jaxrl_agent import parent_watch

    parent_watch.exit_with_parent(args.parent_pid, exit_code=1)
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    if args.memory_mb:
        import resource

        limit = args.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    for module in args.imports:
        importlib.import_module(module)
    import jaxrl_agent.envs  # noqa: F401 - registers the built-in environments

    episodes: dict = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = _handle(request, episodes)
        except MemoryError:
            os._exit(3)  # the pool sees a dead worker (env_crash) and starts a fresh one
        except Exception as err:  # noqa: BLE001 - an environment bug ends that episode, not the worker
            episodes.pop(request.get("episode"), None)
            reply = {"error": f"{type(err).__name__}: {err}", "kind": "env",
                     "traceback": traceback.format_exc(limit=5)}
        protocol.write(json.dumps(reply, default=str) + "\n")


if __name__ == "__main__":
    main()
