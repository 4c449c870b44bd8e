"""A stage list: runs in order, each from the previous one's final policy, on one global step.

GLM-4.5 / GLM-5 train in stages (reasoning RL, then agentic RL, then general RL), each distilling
from the previous stage's policy so that earlier skills are kept. Here `config.stages` names the
stages in order and `config.stage.<name>` holds each one's overrides, a partial config:

    config.stages = "sft,calculator,chain"
    config.stage.sft = ConfigDict({"rl": {"iterations": 0}})
    config.stage.calculator = ConfigDict({"sft": {"steps": 0}, "env": {"name": "calculator"}})
    config.stage.chain = ConfigDict({"sft": {"steps": 0}, "env": {"name": "chain"},
                                     "rl": {"distill_coef": 0.1}})   # distil from the calculator stage

Each stage is one run of the trainer (its own SFT when `sft.steps` > 0, then its RL) in
`workdir/stages/<i>_<name>`, with the base config and the stage's overrides:
  * it starts from the previous stage's final policy (`checkpoint.init_from`), so `rl.teacher`
    and `rl.reference` 'initial' are that policy;
  * its records continue the list's global step (`metrics.global_step_offset`: the previous
    stage's last global step, where its final policy was evaluated);
  * after it, that stage's final policy is evaluated on every environment any stage of the list
    uses (greedy, held-out, the stage's evaluation settings), so forgetting is visible:
    `workdir/metrics.jsonl` gets a 'stage_eval' record per stage with `eval/<env>/success` and
    `eval/<env>/pass@1/d<level>`.

Resume (`resume=True`): finished stages (their 'stage_eval' record is in workdir/metrics.jsonl) are
passed over; the stage that was running resumes from its own newest checkpoint, or starts over when
it had none.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable

import ml_collections

from jaxrl_agent.build import ConfigError

STAGES_DIR = "stages"


class StageError(ConfigError):
    """A stage list that cannot run (a stage without overrides, an override of no config field)."""


def stage_names(config) -> list[str]:
    return [name.strip() for name in str(config.stages).split(",") if name.strip()]


def _apply(node: ml_collections.ConfigDict, overrides, where: str) -> None:
    for key, value in overrides.items():
        if key not in node:
            raise StageError(f"{where}.{key}: the config has no field {key!r} (expected one of {sorted(node.keys())})")
        if isinstance(value, (ml_collections.ConfigDict, dict)):
            if not isinstance(node[key], ml_collections.ConfigDict):
                raise StageError(f"{where}.{key}: {key!r} is a value, not a section")
            _apply(node[key], value, f"{where}.{key}")
            continue
        try:
            node[key] = value
        except TypeError as err:
            raise StageError(f"{where}.{key}={value!r}: {err}") from None


def stage_configs(config, workdir: str) -> list[tuple[str, str, ml_collections.ConfigDict]]:
    """[(name, stage workdir, the stage's config)] of the list: the base config without its stage
    list, then the stage's overrides. Raises StageError naming a bad stage or override."""
    names = stage_names(config)
    if len(set(names)) != len(names):
        raise StageError(f"stages={config.stages!r}: a stage name appears twice")
    out = []
    for i, name in enumerate(names):
        if name not in config.stage:
            raise StageError(f"stages={config.stages!r}: stage {name!r} has no config.stage.{name} "
                             f"(defined: {sorted(config.stage.keys())})")
        stage = ml_collections.ConfigDict(config.to_dict())
        stage.stages, stage.stage = "", ml_collections.ConfigDict()
        _apply(stage, config.stage[name], f"stage.{name}")
        stage_dir = os.path.join(workdir, STAGES_DIR, f"{i}_{name}")
        stage.workdir = stage_dir
        out.append((name, stage_dir, stage))
    return out


def _records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a kill: the stage's records before it stand
    return out


def _has_checkpoint(stage_dir: str) -> bool:
    folder = os.path.join(stage_dir, "checkpoints")
    return os.path.isdir(folder) and any(name.isdigit() for name in os.listdir(folder))


def environment_levels(configs) -> dict[str, tuple[int, ...]]:
    """Every environment a stage trains on, with the evaluation levels of the last stage using it."""
    from jaxrl_agent import build

    out: dict[str, tuple[int, ...]] = {}
    for _, _, stage in configs:
        for name in build.env_mixture(stage):
            out[name] = tuple(int(x) for x in build.split_list(stage.env.eval_difficulties))
    return out


def evaluate_stage(stage_config, stage_dir: str, levels: dict[str, tuple[int, ...]]) -> dict[str, float]:
    """Greedy held-out success of a stage's final policy on every environment of the list:
    `eval/<env>/pass@1/d<level>`, `eval/<env>/success` (over its levels) and `eval/success` (the
    mean over environments)."""
    from jaxrl_agent import agent, build, envs, evaluation, rollout

    config = ml_collections.ConfigDict(stage_config.to_dict())
    config.checkpoint.init_from = ""  # its own checkpoint is restored
    kwargs = build.env_kwargs(config)
    environments = {name: envs.make(name, **kwargs) for name in levels}
    spec = evaluation.EvalSpec({name: (evaluation.levels_for(env, levels[name]),) * 2
                                for name, env in environments.items()}, config.eval.tasks_per_difficulty, 0)
    with agent.load(stage_dir, config=config) as deployment:
        results = evaluation.evaluate(deployment.sampler, lambda t: rollout.InProcessEnv(envs.make(t.env, **kwargs)),
                                      environments, deployment.tokenizer, deployment.template, spec,
                                      greedy=deployment.settings, sampled=deployment.settings)
    results.pop("eval/seconds", None)
    if len(levels) == 1:  # one environment: evaluation leaves its name out of the keys
        (name,) = levels
        results = {**{k.replace("eval/", f"eval/{name}/", 1): v for k, v in results.items()},
                   "eval/success": results["eval/success"]}
    return results


def run_stages(config, workdir: str, *, quiet: bool = False, objective=None, reward_fn: Callable | None = None,
               train: Callable[..., str] | None = None) -> str:
    """Runs the stage list of `config` in `workdir`; returns the path of workdir/metrics.jsonl."""
    from jaxrl_agent import build, checkpoint, metrics, trainer

    train = train or trainer.train_and_evaluate
    configs = stage_configs(config, workdir)
    for name, _, stage in configs:
        try:
            build.validate_config(stage, reward_fn_given=reward_fn is not None)
        except ConfigError as err:
            raise StageError(f"stage {name!r}: {err}") from None
    if not config.resume:
        checkpoint.check_workdir(workdir, resume=False)
        if os.path.isdir(os.path.join(workdir, STAGES_DIR)):
            raise ConfigError(f"workdir={workdir!r} already holds a stage list: pass --config.resume=True "
                                    "to continue it, or choose another --config.workdir")
    os.makedirs(workdir, exist_ok=True)
    writer = metrics.MetricsWriter(workdir, tensorboard=False, console=metrics.Console(enabled=not quiet))
    levels = environment_levels(configs)
    try:
        # This invocation's resolved config, as a single run writes it (on resume too: a list
        # resumed with other overrides records what its remaining stages run; each stage's own
        # folder keeps the config that stage ran with).
        writer.write_config(config)
        done = {r["stage_name"]: r for r in _records(writer.path) if r.get("stage") == "stage_eval"}
        offset, previous = 0, None
        for i, (name, stage_dir, stage) in enumerate(configs):
            if name in done:
                offset, previous = int(done[name]["global_step"]), stage_dir
                continue
            resume = _has_checkpoint(stage_dir)
            if not resume and os.path.isdir(stage_dir):
                shutil.rmtree(stage_dir)  # killed before its first checkpoint: it starts over
            stage.resume = resume
            stage.metrics.global_step_offset = offset
            if previous is not None:
                stage.checkpoint.init_from = previous
            writer.write("stage_start", i, {"stage_name": name, "resumed": resume, "workdir": stage_dir},
                         global_step=offset, console=f"stage {i + 1}/{len(configs)}: {name}"
                                                     f"{' (resumed)' if resume else ''} in {stage_dir}")
            path = train(stage, stage_dir, quiet=quiet, objective=objective, reward_fn=reward_fn)
            records = _records(path)
            offset = max((int(r.get("global_step", 0)) for r in records), default=offset)
            results = evaluate_stage(stage, stage_dir, levels)
            line = ", ".join(f"{env} {results[f'eval/{env}/success']:.3f}" for env in levels)
            writer.write("stage_eval", i, {"stage_name": name, **results}, global_step=offset,
                         console=f"stage {name} done: held-out success {line}")
            previous = stage_dir
    finally:
        writer.close()
    return writer.path
