"""`jaxrl-agent export-hf`: a run's latest policy as a Hugging Face folder.

  jaxrl-agent export-hf --config configs/calculator_tiny.py [--workdir runs/calculator_tiny] --out exported/

Restores the parameters of the latest checkpoint in `<workdir>/checkpoints` (the config's
`workdir` unless --workdir is given) and writes `config.json` and `model.safetensors` (sharded with
an index past --max_shard_mb), loadable by `transformers` and by `models.load_hf`. A run that
started from a Hugging Face folder (`checkpoint.hf_path`) also gets that folder's tokenizer files.
"""

from __future__ import annotations

import os
import shutil
import sys

from absl import flags, logging
from ml_collections import config_flags

from jaxrl_agent import quiet

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config file (with its overrides).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (default: the config's workdir).")
_OUT = flags.DEFINE_string("out", None, "Folder to write the Hugging Face checkpoint to.")
_MAX_SHARD_MB = flags.DEFINE_integer("max_shard_mb", 0, "Shard the safetensors past this size (0: one file).")
flags.mark_flags_as_required(["config", "out"])

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def export(config, workdir: str, out: str, *, max_shard_bytes: int | None = None) -> dict:
    """Writes the latest checkpoint's policy to `out`; returns what was written."""
    from jaxrl_agent import build, checkpoint, models

    checkpoints = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(checkpoints) or not os.listdir(checkpoints):
        raise FileNotFoundError(f"workdir={workdir!r} has no checkpoints to export (expected {checkpoints}/<step>)")
    model_config, params = build.build_model(config)
    checkpointer = checkpoint.Checkpointer(checkpoints, keep=config.checkpoint.keep)
    try:
        run_state = checkpointer.latest()
        if run_state is None:
            raise FileNotFoundError(f"no checkpoint in {checkpoints} restores: {checkpointer.skipped}")
        params = checkpointer.restore_params(params)
        step = checkpointer.step
    finally:
        checkpointer.close()
    models.save_hf(out, model_config, params, max_shard_bytes=max_shard_bytes)
    copied = []
    source = config.checkpoint.hf_path
    for name in TOKENIZER_FILES if source else ():
        if os.path.exists(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), os.path.join(out, name))
            copied.append(name)
    return {"out": out, "step": step, "stage": run_state.stage if run_state else None,
            "version": run_state.version if run_state else None, "params": models.count_params(params),
            "tokenizer_files": copied}


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax's INFO lines per restored array
    config = _CONFIG.value
    try:
        written = export(config, _WORKDIR.value or config.workdir, _OUT.value,
                         max_shard_bytes=_MAX_SHARD_MB.value * 2**20 or None)
    except (FileNotFoundError, ValueError) as err:  # no checkpoint; shapes that are not the config's model
        sys.exit(f"error: {err}")
    print(f"exported checkpoint step {written['step']} ({written['stage']}, policy version {written['version']}, "
          f"{written['params']} parameters) to {written['out']}", flush=True)


def run(argv=None) -> None:
    quiet.quiet_environment()
    from jaxrl_agent import config_lib

    config_lib.run_app(main, argv)
