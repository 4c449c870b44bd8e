"""`jaxrl-agent train`: the training job, on a laptop, a GPU host or every host of a TPU pod slice.

  jaxrl-agent train --config configs/calculator_tiny.py [--config.a.b=value ...] [--mode smoke]

Multi-host: run the same command on every host with --coordinator_address, --num_processes and
--process_id (or, on Cloud TPU, where jax.distributed finds its peers itself, with --distributed).
"""

from __future__ import annotations

from absl import flags, logging
from ml_collections import config_flags

from jaxrl_agent import quiet

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/<name>.py file.", lock_config=True)
_MODE = flags.DEFINE_enum("mode", "train", ["train", "smoke"],
                          "train: SFT cold start then RL (jaxrl_agent.trainer); smoke: build the model, one forward.")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() first.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes (multi-host).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (multi-host).")
_HEARTBEAT = flags.DEFINE_integer("heartbeat_timeout_s", 30,
                                  "Multi-host: a process whose peer stops answering for this long stops too.")
flags.mark_flags_as_required(["config"])


def main(argv):
    del argv
    from jaxrl_agent import heap

    # First, before the first computation (JAX reads its CPU dispatch setting when it builds the client).
    try:
        heap.set_host_allocator(_CONFIG.value.get("host_allocator", "system"))
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    import jax

    if _DISTRIBUTED.value or _COORDINATOR.value:
        # Collectives between CPU processes (tests, launch/local_cluster.py) go through gloo; GPU
        # and TPU processes use their own interconnect whatever this says.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                                   heartbeat_timeout_seconds=_HEARTBEAT.value)
    # Quiet orbax / absl INFO chatter: the run's own progress is printed to stdout.
    logging.set_verbosity(logging.WARNING)
    from jaxrl_agent import config_lib

    # JAX's persistent compilation cache: a second run (or a resume) skips recompiling.
    config_lib.enable_compilation_cache(_CONFIG.value)
    if _MODE.value == "smoke":
        from jaxrl_agent import build

        summary = build.smoke_forward(_CONFIG.value)
        print("forward pass ok:", summary, flush=True)
        return
    from jaxrl_agent import build, trainer

    try:
        path = trainer.train_and_evaluate(_CONFIG.value)
    except (build.ConfigError, trainer.RunStopped) as err:  # a bad value, a used workdir, a run that stopped
        raise SystemExit(f"error: {err}") from None
    if jax.process_index() == 0:
        print(f"metrics written to {path}", flush=True)


def run(argv=None) -> None:
    quiet.quiet_environment()
    from jaxrl_agent import config_lib

    config_lib.run_app(main, argv)
