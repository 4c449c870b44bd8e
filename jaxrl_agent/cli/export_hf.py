"""`jaxrl-agent export-hf` (or `python launch/export_hf.py`): a run's policy as a Hugging Face folder.

  python launch/export_hf.py --workdir runs/calculator_tiny [--step N] --out exported/
  jaxrl-agent export-hf --config configs/calculator_tiny.py [--workdir runs/calculator_tiny] --out exported/

Restores the parameters of a checkpoint in `<workdir>/checkpoints` (the newest that restores, or
step N) and writes `config.json` and `model.safetensors` (sharded with an index past
--max_shard_mb), loadable by `transformers` and by `models.load_hf`. The run's config comes from
--config, else from `<workdir>/config.json` (the resolved config the run wrote). A run with a
Hugging Face tokenizer also gets its tokenizer files — tokenizer.json, tokenizer_config.json (with
the chat template), generation_config.json — from the tokenizer's folder (`tokenizer.path`, else
`checkpoint.hf_path`). `checkpoint.export_hf=True` writes one at every save, to
`<workdir>/hf/<step>`.
"""

from __future__ import annotations

import os
import shutil
import sys

from absl import flags, logging
from ml_collections import config_flags

from jaxrl_agent import config_lib, quiet

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config file (with its overrides); default: "
                                          "<workdir>/config.json.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (default: the config's workdir).")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint step to export (default: the newest that restores).")
_OUT = flags.DEFINE_string("out", None, "Folder to write the Hugging Face checkpoint to.")
_MAX_SHARD_MB = flags.DEFINE_integer("max_shard_mb", 0, "Shard the safetensors past this size (0: one file).")
flags.mark_flags_as_required(["out"])

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


def export_at_save(workdir: str, step: int, config, model_config, params) -> str | None:
    """`checkpoint.export_hf`: the checkpoint of `step` as `<workdir>/hf/<step>`. Returns None, or
    the error when the folder could not be written (the checkpoint itself is kept either way)."""
    import os

    try:
        write_folder(os.path.join(workdir, "hf", str(step)), config, model_config, params)
    except (OSError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def write_folder(out: str, config, model_config, params, *, max_shard_bytes: int | None = None) -> list[str]:
    """`params` as a Hugging Face folder with the run's tokenizer files; the files copied."""
    from jaxrl_agent import build, models

    models.save_hf(out, model_config, params, max_shard_bytes=max_shard_bytes)
    copied = []
    source = build.tokenizer_folder(config)
    for name in TOKENIZER_FILES if source else ():
        if os.path.exists(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), os.path.join(out, name))
            copied.append(name)
    return copied


def export(config, workdir: str, out: str, *, step: int | None = None, max_shard_bytes: int | None = None) -> dict:
    """Writes a checkpoint's policy (the newest that restores, or `step`) to `out`; returns what was written."""
    from jaxrl_agent import build, checkpoint, models

    model_config, params = build.build_model(config)
    params, step, run_state = checkpoint.restore_policy(os.path.join(workdir, "checkpoints"), params,
                                                        keep=config.checkpoint.keep, step=step)
    copied = write_folder(out, config, model_config, params, max_shard_bytes=max_shard_bytes)
    return {"out": out, "step": step, "stage": run_state.stage if run_state else None,
            "version": run_state.version if run_state else None, "params": models.count_params(params),
            "tokenizer_files": copied}


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax's INFO lines per restored array
    try:
        config = _CONFIG.value
        if config is None:
            if not _WORKDIR.value:
                raise FileNotFoundError("pass --workdir (its config.json is the run's config) or --config")
            config = config_lib.run_config(_WORKDIR.value)
        written = export(config, _WORKDIR.value or config.workdir, _OUT.value, step=_STEP.value,
                         max_shard_bytes=_MAX_SHARD_MB.value * 2**20 or None)
    except (FileNotFoundError, ValueError) as err:  # no checkpoint; shapes that are not the config's model
        sys.exit(f"error: {err}")
    print(f"exported checkpoint step {written['step']} ({written['stage']}, policy version {written['version']}, "
          f"{written['params']} parameters) to {written['out']}", flush=True)


def run(argv=None) -> None:
    quiet.quiet_environment()
    from jaxrl_agent import config_lib

    config_lib.run_app(main, argv)
