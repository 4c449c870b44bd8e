"""Loading `configs/<name>.py` files and checking `--config.a.b=value` overrides.

ml-collections reports a misspelled override as a bare `AttributeError` deep inside flag parsing;
`check_overrides` runs first and names the bad key, the config file and the closest valid keys.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
import re
from collections.abc import Sequence

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


def _did_you_mean(key: str, valid: Sequence[str], prefix: str) -> str:
    """'; did you mean --config.a, ...?' naming the (at most three) valid keys closest to `key`,
    each written with `prefix`; '' when none is close."""
    close = difflib.get_close_matches(key, valid, n=3)
    return f"; did you mean {', '.join(prefix + c for c in close)}?" if close else ""


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


def run_config(workdir: str) -> ml_collections.ConfigDict:
    """The resolved config a run wrote to `<workdir>/config.json`."""
    import json

    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"workdir={workdir!r} has no config.json: pass the run's --config")
    with open(path) as f:
        return ml_collections.ConfigDict(json.load(f))


def check_overrides(argv: Sequence[str], flag: str = "config", config=None) -> None:
    """Raises ConfigOverrideError naming every override key the config file does not define.
    `stage.<name>.<field>` of a defined stage is valid for any field of the base config
    (`stage_field_overrides`). `config`: the config file's, when the caller has loaded it."""
    path, keys = override_keys(argv, flag)
    if path is None or not keys:
        return
    config = load_config(path) if config is None else config
    valid = list(_all_keys(config))
    for key in keys:
        if key in valid or _stage_field(config, key, flag) is not None:
            continue
        raise ConfigOverrideError(
            f"--{flag}.{key}: {path} has no field {key!r}{_did_you_mean(key, valid, f'--{flag}.')} (valid top-level fields: "
            f"{sorted(config.keys())})"
        )


def _stage_field(config, key: str, flag: str = "config") -> tuple[str, str] | None:
    """(stage name, field path) when `key` is `stage.<name>.<field path>` of a stage `config.stage`
    defines and a field of the base config (not `stages` or `stage`) that the stage's overrides do not
    list; None when `key` is not of that form. Raises ConfigOverrideError for a field the base
    config does not have."""
    parts = key.split(".")
    if len(parts) < 3 or parts[0] != "stage" or "stage" not in config or parts[1] not in config.stage:
        return None
    name, field = parts[1], ".".join(parts[2:])
    if field in set(_all_keys(config.stage[name])):
        return None  # listed: ml-collections sets it
    base = [k for k in _all_keys(config) if k.split(".")[0] not in ("stage", "stages")]
    if parts[2] in ("stage", "stages") or field not in base:
        raise ConfigOverrideError(f"--{flag}.{key}: stage {name!r} overrides fields of the base config, "
                                  f"which has no field {field!r}{_did_you_mean(field, base, f'--{flag}.stage.{name}.')}")
    if isinstance(_get(config, field), ml_collections.ConfigDict):
        raise ConfigOverrideError(f"--{flag}.{key}: {field!r} is a section; expected one of its fields")
    return name, field


def _get(config, path: str):
    for part in path.split("."):
        config = config[part]
    return config


def _parse_like(key: str, raw: str, like):
    """`raw` (a command-line value) as the type of the base config's value `like`."""
    try:
        if isinstance(like, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if isinstance(like, int):
            return int(raw)
        if isinstance(like, float):
            return float(raw)
        if isinstance(like, str):
            return raw
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        kind = type(like).__name__ if like is not None else "a Python literal"
        raise ConfigOverrideError(f"{key}={raw!r}: expected {kind}, like the base config's {like!r}") from None


def stage_field_overrides(argv: Sequence[str], flag: str = "config",
                          config=None) -> tuple[list[str], dict[str, str]]:
    """Splits `--config.stage.<name>.<field>=v` overrides of a field the base config has and stage
    <name>'s overrides do not list (ml-collections can set only fields that exist) from a command
    line: (the rest of argv, {'stage.<name>.<field>': 'v'}). `apply_stage_field_overrides` adds
    them to the parsed config. Both the `=v` and the ` v` forms are taken. `config`: the config
    file's, when the caller has loaded it."""
    path, keys = override_keys(argv, flag)
    args = list(argv)
    if path is None or not any(k.startswith("stage.") for k in keys):
        return args, {}
    config = load_config(path) if config is None else config
    rest, found = [], {}
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, value = arg[len(flag) + 3:].partition("=") if arg.startswith(f"--{flag}.stage.") else ("", "", "")
        field = _stage_field(config, key, flag) if key else None
        if field is not None:
            if not eq:
                if i + 1 >= len(args):
                    raise ConfigOverrideError(f"--{flag}.{key}: expected a value")
                value, i = args[i + 1], i + 1
            _parse_like(f"--{flag}.{key}", value, _get(config, field[1]))  # a bad value fails here, named
            found[key] = value
        else:
            rest.append(arg)
        i += 1
    return rest, found


def apply_overrides(config: ml_collections.ConfigDict, argv: Sequence[str],
                    flag: str = "config") -> ml_collections.ConfigDict:
    """A copy of `config` with a command line's `--config.a.b=v` (or `--config.a.b v`) overrides
    applied, each value parsed as the type of the field it replaces — what the launcher's flag
    parsing does, for a config already loaded (a benchmark's arms, a notebook's variants). A key
    the config does not define raises ConfigOverrideError naming it and the closest valid keys; a
    value of the wrong type raises it naming the value. Other arguments are ignored."""
    valid = list(_all_keys(config))
    result = ml_collections.ConfigDict(config.to_dict())
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith(f"--{flag}."):
            continue
        key, eq, raw = arg[len(flag) + 3:].partition("=")
        if not eq:
            if i >= len(args):
                raise ConfigOverrideError(f"--{flag}.{key}: expected a value")
            raw, i = args[i], i + 1
        if key not in valid:
            raise ConfigOverrideError(f"--{flag}.{key}: the config has no field {key!r}"
                                      f"{_did_you_mean(key, valid, f'--{flag}.')}")
        if isinstance(_get(result, key), ml_collections.ConfigDict):
            raise ConfigOverrideError(f"--{flag}.{key}: {key!r} is a section; expected one of its fields")
        section, _, field = key.rpartition(".")
        node = _get(result, section) if section else result
        node[field] = _parse_like(f"--{flag}.{key}", raw, node[field])
    return result


def apply_stage_field_overrides(config: ml_collections.ConfigDict, overrides: dict[str, str]) -> None:
    """Adds each 'stage.<name>.<field>': 'v' of `stage_field_overrides` to `config.stage.<name>`,
    parsed as the type of the base config's `<field>`; the config stays locked if it was."""
    locked = config.is_locked
    config.unlock()
    for key, raw in overrides.items():
        name, field = _stage_field(config, key)
        value = _parse_like(key, raw, _get(config, field))
        node = config.stage[name]
        *sections, last = field.split(".")
        for section in sections:
            if section not in node:
                node[section] = ml_collections.ConfigDict()
            node = node[section]
        node[last] = value
    if locked:
        config.lock()


def run_app(main, argv: Sequence[str] | None = None) -> None:
    """`absl.app.run(main)` after checking `--config.*` overrides, so a misspelled key stops the
    program with one clear line instead of a traceback from inside flag parsing. Overrides of a
    stage's field that its overrides do not list (`stage_field_overrides`) are added to the parsed
    config before `main` runs."""
    import sys

    from absl import app, flags

    argv = list(sys.argv if argv is None else argv)
    try:
        path, keys = override_keys(argv)
        config = load_config(path) if path is not None and keys else None  # loaded once for both checks
        check_overrides(argv, config=config)
        argv, stage_fields = stage_field_overrides(argv, config=config)
    except (ConfigOverrideError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    sys.argv = argv  # ml-collections reads its overrides from sys.argv, not from app.run's argv

    def main_with_stage_fields(args):
        if stage_fields:
            try:
                apply_stage_field_overrides(flags.FLAGS["config"].value, stage_fields)
            except ConfigOverrideError as err:
                sys.exit(f"error: {err}")
        return main(args)

    app.run(main_with_stage_fields, argv=argv)


# Shorter compilations cost little next to a start; loading a stored one took 0.04-0.09 s (2 cores).
MIN_CACHED_COMPILE_SECONDS = 0.5


def enable_compilation_cache(config) -> str | None:
    """Turns on JAX's persistent compilation cache in `config.compilation_cache_dir` ('' = off;
    the JAX_COMPILATION_CACHE_DIR environment variable, when set, wins). Every process of a run
    (the trainer and its sampler servers) uses the same folder, so a shape compiled once — by an
    earlier run, or by another process — is loaded instead of compiled. Returns the folder used.

    Programs that compiled in at least `MIN_CACHED_COMPILE_SECONDS` are stored, whichever way the
    folder was given (JAX's own default is 1 s: the sampler's prefill and extend shapes, 0.7-1 s
    each on 2 cores, were compiled again at every start); JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS,
    when set, wins."""
    import os

    import jax

    cache_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not cache_dir:
        cache_dir = config.get("compilation_cache_dir", "")
        if not cache_dir:
            return None
        cache_dir = os.path.expanduser(cache_dir)
        jax.config.update("jax_compilation_cache_dir", cache_dir)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_CACHED_COMPILE_SECONDS)
    return cache_dir


_ASSIGNMENT = re.compile(r"^\s*config\.([\w.]+)\s*=\s*(.*?)\s*(?:#\s*(.*))?$")


def reference_markdown(path: str) -> str:
    """The configuration reference of a config file, as Markdown: one table per section, each key
    with its value and the comment the file gives it (on its line, or the comment lines above it).
    docs/config.md is this for configs/calculator_tiny.py (a test keeps the two equal)."""
    config = load_config(path)
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    sections: dict[str, list[tuple[str, str, str]]] = {}
    notes: dict[str, str] = {}
    above: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        match = _ASSIGNMENT.match(line) if stripped.startswith("config.") else None
        if match is None:
            above = []
            continue
        key, value_source, comment = match.groups()
        section, _, field = key.rpartition(".")
        if value_source.startswith("ml_collections.ConfigDict("):
            sections.setdefault(key, [])
            if above:
                notes[key] = " ".join(above)
            above = []
            continue
        value = config
        for part in key.split("."):
            value = value[part]
        meaning = " ".join([*above, comment or ""]).strip()
        sections.setdefault(section, []).append((field, repr(value), meaning))
        above = []
    shown = os.path.join(os.path.basename(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    out = [f"# Configuration reference (`{shown}`)", "",
           ("Every key of the embedded default, its value there and what it does. Override any of them on the "
            "command line (`--config.section.key=value`) or in Python (`config.section.key = value`). Generated "
            "from the config file's comments by `jaxrl_agent.config_lib.reference_markdown`."), ""]
    for section, rows in sections.items():
        out += [f"## `{section or 'top level'}`", ""]
        if section in notes:
            out += [notes[section], ""]
        out += ["| key | default | meaning |", "|---|---|---|"]
        out += [f"| `{(section + '.') if section else ''}{field}` | `{value}` | {meaning.replace('|', '/')} |"
                for field, value, meaning in rows]
        out.append("")
    return "\n".join(out)
