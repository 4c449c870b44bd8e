"""The embedded CPU default: a ~0.8M-parameter Llama-style agent on the calculator task.

Run:
  jaxrl-agent train --config configs/calculator_tiny.py
  jaxrl-agent train --config configs/calculator_tiny.py --config.model.num_layers=2

4 layers, width 128, 4 heads, MLP 512: a size that learns calculator tool use on 2 CPU cores in
minutes (the measured runs are in benchmarks/RESULTS.md). Every key: docs/config.md.
"""

import ml_collections

from jaxrl_agent import tokenizer


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # PRNG seed for parameter init and everything downstream.
    config.workdir = "runs/calculator_tiny"  # Where checkpoints and metrics go.
    config.resume = False  # Continue from the latest checkpoint in workdir/checkpoints.
    # A stage list, in order ('' = one run: SFT, then RL): each name's overrides are
    # config.stage.<name>, a partial config (e.g. {"env": {"name": "chain"}, "sft": {"steps": 0}});
    # each stage is a run of its own in workdir/stages/<i>_<name>, starting from the previous
    # stage's final policy, on one global step. See configs/stages_tiny.py.
    config.stages = ""
    config.stage = ml_collections.ConfigDict()
    # JAX's persistent compilation cache for the launcher ('' = off): later runs skip compiling.
    config.compilation_cache_dir = "~/.cache/jaxrl_agent/xla"
    # The launcher's C heap: 'reuse' keeps what glibc's malloc frees for the next request and runs
    # CPU computations on the calling thread (XLA:CPU's per-step temporary buffers are otherwise
    # unmapped and faulted in again each step: 16-22% of the learner and SFT steps on 2 cores);
    # 'system' = the C library's and JAX's defaults. No effect where the C library is not glibc.
    config.host_allocator = "reuse"

    config.tokenizer = ml_collections.ConfigDict()
    config.tokenizer.kind = "char"  # 'char' (built in, no files) or 'hf' (a tokenizer.json).
    config.tokenizer.path = ""  # tokenizer.json or its folder, for kind='hf'; '' = the checkpoint folder.
    # Turn template: 'chatml' or 'llama3' (built in), or 'model': the tokenizer folder's own Jinja
    # chat_template (tokenizer_config.json), rendered as transformers does.
    config.tokenizer.template = "chatml"
    # How the policy sees tools, calls and results: 'env' (the environments' own protocol, tools
    # in the system prompt), 'qwen3' (<tools> block, <tool_call> JSON, <tool_response> in a user
    # turn) or 'llama3.1' (JSON calls, ipython results); the model formats need template='model'.
    config.tokenizer.tool_format = "env"

    config.model = ml_collections.ConfigDict()
    config.model.architecture = "llama"  # 'llama', 'qwen2' or 'qwen3' (Hugging Face model_type).
    # Derived: the built-in character tokenizer's vocabulary.
    config.model.vocab_size = tokenizer.CharTokenizer().vocab_size
    config.model.hidden_size = 128  # Model width H.
    config.model.intermediate_size = 512  # SwiGLU hidden width.
    config.model.num_layers = 4  # Decoder blocks.
    config.model.num_heads = 4  # Query heads.
    config.model.num_kv_heads = 4  # Key/value heads (GQA when fewer than num_heads).
    config.model.head_dim = 32  # Per-head width; hidden_size / num_heads here.
    config.model.rope_theta = 10000.0  # RoPE base.
    config.model.rms_norm_eps = 1e-6  # RMSNorm epsilon.
    config.model.tie_word_embeddings = True  # Output projection = input embedding (saves V*H params).
    config.model.attention_bias = False  # q/k/v bias (Qwen2 has it).
    config.model.qk_norm = False  # RMSNorm on q and k per head (Qwen3 has it).
    config.model.max_position_embeddings = 512  # Longest context, in tokens.
    config.model.param_dtype = "float32"  # Parameter storage dtype.
    config.model.dtype = "float32"  # Activation dtype (logits are always float32).
    config.model.remat = False  # Recompute blocks in the backward pass to save memory.
    config.model.scan_layers = False  # Unrolled layers train ~15% faster here; scan compiles once for deep models.

    config.checkpoint = ml_collections.ConfigDict()
    # A Hugging Face model folder to start from; '' = random init from config.model. When set, the
    # architecture comes from the checkpoint's config.json and config.model is not used.
    config.checkpoint.hf_path = ""
    config.checkpoint.param_dtype = "float32"  # Parameter dtype after loading a checkpoint.
    config.checkpoint.compute_dtype = "float32"  # Activation dtype for a loaded checkpoint.
    # A run's workdir: the policy starts from its newest checkpoint's parameters (a resumed run
    # restores its own); '' = config.checkpoint.hf_path or random init.
    config.checkpoint.init_from = ""
    config.checkpoint.every = 10  # Save every N RL iterations (and after SFT, and at the end; 0 = only those).
    config.checkpoint.keep = 2  # Checkpoints kept.
    # Also write each checkpoint's policy as a Hugging Face folder, <workdir>/hf/<step> (config,
    # safetensors, the tokenizer's files with its chat template); any one later with
    # `python launch/export_hf.py --workdir W [--step N] --out DIR`.
    config.checkpoint.export_hf = False

    config.mesh = ml_collections.ConfigDict()
    config.mesh.data = 1  # Pure data-parallel axis size.
    config.mesh.fsdp = -1  # Parameter-sharded data-parallel axis; -1 = all remaining devices.
    config.mesh.tensor = 1  # Tensor-parallel axis size (heads, MLP width).

    config.sampler = ml_collections.ConfigDict()
    # KV-cache slots (requests decoded together), split between the engines: 128 = half of an RL
    # iteration's 256 episodes at once; against 64, RL iterations took 0.86-0.93x the time on the
    # AMD EPYC host (sampling 0.85-0.92x), 256 did not gain (benchmarks/RESULTS.md).
    config.sampler.max_concurrent_decodes = 128
    config.sampler.max_prefill_length = 128  # Longest prompt in tokens (power of two); longer ones are rejected.
    config.sampler.max_cache_length = 128  # Tokens per slot: prompt + generation (>= rollout.max_context).
    config.sampler.steps_per_call = 4  # Decode steps per generate call (amortises dispatch overhead).
    # The most decode steps a call runs while none of its requests finishes (a stop token, a full
    # cache, or the first request's max_tokens): fewer calls when every request runs on, none
    # longer when one ends (0 = steps_per_call: every call runs steps_per_call steps).
    config.sampler.max_steps_per_call = 16
    # In-process sampler: engines, each decoding in a thread of its own, the slots and prefix-cache
    # entries split evenly between them (an episode's turns stay on one). On CPU a decode loop runs
    # on one core, so 2 uses both of a 2-core host; 1 = one engine with every slot; 0 = auto: 2 on
    # a CPU host with 2 or more usable cores (and an even split), else 1.
    config.sampler.local_engines = 0
    # The decode loop's XLA:CPU options (speed only, never tokens): 'auto' = measured on this host
    # the first time (seconds) and cached beside the compilation cache; 'builtin' = the project's
    # choice, unmeasured; 'xla_defaults' / 'fast_minmax' / 'small_batch', or 'LARGE,SMALL' of them
    # for more than 16 decoded rows and at most.
    config.sampler.decode_options = "auto"
    # Prefix cache: finished requests whose keys/values are kept, so that an episode's next turn
    # (its whole history as the prompt) prefills only the new tokens; 0 = off. Each entry costs
    # 2 * num_layers * num_kv_heads * max_cache_length * head_dim activations (128 KiB here).
    config.sampler.prefix_cache_entries = 256
    # A batched prefill or extend whose (rows, tokens, ...) shape is not compiled yet runs padded in
    # a compiled larger one until the padding has cost this many of its calls, then compiles (ski
    # rental: a compile costs ~100-200 such calls on 2 cores; rare shapes are never compiled).
    # 0 = compile every shape on first use.
    config.sampler.shape_reuse_calls = 64.0
    # The same for the decode loop's (rows, cache window): its compile costs ~200 calls of 8 rows.
    config.sampler.decode_shape_reuse_calls = 256.0
    config.sampler.default_temperature = 0.0  # Sampling for stock JetStream Decode requests (0 = greedy).
    # Servers only: generate calls dispatched ahead of the thread that turns results into tokens and
    # frees finished requests' slots (1 = none ahead: a finished slot is refilled on the next call).
    config.sampler.pipeline_depth = 1
    # 0 = the in-process sampler; N = N JetStream server processes (launch/sampler_server.py) on
    # this host, fed new weights over gRPC after every update (each with the slots above).
    config.sampler.num_servers = 0
    # Pins each local server to its own GPUs ('0,1;2,3': server 0 sees GPUs 0-1, server 1 GPUs 2-3;
    # through CUDA_VISIBLE_DEVICES). '' = every server sees every device. Servers run elsewhere
    # (sampler.addresses) are pinned where they are started: CUDA_VISIBLE_DEVICES=2 jaxrl-agent sampler-server ...
    config.sampler.server_devices = ""
    # Servers only: the most MiB of one parameter per weight-sync message (weights are streamed in
    # chunks, so no gRPC message cap limits the model's size).
    config.sampler.weight_chunk_mb = 16.0
    # Sampler servers started elsewhere ('host:port,...' of `jaxrl-agent sampler-server` processes,
    # serving this config's model, with the run's token in $JAXRL_AGENT_TOKEN or its file), instead
    # of num_servers local ones: requests are balanced over them and fail over; one that returns
    # after a restart is sent the current weights (checked every rejoin_check_s seconds).
    config.sampler.addresses = ""
    config.sampler.rejoin_check_s = 2.0  # Seconds between checks for returned servers that lack the weights.
    config.sampler.tls_ca_file = ""  # PEM CA of the servers' TLS certificates ('' = plain gRPC).

    config.env = ml_collections.ConfigDict()
    config.env.name = "calculator"  # Environment (see jaxrl_agent.envs.registered()).
    # Modules imported before any environment is made — in the trainer, in every env worker and
    # (pass them as --import) in launch/env_server.py: where your own `envs.register(...)` calls live.
    config.env.imports = ""  # Comma-separated module names ('' = none).
    # JSON object of keyword arguments for the environment's factory (each one of a mixture; '' = none).
    config.env.kwargs = ""
    # Several environments in one run: 'name:weight,...' (e.g. 'calculator:0.5,kb_search:0.5'),
    # each task's environment drawn with these weights; '' = env.name alone. Success, entropy,
    # signal share and evaluation are reported per environment.
    config.env.mixture = ""
    # Where environments run: 'pool' (worker processes: step timeouts and crash isolation; 3-17% of
    # an RL iteration here over 'inprocess', 12-22% before requests were batched: benchmarks/RESULTS.md),
    # 'inprocess' (threads of this process, with a step watchdog: for trusted, cheap environments),
    # 'auto' ('inprocess' when every environment of the run is one of the library's pure ones, as
    # calculator is; else 'pool') or 'host:port[,host:port...]' (remote launch/env_server.py
    # servers, load-balanced by episode, failing over to the others).
    config.env.service = "auto"
    # A step that takes longer ends its episode as finish_reason 'env_timeout' (the run goes on).
    config.env.step_timeout_s = 30.0
    # service='host:port,...': the PEM CA file that signed the env servers' TLS certificates
    # (servers started with --tls_cert_file/--tls_key_file); '' = plain TCP (loopback or a private network).
    config.env.tls_ca_file = ""
    config.env.pool_workers = 2  # service='pool': worker processes.
    config.env.worker_memory_mb = 4096  # service='pool': address-space limit per worker.
    config.env.train_difficulties = "1,2,3"  # Levels RL samples tasks from (comma-separated).
    # Levels evaluated on held-out seeds: the RL levels (add 4, never trained nor demonstrated, as a
    # generalisation probe: it stays at 0 for this model; eval/success averages the RL levels only).
    config.env.eval_difficulties = "1,2,3"
    config.env.step_threads = 64  # service='inprocess': threads running environment steps (blocking tools wait there).
    # Simulated tool latency (benchmarks): median seconds per tool call, Pareto tail (0 = none).
    config.env.tool_latency_s = 0.0
    config.env.tool_latency_alpha = 1.2  # Pareto tail index of that latency (smaller = heavier tail).

    config.rollout = ml_collections.ConfigDict()
    config.rollout.prompts_per_iteration = 64  # Tasks per RL iteration (64 tasks x 4 samples learned fastest on 2 cores).
    config.rollout.group_size = 4  # Episodes per task; advantages are relative within the group.
    config.rollout.temperature = 1.0  # Sampling temperature (0.7 learned worse in the notes).
    # Truncated sampling (Qwen3's generation_config suggests top_k 20, top_p 0.95): log-probs are
    # recorded under the truncated distribution, so the learner's correction and the drift
    # measures see the truncation as train/serve mismatch. 0 and 1 = off.
    config.rollout.top_k = 0  # Keep the k likeliest tokens (0 = off).
    config.rollout.top_p = 1.0  # Keep the smallest set with this much mass (1 = off).
    config.rollout.max_tokens_per_turn = 64  # Longest assistant turn, in tokens.
    config.rollout.max_context = 128  # Longest episode in tokens (<= learner.row_length); then context_limit.
    config.rollout.max_turns = 4  # Assistant turns per episode.
    config.rollout.include_system_prompt = False  # Prepend the tool description (long for a char model).
    # Thinking, for a model template with the switch (Qwen3's `enable_thinking`): off renders the
    # template's empty think block before each reply.
    config.rollout.enable_thinking = False
    # With thinking on: tokens a reply may spend inside its <think> block before the block is
    # closed for it (template tokens, not trained) and it must answer (0 = no budget).
    config.rollout.max_think_tokens = 0
    # With a model's own chat template: 'template' = each turn's context is the template's rendering
    # of the conversation so far, as deployment shows it (a new learner sequence where the template
    # rewrites earlier turns, e.g. Qwen3's dropped empty think blocks); 'append' = append-only.
    config.rollout.history = "template"
    # Context management (rollout.context): when the next context would pass context_trigger x
    # max_context, 'keep_recent' keeps the task and the last context_keep_turns turns, 'discard_all'
    # only the task (each with a note), 'summarize' asks the policy for a summary (a trained turn)
    # and keeps the task and that summary; the episode goes on as a new learner sequence. 'none' =
    # the episode ends at max_context. Training, evaluation and deployment edit alike.
    config.rollout.context = "none"
    config.rollout.context_keep_turns = 2  # Turns keep_recent keeps (each a reply and its tool result).
    config.rollout.context_trigger = 0.75  # Share of max_context the next context (summarize: with the request) may reach.
    config.rollout.context_max_edits = 0  # Edits per episode at most (0 = no limit); then it ends at max_context.
    config.rollout.context_note = "(Earlier turns removed.)"  # The message that stands for removed turns.
    config.rollout.context_summary_request = "Summarize the context."  # summarize: asked after the result.
    config.rollout.context_summary_prefix = "Summary: "  # summarize: before the summary in the next context.
    # summarize: the policy edits when it calls the `context` tool ({"summary": ...}, advertised with
    # the environment's tools, never sent to it) instead of when the trigger asks; demonstrations call it there.
    config.rollout.context_tool = False
    # Sub-agents (Agent Swarm / PARL): the policy may call `delegate` ({"task": ...}, one or several
    # calls in a reply, run at once); each runs a sub-agent episode with a fresh context on a frozen
    # policy (its own in-process sampler) and its answer is the call's result. Only the
    # orchestrator's tokens are trained. '' = no delegate tool; 'initial' = a frozen copy of the
    # weights RL starts from (after SFT; checkpointed); a Hugging Face folder = those weights.
    # Sub-tasks come from the environment's `subtask` (e.g. chain_sum: a key of its log).
    config.rollout.delegate = ""
    config.rollout.delegate_max_depth = 1  # Levels of sub-agents (1 = sub-agents cannot delegate).
    config.rollout.delegate_max_subagents = 4  # Sub-agent episodes per orchestrator episode, all levels.
    config.rollout.delegate_token_budget = 1024  # Tokens all of an episode's sub-agents may sample together.
    # The sub-agents' sampling temperature in training (-1 = the orchestrator's; 0 = greedy; never
    # above the orchestrator's, so evaluation's sub-agents are greedy). Frozen sub-agents learn
    # nothing from exploring: their sampled mistakes are only noise in the orchestrator's reward.
    config.rollout.delegate_temperature = -1.0
    config.rollout.drop_zero_advantage_groups = True  # All-equal groups carry no gradient (DAPO filter).
    # 'sync' (on-policy barrier), 'windowed_fifo' (MiniMax) or 'async' (bounded staleness). With
    # the stale rollouts of the last two, rl.correction='decoupled' keeps the trust region on the
    # learner's own recent policy (benchmarks/RESULTS.md: within 0.2 s.e. of sync's success).
    config.rollout.schedule = "sync"
    # windowed_fifo: trainable groups lie within W of the oldest unfinished one (in groups). Below
    # prompts_per_iteration a single slow group stalls every iteration; 2P measured 1.9x over sync.
    config.rollout.window = 128
    config.rollout.max_staleness = 2  # async: sampled at most S policy versions before training.
    config.rollout.stale_policy = "drop"  # async: 'drop' episodes with older tokens, or 'mask' those tokens.
    config.rollout.token_budget = 0  # Partial rollouts: tokens per episode per iteration (0 = no limit).
    config.rollout.groups_in_flight = 0  # Non-sync: groups submitted ahead of the learner (0 = prompts_per_iteration).

    # Who gets rollouts (rollout allocation). 'uniform' with task_pool=0 is a fresh task for every group.
    config.replay = ml_collections.ConfigDict()
    # The replay buffer holds groups from submission until trained, suspended partial rollouts with
    # their tokens among them. Its bound, in tokens held: the oldest groups are evicted (counted) to
    # stay under it. 0 = 4 x the groups in flight x group_size x max_context.
    config.replay.capacity_tokens = 0

    config.allocation = ml_collections.ConfigDict()
    # 'uniform', 'variance' (sqrt(p(1-p)), VIP / GVM-RAFT), 'knapsack' (Knapsack RL) or 'until_mixed'
    # (Reinforce-Ada: rounds of G/2 rollouts until a task's outcomes differ; sync only). All but uniform
    # need a revisited pool, where per-task success posteriors pick the tasks likely to give mixed groups.
    config.allocation.strategy = "uniform"
    config.allocation.task_pool = 0  # Training tasks in a fixed pool revisited over epochs (0 = fresh tasks).
    config.allocation.candidates = 2.0  # Tasks considered per group of budget (adaptive strategies).
    config.allocation.max_group = 16  # Most rollouts one task gets in an iteration.
    config.allocation.decay = 0.9  # Posterior forgetting per update (follows an improving policy).
    config.allocation.retire_threshold = 0.95  # Tasks solved this reliably are retired...
    config.allocation.retire_min_evidence = 8.0  # ...after this many observed rollouts...
    config.allocation.revisit_prob = 0.05  # ...and revisited with this probability.
    # DAPO dynamic sampling (sync): submit ceil(P / running non-zero share) prompts so about P
    # groups survive the all-equal filter (more rollouts per iteration).
    config.allocation.dynamic_sampling = False

    # Reward shaping on top of the environment's own components (correctness, format, efficiency).
    config.reward = ml_collections.ConfigDict()
    # DAPO's soft overlong penalty on sampled tokens: 0 up to rollout.max_context - buffer, then
    # linearly down to -factor at rollout.max_context (0 = off). Logged as reward/overlong.
    config.reward.overlong_factor = 0.0
    config.reward.overlong_buffer = 32  # Tokens before the limit where the penalty ramps in.
    config.reward.toggle_period = 0  # Kimi Toggle: penalty only every other `period` iterations (0 = always).
    # The reward as 'name:weight,...' over named components: the environment's (calculator:
    # correctness, format, efficiency) and the library's (overlong, turns = -(turns - 1), wall_time =
    # -sampling seconds, custom = reward.fn's value; the overlong weight is its factor, and
    # overlong_factor is not used). '' = the environment's own reward (+ overlong_factor's penalty).
    config.reward.weights = ""
    # Your reward function, 'package.module:name': fn(trajectory) -> float (component 'custom'; it
    # replaces the reward when reward.weights is '') or {name: value} (more named components).
    # A function that raises scores 0 and is counted as reward/reward_fn_error. '' = none.
    config.reward.fn = ""
    # A rubric LLM judge scoring every episode (component 'judge' in [0, 1]; weight it in
    # reward.weights): '' = none, 'policy' = a frozen copy of the policy RL starts from, or a Hugging
    # Face folder (same tokenizer). A reply with no usable score is counted (reward/judge_failed).
    config.reward.judge = ""
    config.reward.judge_rubric = ""  # Rubric items separated by ';' ('' = rewards.judge.DEFAULT_RUBRIC).
    config.reward.judge_max_tokens = 16  # Longest judge reply, in tokens.
    # MiniMax-M1's check: warn (judge/length_bias_warning = 1) when the correlation of judge
    # scores with sampled length exceeds this (a judge that rewards verbosity gets exploited).
    config.reward.length_bias_threshold = 0.5

    config.data = ml_collections.ConfigDict()
    # RL tasks: 'procedural' (each environment's seeded generator, env.train_difficulties), or task
    # records (Task.to_dict form; only 'prompt' required) from a .jsonl or .array_record file or a
    # TFDS builder 'tfds:<name>[/<config>]', read through grain: shuffled, repeated, sharded by
    # process, their position checkpointed. Malformed records are skipped and counted by reason.
    config.data.tasks = "procedural"
    config.data.shuffle = True  # Shuffle task records (seeded by `seed`); False = file order.
    config.data.tfds_data_dir = ""  # Where 'tfds:' builders are generated and read ('' = TFDS's default).
    # SFT demonstrations: a JSONL of OpenAI-style {"messages": [...]} records (assistant turns are
    # trained on; tool_calls written in the tool protocol); '' = the environment's scripted expert.
    config.data.demonstrations = ""

    config.sft = ml_collections.ConfigDict()
    config.sft.steps = 200  # Cold-start updates on scripted-expert trajectories (0 = none).
    config.sft.batch_size = 64  # Expert episodes per update (~0.2 s per update on 2 cores, model 207 host).
    # 0 = exactly batch_size demonstrations per update, their rows padded to learner.row_multiple
    # (a train-step shape per row count: 4 here). N = N learner rows per update, filled with
    # demonstrations in the order drawn, one that does not fit waiting for the next update: one
    # shape, compiled once (on an accelerator, where each compile is slow); -1 = the rows batch_size
    # demonstrations pack into on average, measured at the start.
    config.sft.rows_per_update = 0
    # Gradient accumulation steps of an SFT update (0 = learner.microbatches): the rows in this many
    # parts (less memory), each part's forward and backward pass alone, the loss exactly the batch's
    # token mean. 4 parts did not speed up this model's SFT on 2 cores (benchmarks/RESULTS.md).
    config.sft.microbatches = 0
    config.sft.learning_rate = 3e-3  # AdamW peak learning rate (fell faster than 1e-3 here).
    config.sft.warmup_steps = 50  # Linear warm-up, then cosine decay.
    config.sft.log_every = 50  # Console / metrics.jsonl cadence, in updates.
    # Levels with expert demonstrations ('' = env.train_difficulties).
    config.sft.difficulties = "1,2,3"
    # Demonstrations are a fixed set of this many expert episodes, revisited over epochs (as a
    # real demonstration dataset is finite); 0 = a fresh expert episode for every example.
    config.sft.num_demonstrations = 512
    config.sft.eval_every = 0  # Held-out evaluation every N SFT updates (0 = only after SFT).
    # With sub-agents (rollout.delegate): the share of tasks whose demonstration comes from the
    # environment's delegating expert (chosen by task id); the rest show the inline expert.
    config.sft.delegate_share = 1.0

    config.rl = ml_collections.ConfigDict()
    # Sample -> learn iterations (1.0-1.3 s each on 2 cores in process on the model 207 host, 1.5-2.1 s
    # on the hosts measured before; benchmarks/RESULTS.md): 5-9 minutes; the time budget below caps slower hosts.
    config.rl.iterations = 250
    config.rl.minibatches = 2  # Updates per iteration (the batch is split).
    config.rl.stop_after_trained_tokens = 0  # End RL once this many tokens were trained (0 = run all iterations).
    # Wall-clock budget of the whole run, in minutes (0 = none): RL ends at the last iteration boundary
    # after which one more iteration and the final checkpoint and evaluation would not fit. 14 keeps
    # the default command, start-up included, within 15 minutes on 2 cores.
    config.rl.time_budget_minutes = 14.0
    # RL minibatch rows are padded to a multiple of this (each row count compiles once): 8 here, as
    # a minibatch of ~35 episodes packs into ~18 rows, and 16 padded those to 32 (learner time -25%).
    config.rl.row_multiple = 8
    config.rl.learning_rate = 2e-4  # AdamW peak learning rate (6e-4 collapsed in the notes).
    config.rl.warmup_steps = 4  # Warm-up updates.
    # The objective (docs/losses.md has each formula and paper): 'mirror_descent' (Kimi k1.5; the
    # default), 'ppo' (GRPO-style clipped surrogate, clip-higher and dual clip), 'gspo' (sequence
    # ratio), 'cispo' (MiniMax-M1: clipped IS weight on REINFORCE) or 'reinforce'.
    config.rl.objective = "mirror_descent"
    config.rl.level = "token"  # mirror_descent: 'token' or 'sequence' level.
    config.rl.tau = 0.05  # Mirror-descent regulariser strength (Kimi k1.5); also PLOO's baseline temperature.
    # Clipping of mirror_descent (token level), ppo and cispo: ratios outside [1 - low, 1 + high]
    # leave the policy-gradient term (cispo: bound its weight; low >= 1 = no lower bound).
    config.rl.clip_eps_low = 0.2
    config.rl.clip_eps_high = 0.2  # > clip_eps_low is DAPO's clip-higher.
    config.rl.dual_clip = 0.0  # ppo: dual clip c > 1 for negative advantages (Ye et al. 2020); 0 = off.
    # gspo: bounds on the length-normalised sequence ratio (Zheng et al. 2025).
    config.rl.gspo_eps_low = 3e-4
    config.rl.gspo_eps_high = 4e-4  # (a geometric mean per token: bounds ~1e-4, not 0.2)
    # Advantages within a group: 'grpo' ((r - mean) / std), 'dr_grpo' (r - mean; divided by the std
    # was slightly worse on the tiny default), 'rloo' (leave-one-out mean) or 'ploo'
    # (Kimi k1.5's leave-one-out soft baseline at temperature rl.tau).
    config.rl.advantage = "dr_grpo"
    # The negative advantages scaled by this (losses.weight_negative_advantages; W-REINFORCE's
    # weighting, Zhu et al. 2025): below 1 the samples that beat their group's mean count for more
    # than those below it, which raises greedy pass@1 sooner and explores less; 1 = the estimator's
    # advantages. 0.25 reached +15 points in ~0.75x the RL iterations of 1 here (benchmarks/RESULTS.md).
    config.rl.negative_advantage_weight = 0.25
    # Learner/sampler mismatch: 'none', 'tis' (truncated IS weights, cap rl.tis_cap), 'icepop'
    # (drop tokens whose ratio leaves [icepop_low, icepop_high]) or 'decoupled' (decoupled PPO: the
    # trust region around the iteration's starting policy, recomputed by the learner, and weights
    # pi_prox / pi_sampler capped at rl.tis_cap).
    config.rl.correction = "tis"
    config.rl.tis_cap = 2.0  # Truncated importance weight cap (tis, decoupled).
    config.rl.icepop_low = 0.5  # icepop: kept ratio range [low, high].
    config.rl.icepop_high = 2.0  # (Ling Team 2025)
    config.rl.entropy_coef = 0.0  # Entropy bonus coefficient (> 0 rewards exploration).
    # KL to a frozen reference policy: coef * KL estimate ('k1', 'k2' or 'k3'; Schulman 2020). The
    # reference's log-probs cost a second forward pass, made only when kl_coef > 0.
    config.rl.kl_coef = 0.0
    config.rl.kl_estimator = "k3"  # (k3: unbiased and non-negative)
    # The reference: 'initial' (the weights RL starts from), 'sft' (the weights after SFT: the
    # same here, since RL starts after SFT) or a Hugging Face model folder.
    config.rl.reference = "initial"
    # On-policy distillation from a frozen teacher (losses.DistillTerm: the reverse KL on the
    # policy's own samples, its own loss term 'distill/loss'); its log-probs cost a forward pass,
    # made only when distill_coef > 0.
    config.rl.distill_coef = 0.0
    # The teacher: 'initial' (the weights RL starts from: in a stage list, the previous stage's
    # final policy) or a Hugging Face model folder.
    config.rl.teacher = "initial"
    # Environments of env.mixture trained by distillation alone ('a,b'): their episodes get
    # advantage 0 and are all kept, and the distillation term covers only them, so an earlier
    # stage's tasks keep its teacher's behaviour while this stage's own tasks learn from their
    # rewards undisturbed. With distill_coef 0 they are sampled (their success in the records) and
    # not trained. '' = distillation on every episode.
    config.rl.distill_envs = ""
    # Your own objective instead of the named one: 'package.module:name' naming an Objective
    # (losses.make_objective), a function of the rl section (a dict) returning one, or a pure loss
    # with the signature of docs/contracts.md (logprobs, sampler_logprobs, ref_logprobs, advantages, mask, cfg)
    # (cfg = the rl section as a dict; ref_logprobs only when kl_coef > 0). '' = rl.objective.
    config.rl.objective_fn = ""

    config.learner = ml_collections.ConfigDict()
    config.learner.row_length = 128  # Tokens per packed learner row (expert episodes are 55-80 tokens).
    config.learner.row_multiple = 4  # Rows are padded to a multiple of this (fewer recompilations).
    # Gradient accumulation steps per RL update (and SFT's when sft.microbatches is 0); rows are padded
    # to a multiple of it. An RL objective's loss is then the mean of the parts' losses.
    config.learner.microbatches = 1
    # Sequence positions whose [rows, chunk, vocab] logits exist at once in the learner (0 = the whole
    # row): the logits are recomputed chunk by chunk in the backward pass instead of stored.
    config.learner.logits_chunk = 0
    # Logits only at trained positions: per row, K = the most trained tokens in a row of the batch,
    # rounded up to a multiple of this; 0 = logits at every position. Off here: the character
    # vocabulary makes the projection cheap, and each new (rows, K) shape compiles once (~5 s on 2
    # cores). Real vocabularies (the HF configs) turn it on.
    config.learner.target_multiple = 0
    # RL: a batch shape the step has not compiled runs padded up to a compiled larger one (padding
    # rows train nothing) until the padding has cost this many steps of it, and is compiled then
    # (ski rental: a compile costs ~8-13 steps on 2 cores; rare shapes are never compiled). 0 =
    # compile every shape on first use. (SFT trains each update in its own shape, bit for bit as
    # before; sft.rows_per_update gives it one shape.)
    config.learner.shape_reuse_calls = 8.0
    config.learner.grad_clip_norm = 1.0  # Global gradient-norm clip.
    # Mixed precision: 'float32' keeps float32 master weights and optimizer moments for bfloat16
    # parameters (updates below bfloat16's resolution accumulate there; the parameters, used by the
    # forward pass and the sampler, are their cast). '' = the optimizer updates the parameters.
    config.learner.master_dtype = ""
    # Stop the run after this many learner updates in a row were skipped as non-finite (0 = never).
    config.learner.max_consecutive_skips = 5
    # Weight of the policy's summary tokens (rollout.context='summarize') against its action tokens in
    # the policy-gradient loss (FoldAct's separate summary loss, as a per-token advantage weight).
    config.learner.summary_weight = 1.0

    config.eval = ml_collections.ConfigDict()
    config.eval.every = 20  # Evaluate every N RL iterations (and after SFT, and at the end; 0 = only those).
    config.eval.tasks_per_difficulty = 64  # Held-out tasks per difficulty, greedy pass@1.
    config.eval.pass_k = 0  # Also k samples per task at rollout.temperature for pass@k (0 = greedy only).
    # Evaluate the policy before training: 'true', 'false', or 'auto' = unless SFT comes first and the
    # weights are random (no checkpoint.hf_path / init_from): the evaluation after SFT is the baseline.
    config.eval.initial = "auto"

    config.invariants = ml_collections.ConfigDict()
    # The three invariants' alarms (jaxrl_agent/invariants): each fires after `fire_after` RL
    # iterations in a row past its threshold and releases after `release_after` in a row back past
    # its release level (hysteresis). Exploration: the lowest per-environment sampled-token entropy,
    # in nats (0 = off; this run's fell from 0.09 to 0.04 over RL).
    config.invariants.entropy_floor = 0.01  # Fires below this...
    config.invariants.entropy_release = 0.02  # ...releases at or above this.
    # Also flag (guard/solution_collapse) tasks averaging fewer distinct tool-call sequences than
    # this (0 = off: a calculator task has one right call).
    config.invariants.distinct_solutions_floor = 0.0
    # Learning signal: the share of groups with non-zero advantage (0 = off; ~0.2-0.3 here).
    config.invariants.signal_floor = 0.1  # Fires below this...
    config.invariants.signal_release = 0.15  # ...releases at or above this.
    # Drift: the train/serve gap's 99th percentile in nats on same-version tokens (numerics only:
    # ~1e-6 in float32; 0 = off), and the largest policy lag of a trained token (0 = off).
    config.invariants.serve_gap_ceiling = 1e-3  # Fires above this...
    config.invariants.serve_gap_release = 1e-4  # ...releases at or below this.
    config.invariants.lag_ceiling = 4  # Fires when a trained token is more versions old...
    config.invariants.lag_release = 2  # ...releases at or below this.
    config.invariants.fire_after = 2  # RL iterations in a row past a threshold before an alarm fires.
    config.invariants.release_after = 3  # ... in a row back past its release level before it releases.
    # Responses (jaxrl_agent/invariants/responses.py), each engaging while its invariant's alarm is
    # on and releasing after, logged as 'response' records: exploration raises an entropy bonus by
    # entropy_coef_step per iteration up to entropy_coef_max; signal turns on dynamic sampling (sync)
    # and, when all-correct groups dominate, sets aside up to max_dropped_levels of the easiest
    # training levels; drift tightens rollout.max_staleness by one (async; not below staleness_min)
    # and turns on IcePop masking (rl.icepop_low/high).
    config.invariants.respond = False  # Off: alarms only warn and log.
    config.invariants.entropy_coef_step = 0.002  # Entropy bonus added per iteration while exploration is alarmed.
    config.invariants.entropy_coef_max = 0.02  # The bonus's bound.
    # Easiest training levels the curriculum may set aside (0 = none: at temperature 0.7 setting
    # level 1 aside made its held-out success fall 0.48 -> 0.28; benchmarks/RESULTS.md).
    config.invariants.max_dropped_levels = 0
    config.invariants.staleness_min = 0  # The tightest staleness bound the drift response sets.
    # Drift measured apart from learning, every N RL iterations (0 = never): the train/serve gap on
    # tokens the sampler drew with the learner's current parameters (numerics only), and the policy's
    # movement over the iteration's updates (KL(start || end)). One forward pass of one minibatch (the
    # log-probs before the update come from the first train step's own; the decoupled correction's proximal pass).
    config.invariants.drift_every = 1

    config.sandbox = ml_collections.ConfigDict()
    # How the `code` environment isolates policy code: 'bwrap' (bubblewrap namespaces + seccomp;
    # the run refuses to start without it) or 'none' (resource limits and an audit hook only, with a
    # warning: for trusted code).
    config.sandbox.isolation = "bwrap"

    config.metrics = ml_collections.ConfigDict()
    config.metrics.tensorboard = True  # Also write TensorBoard scalars to workdir/tensorboard.
    config.metrics.wandb_project = ""  # Also log to this Weights & Biases project (pip install ".[wandb]").
    config.metrics.progress = "auto"  # Progress bars: 'auto' (on a terminal only), 'on' or 'off'.
    config.metrics.global_step_offset = 0  # Added to every record's global step (a stage's place in its list).
    # Write every episode the learner takes (whole trajectories, JSON) to workdir/episodes.jsonl
    # (episodes.p<i>.jsonl for process i > 0): what was trained on, for inspection and audits.
    config.metrics.episodes_log = False

    config.smoke = ml_collections.ConfigDict()
    config.smoke.batch_size = 2  # Rows in the launcher's forward-pass check.
    config.smoke.seq_len = 32  # Tokens per row in that check.
    return config.lock()
