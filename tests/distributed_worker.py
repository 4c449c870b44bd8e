"""One process of a `jax.distributed` job on this machine (tests/test_distributed.py): K RL updates
through `learner.rl_update` on this process's share of a fixed set of trajectories; process 0 writes
the final parameters.

  python tests/distributed_worker.py --processes N --process_id I --local_devices D --port P --out F
"""

import argparse
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--processes", type=int, default=1)
parser.add_argument("--process_id", type=int, default=0)
parser.add_argument("--local_devices", type=int, default=8)
parser.add_argument("--port", type=int, default=0)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--out", required=True)
args = parser.parse_args()
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.local_devices}"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
if args.processes > 1:
    jax.distributed.initialize(f"127.0.0.1:{args.port}", args.processes, args.process_id)

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxrl_agent import envs, learner, models, rollout, sharding, tokenizer as tok  # noqa: E402

TOKENIZER = tok.CharTokenizer()
CONFIG = models.ModelConfig(vocab_size=TOKENIZER.vocab_size, num_layers=2, hidden_size=32, num_heads=4,
                            num_kv_heads=2, head_dim=8)

env = envs.make("calculator")
expert = envs.expert_policy("calculator")
trajectories = [rollout.expert_trajectory(env, env.sample_task(s, 1 + s % 2), expert, TOKENIZER, tok.CHATML)
                for s in range(12)]
rng = np.random.RandomState(0)
trajectories = [dataclasses.replace(t, advantage=float(rng.randn()),
                                    sampler_logprobs=np.where(t.loss_mask == 1, -rng.rand(t.length) - 0.5,
                                                              0).astype(np.float32),
                                    policy_version=np.where(t.loss_mask == 1, 0, -1).astype(np.int32))
                for t in trajectories]
mine = trajectories[jax.process_index()::jax.process_count()]  # this process's share

mesh = sharding.make_mesh(1, -1, 1)  # every device of every process
params = sharding.place_params(models.init_params(CONFIG, jax.random.PRNGKey(0)), mesh)
optimizer = learner.make_optimizer(learning_rate=1e-3, warmup_steps=1, total_steps=100)
state = learner.init_state(params, optimizer)
initial = [sharding.to_host(x) for x in jax.tree.leaves(state.params)]
step_fn, _ = learner.jit_train_step(learner.make_train_step(CONFIG, optimizer), state, mesh)
for _ in range(args.steps):
    state, metrics = learner.rl_update(state, step_fn, mine, rng=np.random.RandomState(1), minibatches=1,
                                       row_length=128, row_multiple=learner.row_multiple_for(mesh),
                                       target_multiple=16, mesh=mesh)
leaves = [sharding.to_host(x) for x in jax.tree.leaves(state.params)]
if jax.process_index() == 0:
    np.savez(args.out, *leaves, loss=np.float64(metrics["loss"]),
             moved=np.float64(max(float(np.max(np.abs(a - b))) for a, b in zip(leaves, initial))))
print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices of "
      f"{jax.device_count()}, loss {metrics['loss']:.6f}", flush=True)
