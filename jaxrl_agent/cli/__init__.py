"""The `jaxrl-agent` command: one entry point, a subcommand per job.

  jaxrl-agent train --config configs/calculator_tiny.py [--config.a.b=value ...] [--mode smoke]
  jaxrl-agent sampler-server --config <config> --port 9000
  jaxrl-agent env-server --port 7100 --workers 8
  jaxrl-agent export-hf --config <config> [--workdir W] --out <folder>
  jaxrl-agent agent --checkpoint <workdir> [--env E] [--context summarize]
  jaxrl-agent plot <workdir>

`launch/tpu_run.py`, `launch/sampler_server.py` and `launch/env_server.py` are the same commands
for a checkout (`python launch/tpu_run.py --config ...`); `python -m jaxrl_agent.cli <subcommand>`
works wherever the package is installed (the trainer starts sampler servers that way).
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

# subcommand -> (module with `run(argv)`, one-line description)
COMMANDS = {
    "train": ("jaxrl_agent.cli.train", "SFT cold start, then RL, as the config says (or --mode smoke)"),
    "sampler-server": ("jaxrl_agent.cli.sampler_server", "a JetStream sampling server for a config"),
    "env-server": ("jaxrl_agent.cli.env_server", "environments served to trainers on other hosts"),
    "export-hf": ("jaxrl_agent.cli.export_hf", "a run's latest policy as a Hugging Face folder"),
    "agent": ("jaxrl_agent.cli.agent", "a run's policy acting on held-out tasks, with transcripts"),
    "plot": ("jaxrl_agent.plot", "a run's curves on one page (PNG)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: jaxrl-agent <command> [flags]   (jaxrl-agent <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {description}" for name, (_, description) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(usage())
        return 0 if len(argv) >= 2 else 2
    name = argv[1]
    if name not in COMMANDS:
        print(f"jaxrl-agent: unknown command {name!r}; expected one of {', '.join(COMMANDS)}\n\n{usage()}",
              file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.run([f"jaxrl-agent {name}", *argv[2:]]) or 0
