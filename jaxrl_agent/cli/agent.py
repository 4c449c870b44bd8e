"""`jaxrl-agent agent` (or `python launch/agent.py`): a run's trained policy acting on tasks, with
the transcript of every episode.

  python launch/agent.py --checkpoint runs/chain_tiny --env chain --difficulty 6 --tasks 3
  python launch/agent.py --checkpoint runs/chain_tiny --context summarize --max_edits 8

--checkpoint is the run's workdir (its `checkpoints/` and `config.json`); the policy is the newest
checkpoint that restores, or --step. Episodes are the run's own (`agent.run`: the episode code,
template, tool format and context strategy of training), greedy unless --temperature; tasks are
held-out ones (task and episode seeds as the evaluation's, so a greedy transcript here is the one
the run's evaluation scored). --context and
--max_edits override the run's context strategy and its cap on edits (0 = none).
"""

from __future__ import annotations

import sys

from absl import flags, logging
from ml_collections import config_flags

from jaxrl_agent import quiet

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "The run's workdir (checkpoints/ and config.json).")
_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config file (default: <checkpoint>/config.json).",
                                          lock_config=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest that restores).")
_ENV = flags.DEFINE_string("env", None, "Environment (default: the run's env.name).")
_DIFFICULTY = flags.DEFINE_integer("difficulty", None, "Task level (default: the run's first training level).")
_TASKS = flags.DEFINE_integer("tasks", 3, "Held-out tasks to run.")
_CONTEXT = flags.DEFINE_string("context", None, "Context strategy (default: the run's rollout.context).")
_MAX_EDITS = flags.DEFINE_integer("max_edits", None, "Context edits per episode at most (0 = no limit; default: "
                                  "the run's rollout.context_max_edits).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = greedy).")
_TRANSCRIPTS = flags.DEFINE_bool("transcripts", True, "Print each episode's transcript.")
flags.mark_flags_as_required(["checkpoint"])


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from jaxrl_agent import agent, build, envs, evaluation, rollout

    try:
        with agent.load(_CHECKPOINT.value, config=_CONFIG.value, step=_STEP.value,
                        temperature=_TEMPERATURE.value) as deployment:
            config = deployment.config
            build.import_env_modules(config)
            name = _ENV.value or config.env.name
            env = envs.make(name, **build.env_kwargs(config))
            level = _DIFFICULTY.value if _DIFFICULTY.value is not None else int(
                build.split_list(config.env.train_difficulties)[0])
            tasks = [env.sample_task(envs.HELD_OUT_SEED_OFFSET + i, level) for i in range(_TASKS.value)]
            results = agent.run_many(
                tasks, deployment.sampler, lambda t: envs.make(t.env, **build.env_kwargs(config)),
                tokenizer=deployment.tokenizer, template=deployment.template, settings=deployment.settings,
                context=_CONTEXT.value, max_edits=_MAX_EDITS.value,
                seeds=[rollout.episode_seed(evaluation.EVAL_GREEDY_SEED, i, 0) for i in range(len(tasks))])
    except (FileNotFoundError, ValueError, build.ConfigError) as err:
        sys.exit(f"error: {err}")
    step = "initial parameters" if deployment.step is None else f"checkpoint step {deployment.step}"
    for task, result in zip(tasks, results):
        t = result.trajectory
        edits = sum("context_edit" in turn for turn in t.turns)
        if _TRANSCRIPTS.value:
            print(f"=== {task.id} ===\n{result.text()}\n")
        print(f"{task.id}: {'success' if result.success else 'failure'} ({t.finish_reason}), "
              f"{len(t.turns)} turns, {edits} context edits, longest context {t.longest_segment} tokens", flush=True)
    wins = sum(r.success for r in results)
    strategy = _CONTEXT.value or config.rollout.context
    print(f"{name} level {level}, {step}, context {strategy}: {wins}/{len(results)} succeeded", flush=True)


def run(argv=None) -> None:
    quiet.quiet_environment()
    from jaxrl_agent import config_lib

    config_lib.run_app(main, argv)
