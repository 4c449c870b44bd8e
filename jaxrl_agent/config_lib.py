"""Loading `configs/<name>.py` files and checking `--config.a.b=value` overrides.

ml-collections reports a misspelled override as a bare `AttributeError` deep inside flag parsing;
`check_overrides` runs first and names the bad key, the config file and the closest valid keys.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from typing import Sequence

import ml_collections


class ConfigOverrideError(ValueError):
    """An override names a field the config does not have."""


def load_config(path: str) -> ml_collections.ConfigDict:
    """Calls `get_config()` of a config file (an optional ':arg' suffix is passed to it)."""
    file, _, arg = path.partition(":")
    if not os.path.exists(file):
        raise FileNotFoundError(f"config file {file!r} does not exist")
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(file))[0], file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {file!r} has no get_config()")
    return module.get_config(arg) if arg else module.get_config()


def _all_keys(config, prefix=""):
    for key, value in config.items():
        name = f"{prefix}{key}"
        yield name
        if isinstance(value, ml_collections.ConfigDict):
            yield from _all_keys(value, name + ".")


def override_keys(argv: Sequence[str], flag: str = "config") -> tuple[str | None, list[str]]:
    """(config path, ['a.b', ...]) from a command line."""
    path = None
    keys = []
    args = list(argv)
    for i, arg in enumerate(args):
        if arg == f"--{flag}" and i + 1 < len(args):
            path = args[i + 1]
        elif arg.startswith(f"--{flag}="):
            path = arg.split("=", 1)[1]
        elif arg.startswith(f"--{flag}."):
            keys.append(arg[len(flag) + 3:].split("=", 1)[0])
    return path, keys


def check_overrides(argv: Sequence[str], flag: str = "config") -> None:
    """Raises ConfigOverrideError naming every override key the config file does not define."""
    path, keys = override_keys(argv, flag)
    if path is None or not keys:
        return
    config = load_config(path)
    valid = list(_all_keys(config))
    for key in keys:
        if key in valid:
            continue
        close = difflib.get_close_matches(key, valid, n=3)
        hint = f"; did you mean {', '.join('--' + flag + '.' + c for c in close)}?" if close else ""
        raise ConfigOverrideError(
            f"--{flag}.{key}: {path} has no field {key!r}{hint} (valid top-level fields: "
            f"{sorted(config.keys())})"
        )


def run_app(main, argv: Sequence[str] | None = None) -> None:
    """`absl.app.run(main)` after checking `--config.*` overrides, so a misspelled key stops the
    program with one clear line instead of a traceback from inside flag parsing."""
    import sys

    from absl import app

    argv = list(sys.argv if argv is None else argv)
    try:
        check_overrides(argv)
    except (ConfigOverrideError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    app.run(main, argv=argv)


def enable_compilation_cache(config) -> str | None:
    """Turns on JAX's persistent compilation cache in `config.compilation_cache_dir` ('' = off;
    the JAX_COMPILATION_CACHE_DIR environment variable, when set, wins). Every process of a run
    (the trainer and its sampler servers) uses the same folder, so a shape compiled once — by an
    earlier run, or by another process — is loaded instead of compiled. Returns the folder used."""
    import os

    import jax

    cache_dir = config.get("compilation_cache_dir", "")
    if not cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ.get("JAX_COMPILATION_CACHE_DIR") or None
    cache_dir = os.path.expanduser(cache_dir)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return cache_dir
