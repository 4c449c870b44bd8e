"""The learner's train step: exact log-prob recomputation, skipping non-finite updates, sharding."""

import asyncio
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxrl_agent import envs, learner, losses, models, replay, rollout, sharding
from jaxrl_agent import tokenizer as tok
from jaxrl_agent.sampling import AgentEngine, LocalSampler, SamplingParams

TOKENIZER = tok.CharTokenizer()
CONFIG = models.ModelConfig(vocab_size=TOKENIZER.vocab_size, num_layers=2, hidden_size=64, num_heads=4,
                            num_kv_heads=2, head_dim=16)
PARAMS = models.init_params(CONFIG, jax.random.PRNGKey(0))
ENV = envs.make("calculator")


def _trajectories(n):
    expert = envs.expert_policy("calculator")
    trajectories = [rollout.expert_trajectory(ENV, ENV.sample_task(s, 1), expert, TOKENIZER, tok.CHATML)
                    for s in range(n)]
    return [dataclasses.replace(t, advantage=1.0 if i % 2 else -1.0,
                                sampler_logprobs=np.where(t.loss_mask == 1, -1.0, 0.0).astype(np.float32))
            for i, t in enumerate(trajectories)]


def _expert_batch(n=8, row_length=256):
    return replay.pack(_trajectories(n), row_length, row_multiple=2)[0]


def test_sampler_logprobs_equal_learner_recomputation_on_packed_episodes():
    temperature = 0.8
    engine = AgentEngine(CONFIG, PARAMS, TOKENIZER, max_concurrent_decodes=8, max_prefill_length=64,
                         max_cache_length=192, steps_per_call=4, seed=1)
    settings = rollout.EpisodeSettings(sampling=SamplingParams(temperature=temperature, max_tokens=24),
                                       max_context=190, max_turns=3)
    with LocalSampler(engine) as sampler:
        tasks = [ENV.sample_task(s, 1) for s in range(3)]
        groups = asyncio.run(rollout.collect_groups(
            sampler, lambda task: rollout.InProcessEnv(envs.make("calculator")), tasks, 2, TOKENIZER, tok.CHATML,
            settings))
    trajectories = [t for g in groups for t in g]
    assert all(t.generated_tokens > 0 for t in trajectories)
    batch, _ = replay.pack(trajectories, 512)
    logp, _ = learner.sequence_logprobs(CONFIG, PARAMS, jax.tree.map(jnp.asarray, batch), temperature=temperature)
    mask = batch.loss_mask == 1
    np.testing.assert_allclose(np.asarray(logp)[mask], batch.sampler_logprobs[mask], atol=1e-5)
    # Every trained token was sampled by version 0, the engine's version.
    assert set(batch.policy_version[mask].tolist()) == {0}


def test_sampler_logprobs_equal_learner_recomputation_across_a_template_history_rewrite(tmp_path):
    """A Qwen3-style template with thinking off renders earlier replies without their empty think
    block, so every turn after the first starts a new learner sequence from the re-rendered
    context. Sampled by the real engine, packed, and recomputed by the learner: every sequence's
    log-probs equal the sampler's (each sequence is exactly the context the sampler conditioned on)."""
    from jaxrl_agent import chat_template
    from tests import hf_reference

    hf_reference.train_tiny_hf_tokenizer(tmp_path)
    tokenizer = tok.HFTokenizer.from_file(str(tmp_path))
    template = chat_template.ChatTemplate.from_folder(str(tmp_path), options=(("enable_thinking", False),))
    config = models.ModelConfig(vocab_size=tokenizer.vocab_size, num_layers=2, hidden_size=64, num_heads=4,
                                num_kv_heads=2, head_dim=16)
    params = models.init_params(config, jax.random.PRNGKey(3))
    engine = AgentEngine(config, params, tokenizer, max_concurrent_decodes=4, max_prefill_length=256,
                         max_cache_length=320, steps_per_call=4, seed=2, stop_token_ids=template.end_ids(tokenizer))
    settings = rollout.EpisodeSettings(sampling=SamplingParams(temperature=0.9, max_tokens=12), max_context=300,
                                       max_turns=3)
    with LocalSampler(engine) as sampler:
        tasks = [ENV.sample_task(s, 1) for s in range(2)]
        groups = asyncio.run(rollout.collect_groups(
            sampler, lambda task: rollout.InProcessEnv(envs.make("calculator")), tasks, 2, tokenizer, template,
            settings))
    trajectories = [t for g in groups for t in g]
    assert all(len(t.segments) == len(t.turns) for t in trajectories), [(t.segment_starts, t.turns) for t in trajectories]
    assert sum(len(t.segments) for t in trajectories) > len(trajectories)  # the rewrite did split them
    batch, _ = replay.pack(trajectories, 320)
    assert int(batch.loss_mask.sum()) == sum(t.generated_tokens for t in trajectories)
    logp, _ = learner.sequence_logprobs(config, params, jax.tree.map(jnp.asarray, batch), temperature=0.9)
    mask = batch.loss_mask == 1
    np.testing.assert_allclose(np.asarray(logp)[mask], batch.sampler_logprobs[mask], atol=1e-5)


def test_sft_steps_reduce_the_loss():
    optimizer = learner.make_optimizer(learning_rate=3e-3, warmup_steps=1, total_steps=30)
    state = learner.init_state(PARAMS, optimizer)
    step = jax.jit(learner.make_train_step(CONFIG, optimizer, sft=True))
    batch = jax.tree.map(jnp.asarray, _expert_batch())
    losses_seen = []
    for _ in range(12):
        state, metrics = step(state, batch)
        losses_seen.append(float(metrics["loss"]))
    assert losses_seen[-1] < 0.7 * losses_seen[0], losses_seen
    assert int(state.step) == 12 and int(state.skipped_steps) == 0


def test_non_finite_update_is_skipped_and_counted():
    optimizer = learner.make_optimizer(learning_rate=1e-3, warmup_steps=1, total_steps=10)
    state = learner.init_state(PARAMS, optimizer)
    step = jax.jit(learner.make_train_step(CONFIG, optimizer))
    batch = _expert_batch()
    bad = batch.replace(advantages=np.where(batch.loss_mask == 1, np.nan, 0.0).astype(np.float32))
    new_state, metrics = step(state, jax.tree.map(jnp.asarray, bad))
    assert float(metrics["update_skipped"]) == 1.0 and int(new_state.skipped_steps) == 1 and int(new_state.step) == 0
    for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(PARAMS)):
        np.testing.assert_array_equal(a, b)
    good_state, metrics = step(new_state, jax.tree.map(jnp.asarray, batch))
    assert float(metrics["update_skipped"]) == 0.0 and int(good_state.step) == 1


def test_microbatch_accumulation_matches_the_full_batch():
    optimizer = learner.make_optimizer(learning_rate=1e-3, warmup_steps=1, total_steps=10)
    batch = jax.tree.map(jnp.asarray, _expert_batch(n=8, row_length=128))
    objective = losses.make_objective([losses.PolicyTerm("reinforce", reduction="sequence_mean")])
    full = jax.jit(learner.make_train_step(CONFIG, optimizer, objective=objective))
    micro = jax.jit(learner.make_train_step(CONFIG, optimizer, objective=objective, microbatches=2))
    half = batch.tokens.shape[0] // 2
    # Equal rows per half and per-row sequence means: mean of halves == mean of all (as rows are
    # arranged, each half holds the same number of sequences).
    _, full_metrics = full(learner.init_state(PARAMS, optimizer), batch)
    _, micro_metrics = micro(learner.init_state(PARAMS, optimizer), batch)
    assert half * 2 == batch.tokens.shape[0]
    np.testing.assert_allclose(micro_metrics["grad_norm"], full_metrics["grad_norm"], rtol=0.2)
    np.testing.assert_allclose(micro_metrics["entropy"], full_metrics["entropy"], rtol=1e-3)


def test_sft_microbatches_give_the_whole_batch_token_mean_exactly():
    """SFT's accumulation over parts with unequal token counts: loss, entropy, gradient norm and
    the updated parameters equal one step on the whole batch (float rounding apart), where a mean
    of the parts' own token means would weigh a part's tokens by its count's inverse."""
    optimizer = learner.make_optimizer(learning_rate=1e-3, warmup_steps=1, total_steps=10)
    batch = jax.tree.map(jnp.asarray, _expert_batch(n=16, row_length=128))
    rows = batch.tokens.shape[0]
    assert rows % 4 == 0, rows
    parts = np.asarray(batch.loss_mask).reshape(4, rows // 4, -1).sum((1, 2))
    assert len(set(parts.tolist())) > 1, parts
    step = lambda microbatches: jax.jit(learner.make_train_step(CONFIG, optimizer, sft=True, microbatches=microbatches))
    whole_state, whole = step(1)(learner.init_state(PARAMS, optimizer), batch)
    parts_state, parted = step(4)(learner.init_state(PARAMS, optimizer), batch)
    for key in ("loss", "nll", "entropy", "grad_norm", "tokens"):
        np.testing.assert_allclose(parted[key], whole[key], rtol=2e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(parts_state.params), jax.tree.leaves(whole_state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The mean of the parts' own means differs from the token mean on these parts.
    logp, _ = learner.sequence_logprobs(CONFIG, PARAMS, batch)
    nll = -np.asarray(logp).reshape(4, rows // 4, -1)
    mask = np.asarray(batch.loss_mask).reshape(4, rows // 4, -1)
    mean_of_means = np.mean([(nll[i] * mask[i]).sum() / mask[i].sum() for i in range(4)])
    assert abs(mean_of_means - float(whole["loss"])) > 1e-4 * abs(float(whole["loss"]))


def test_row_multiples_hold_the_mesh_axes_the_configured_multiples_and_the_microbatches():
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=1, devices=jax.devices()[:2])
    assert learner.row_multiple_for(mesh) == 2
    assert learner.row_multiple_for(mesh, 4) == 4
    assert learner.row_multiple_for(mesh, 4, 8) == 8
    assert learner.row_multiple_for(mesh, 4, microbatches=3) == 12
    assert learner.row_multiple_for(mesh, 4, microbatches=4) == 4


def test_the_step_returns_its_starting_log_probs_and_the_drift_measure_uses_them():
    """make_train_step(token_logprobs=True): metrics['token_logprobs'] [B, T] are the batch's
    log-probs under the parameters the step started from (with microbatches, rows in the batch's
    order), and rl_update's drift metrics from them equal those of a forward pass of their own."""
    optimizer = learner.make_optimizer(learning_rate=1e-2, warmup_steps=1, total_steps=10)
    batch = jax.tree.map(jnp.asarray, _expert_batch(n=8, row_length=128))
    mesh = sharding.make_mesh(fsdp=1, devices=jax.devices()[:1])
    logprobs_fn = learner.make_proximal_logprobs(CONFIG, mesh, temperature=1.0)
    step = jax.jit(learner.make_train_step(CONFIG, optimizer, microbatches=2, token_logprobs=True))
    state = learner.init_state(jax.tree.map(jnp.copy, PARAMS), optimizer)
    for _ in range(3):  # the warm-up's first step has a learning rate of 0: the later ones move
        expected = np.asarray(logprobs_fn(state.params, batch))
        state, metrics = step(state, batch)
        chex.assert_shape(metrics["token_logprobs"], batch.tokens.shape)
        np.testing.assert_allclose(np.asarray(metrics["token_logprobs"]), expected, atol=1e-5)
    moved = np.asarray(logprobs_fn(state.params, batch))
    assert np.abs(moved - expected)[np.asarray(batch.loss_mask) == 1].max() > 1e-3  # after the step: not these

    trajectories = _trajectories(8)
    drift = {}
    for step_logprobs in (False, True):
        state = learner.init_state(jax.tree.map(jnp.copy, PARAMS), optimizer)
        step_fn = jax.jit(learner.make_train_step(CONFIG, optimizer, token_logprobs=step_logprobs))
        _, out = learner.rl_update(state, step_fn, trajectories, rng=np.random.RandomState(0), minibatches=2,
                                   row_length=128, row_multiple=2, target_multiple=0, mesh=mesh,
                                   logprobs_fn=logprobs_fn, current_version=0, step_logprobs=step_logprobs)
        assert "token_logprobs" not in out
        drift[step_logprobs] = {k: v for k, v in out.items() if k.startswith("invariants/drift/")}
    assert drift[True].keys() == drift[False].keys() and drift[True]["invariants/drift/policy_kl"] > 0
    for key, value in drift[False].items():
        np.testing.assert_allclose(drift[True][key], value, rtol=1e-3, atol=1e-6, err_msg=key)


def test_chunked_logits_give_the_same_update_as_whole_rows():
    """learner.logits_chunk changes memory, not the step: same loss, metrics and new parameters."""
    optimizer = learner.make_optimizer(learning_rate=1e-3, warmup_steps=1, total_steps=10)
    batch = jax.tree.map(jnp.asarray, _expert_batch(n=4, row_length=128))
    results = []
    for chunk in (0, 48):  # 48 does not divide 128: the last chunk is padded
        step = jax.jit(learner.make_train_step(CONFIG, optimizer, logits_chunk=chunk))
        results.append(step(learner.init_state(PARAMS, optimizer), batch))
    (whole_state, whole), (chunked_state, chunked) = results
    for key in ("loss", "entropy", "grad_norm"):
        np.testing.assert_allclose(chunked[key], whole[key], rtol=1e-4, err_msg=key)
    for a, b in zip(jax.tree.leaves(chunked_state.params), jax.tree.leaves(whole_state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_logits_at_trained_positions_only_give_the_same_update():
    """`target_index` (the packer's per-row trained positions) changes the cost, not the step: the
    same log-probs at trained positions, zeros elsewhere, and the same RL and SFT updates, with
    microbatches and chunks too."""
    plain = _expert_batch(n=6, row_length=128)
    indexed = replay.pack(_trajectories(6), 128, row_multiple=2, target_multiple=16)[0]
    mask = plain.loss_mask == 1
    k = indexed.target_index.shape[1]
    assert k % 16 == 0 and k - 16 < mask.sum(axis=1).max() <= k < 128
    for row, index in zip(mask, indexed.target_index):  # each row's trained positions, then 0s
        np.testing.assert_array_equal(index[:row.sum()], np.flatnonzero(row))
        assert not index[row.sum():].any()
    plain, indexed = jax.tree.map(jnp.asarray, plain), jax.tree.map(jnp.asarray, indexed)
    for field in ("tokens", "loss_mask", "advantages", "sampler_logprobs"):
        np.testing.assert_array_equal(getattr(indexed, field), getattr(plain, field))
    whole, whole_ent = learner.sequence_logprobs(CONFIG, PARAMS, plain, with_entropy=True)
    at, at_ent = learner.sequence_logprobs(CONFIG, PARAMS, indexed, with_entropy=True)
    np.testing.assert_allclose(np.asarray(at)[mask], np.asarray(whole)[mask], atol=1e-5)
    np.testing.assert_allclose(np.asarray(at_ent)[mask], np.asarray(whole_ent)[mask], atol=1e-5)
    assert not np.asarray(at)[~mask].any() and not np.asarray(at_ent)[~mask].any()
    optimizer = learner.make_optimizer(learning_rate=1e-3, warmup_steps=1, total_steps=10)
    for kwargs in (dict(), dict(sft=True), dict(microbatches=2, logits_chunk=48)):
        step = jax.jit(learner.make_train_step(CONFIG, optimizer, **kwargs))
        want_state, want = step(learner.init_state(PARAMS, optimizer), plain)
        got_state, got = step(learner.init_state(PARAMS, optimizer), indexed)
        for key in ("loss", "entropy", "grad_norm"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, err_msg=f"{key} {kwargs}")
        for a, b in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(want_state.params)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_sharded_train_step_on_eight_devices_matches_one_device():
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:8])
    optimizer = learner.make_optimizer(learning_rate=1e-3, warmup_steps=1, total_steps=10)
    train_step = learner.make_train_step(CONFIG, optimizer)
    # As the trainer packs it: logits at trained positions only (`target_index`, sharded by rows too).
    batch = replay.pack(_trajectories(8), 128, row_multiple=2, target_multiple=16)[0]
    rows = batch.tokens.shape[0]
    batch = jax.tree.map(lambda x: np.concatenate([x] * (8 // rows + 1))[:8] if rows < 8 else x[: rows - rows % 4], batch)
    single_state, single_metrics = jax.jit(train_step)(learner.init_state(PARAMS, optimizer), jax.tree.map(jnp.asarray, batch))

    state = learner.init_state(PARAMS, optimizer)
    # As build_learner makes it: the step's activations pinned to the batch's rows on this mesh.
    pinned_step = learner.make_train_step(CONFIG, optimizer, mesh=mesh)
    step, shardings = learner.jit_train_step(chex.assert_max_traces(pinned_step, n=1), state, mesh)
    state = jax.device_put(state, shardings)
    state, metrics = step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))
    q = state.params["layers"]["attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == P(None, "fsdp", "tensor") and len(q.sharding.device_set) == 8
    mu = state.opt_state[1][0].mu["layers"]["attn"]["q_proj"]["kernel"]
    assert mu.sharding.spec == P(None, "fsdp", "tensor")
    np.testing.assert_allclose(metrics["loss"], single_metrics["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(single_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
    # A second call with the same shapes does not retrace.
    step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))


def test_rows_over_eight_devices_cut_each_devices_step_memory():
    """At a large vocabulary the output projection dominates the step's working memory. With the
    rows split over 8 devices (fsdp) each device's compiled step needs well under a quarter of the
    one-device step's temporaries (its [rows/8, chunk, V] logits). Without the learner pinning its
    activations to the rows, XLA followed lm_head's fsdp-sharded width and computed every row's
    logits on every device (0.9x the one-device figure in this setup)."""
    wide = models.ModelConfig(vocab_size=32768, num_layers=1, hidden_size=16, intermediate_size=32, num_heads=2,
                              num_kv_heads=1, head_dim=8)
    params = models.init_params(wide, jax.random.PRNGKey(0))
    optimizer = learner.make_optimizer(learning_rate=1e-3, warmup_steps=1, total_steps=10)
    rows, length = 8, 256
    mask = np.zeros((rows, length), np.int32)
    mask[:, 100:160] = 1
    zeros = np.zeros((rows, length), np.float32)
    batch = learner.PackedBatch(tokens=np.ones((rows, length), np.int32), segment_ids=np.ones((rows, length), np.int32),
                                positions=np.tile(np.arange(length, dtype=np.int32), (rows, 1)), loss_mask=mask,
                                advantages=zeros, sampler_logprobs=zeros, old_logprobs=zeros,
                                policy_version=np.zeros((rows, length), np.int32),
                                target_index=replay.target_index(mask, 64))
    state = learner.init_state(params, optimizer)

    def temp_bytes(mesh):
        step, shardings = learner.jit_train_step(
            learner.make_train_step(wide, optimizer, sft=True, logits_chunk=64, mesh=mesh), state, mesh)
        compiled = step.lower(jax.device_put(state, shardings), jax.device_put(batch, sharding.batch_sharding(mesh))).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one = temp_bytes(sharding.make_mesh(devices=jax.devices()[:1]))
    eight = temp_bytes(sharding.make_mesh(devices=jax.devices()[:8]))
    assert eight < 0.25 * one, (eight, one)


def _controls(batch, bonus, icepop):
    rows = batch.tokens.shape[0]
    return np.tile(np.array([[bonus, icepop, 0.0]], np.float32), (rows, 1))


def test_loss_controls_add_an_entropy_bonus_and_icepop_masking_without_recompiling():
    """The invariants' responses reach the step as values: zero controls change nothing; a bonus c
    lowers the loss by exactly c x the mean entropy of the sampled tokens; IcePop drops the tokens
    whose learner/sampler ratio leaves its range (here: all, since the sampler log-probs are -1 and
    the learner's are far from it); one compiled step serves every setting."""
    optimizer = learner.make_optimizer(learning_rate=0.0, warmup_steps=1, total_steps=10)  # parameters stay
    state = learner.init_state(models.init_params(CONFIG, jax.random.PRNGKey(0)), optimizer)  # not PARAMS: donated
    traces = []

    def traced(*args):
        traces.append(1)
        return learner.make_train_step(CONFIG, optimizer)(*args)

    step = jax.jit(traced)
    batch = jax.tree.map(jnp.asarray, _expert_batch())
    _, plain = learner.make_train_step(CONFIG, optimizer)(state, batch)
    _, zero = step(state, batch.replace(loss_controls=jnp.asarray(_controls(batch, 0.0, 0.0))))
    _, bonus = step(state, batch.replace(loss_controls=jnp.asarray(_controls(batch, 0.5, 0.0))))
    _, icepop = step(state, batch.replace(loss_controls=jnp.asarray(_controls(batch, 0.0, 1.0))))
    assert len(traces) == 1
    np.testing.assert_allclose(zero["loss"], plain["loss"], rtol=1e-6)
    np.testing.assert_allclose(bonus["loss"], plain["loss"] - 0.5 * plain["entropy"], rtol=1e-5)
    assert float(bonus["controls/entropy_bonus"]) == 0.5 and float(zero["controls/icepop_masked_share"]) == 0.0
    assert float(icepop["controls/icepop_masked_share"]) > 0.5
    assert float(icepop["masked_token_share"]) >= float(plain["masked_token_share"])


def test_float32_master_weights_keep_the_updates_bfloat16_parameters_round_away():
    """Mixed precision: with bfloat16 parameters an AdamW step of ~lr = 1e-5 is below bfloat16's
    resolution for most weights, so bfloat16-only training leaves them unchanged; float32 master
    weights take every update, and the parameters are exactly their cast."""
    config = dataclasses.replace(CONFIG, param_dtype="bfloat16", dtype="bfloat16")
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), models.init_params(CONFIG, jax.random.PRNGKey(0)))
    optimizer = learner.make_optimizer(learning_rate=1e-5, warmup_steps=1, total_steps=100)
    step = jax.jit(learner.make_train_step(config, optimizer, sft=True))
    batch = jax.tree.map(jnp.asarray, _expert_batch(4))
    plain = learner.init_state(params, optimizer)
    mixed = learner.init_state(params, optimizer, master_dtype="float32")
    assert all(m.dtype == jnp.float32 for m in jax.tree.leaves(mixed.master_params))
    assert all(m.dtype == jnp.float32 for m in jax.tree.leaves(mixed.opt_state) if hasattr(m, "dtype") and m.ndim)
    for _ in range(3):
        plain, _ = step(plain, batch)
        mixed, _ = step(mixed, batch)
    leaves = lambda tree: [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]
    start = leaves(params)
    moved_plain = np.mean(np.concatenate([(a != b).ravel() for a, b in zip(leaves(plain.params), start)]))
    moved_master = np.mean(np.concatenate([(a != b).ravel() for a, b in zip(leaves(mixed.master_params), start)]))
    assert moved_plain < 0.2 and moved_master > 0.9, (moved_plain, moved_master)
    for p, m in zip(jax.tree.leaves(mixed.params), jax.tree.leaves(mixed.master_params)):
        assert p.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(jnp.bfloat16)))


def test_microbatch_gradients_are_summed_in_the_master_dtype():
    """With float32 master weights, the microbatch gradients (bfloat16, from bfloat16 parameters)
    are accumulated in float32: the update equals the float32 mean of each microbatch's own
    gradient (the parts hold equal token counts, so SFT's token mean weighs them alike, and the
    1/4 of each part's loss scales its bfloat16 gradient exactly). (A bfloat16 running sum rounds
    each partial sum to 8 bits of mantissa, ~1e-2 off.)"""
    import optax

    config = dataclasses.replace(CONFIG, param_dtype="bfloat16", dtype="bfloat16")
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), models.init_params(CONFIG, jax.random.PRNGKey(0)))
    identity = optax.identity()  # update = gradient: the new master is 0 + the accumulated gradient
    batch = _expert_batch(16, row_length=128)
    # Every row keeps its first m trained tokens, m the fewest of any row: equal parts.
    mask = np.asarray(batch.loss_mask)
    m = int(mask.sum(1).min())
    batch = jax.tree.map(jnp.asarray, batch.replace(loss_mask=(mask * (np.cumsum(mask, 1) <= m)).astype(mask.dtype)))
    n = 4
    assert batch.tokens.shape[0] == 8, batch.tokens.shape
    assert m > 0 and set(np.asarray(batch.loss_mask).sum(1).tolist()) == {m}

    def gradient(rows, microbatches):
        state = learner.init_state(params, identity, master_dtype="float32")
        state = state.replace(master_params=jax.tree.map(jnp.zeros_like, state.master_params))
        step = learner.make_train_step(config, identity, sft=True, microbatches=microbatches)
        return jax.tree.leaves(step(state, rows)[0].master_params)

    rows_per = batch.tokens.shape[0] // n
    parts = [gradient(jax.tree.map(lambda x: x[i * rows_per:(i + 1) * rows_per], batch), 1) for i in range(n)]
    reference = [sum(np.asarray(p[j], np.float64) for p in parts) / n for j in range(len(parts[0]))]
    accumulated = gradient(batch, n)
    for got, want in zip(accumulated, reference):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-7 * np.max(np.abs(want)))


def test_master_weights_are_checkpointed_and_restored_exactly(tmp_path):
    from jaxrl_agent import checkpoint

    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), models.init_params(CONFIG, jax.random.PRNGKey(0)))
    optimizer = learner.make_optimizer(learning_rate=1e-5, warmup_steps=1, total_steps=100)
    state = learner.init_state(params, optimizer, master_dtype="float32")
    state = state.replace(master_params=jax.tree.map(lambda m: m + 1e-6, state.master_params))
    saver = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), keep=1)
    saver.save(1, checkpoint.learner_arrays(state), checkpoint.RunState(
        stage="rl", iteration=1, version=1, elapsed_seconds=0.0, trained_tokens_total=0, source={}, replay={}, rng=[]))
    saver.close()
    reader = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), keep=1)
    assert reader.latest() is not None
    fresh = learner.init_state(params, optimizer, master_dtype="float32")
    restored, _ = checkpoint.restore_learner(reader, fresh)
    reader.close()
    for a, b in zip(jax.tree.leaves(restored.master_params), jax.tree.leaves(state.master_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_master_weights_never_alias_the_parameters():
    """The train step donates its state: a master copy sharing the parameters' buffers would be
    donated twice (a use-after-free). Parameters already in the master dtype keep no master copy."""
    params = models.init_params(CONFIG, jax.random.PRNGKey(0))
    optimizer = learner.make_optimizer(learning_rate=1e-5, warmup_steps=1, total_steps=100)
    assert learner.init_state(params, optimizer, master_dtype="float32").master_params is None
    bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    state = learner.init_state(bf16, optimizer, master_dtype="float32")
    pointers = {p.unsafe_buffer_pointer() for p in jax.tree.leaves(state.params)}
    assert not pointers & {m.unsafe_buffer_pointer() for m in jax.tree.leaves(state.master_params)}


def test_distillation_pulls_the_student_to_its_frozen_teacher_and_the_teacher_is_checkpointed(tmp_path):
    from jaxrl_agent import checkpoint

    config = models.ModelConfig(vocab_size=TOKENIZER.vocab_size, num_layers=1, hidden_size=32,
                                intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16)
    teacher = models.init_params(config, jax.random.PRNGKey(0))
    student = jax.tree.map(lambda p, n: p + 3.0 * n, teacher, models.init_params(config, jax.random.PRNGKey(1)))
    batch = jax.tree.map(jnp.asarray, replay.pack(_trajectories(4), 128, row_multiple=2)[0])
    objective = losses.make_objective([losses.DistillTerm(coef=1.0)])
    optimizer = learner.make_optimizer(learning_rate=3e-3, warmup_steps=1, total_steps=40)
    state = learner.init_state(student, optimizer, teacher_params=teacher)
    step = jax.jit(learner.make_train_step(config, optimizer, objective=objective))
    kls = []
    for _ in range(25):
        state, metrics = step(state, batch)
        kls.append(float(metrics["distill/kl_k3"]))
    assert kls[0] > 1.0 and kls[-1] < 0.5 * kls[0], kls
    assert all(jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.teacher_params), jax.tree.leaves(teacher)))
    # At the teacher the term is 0.
    _, at_teacher = step(learner.init_state(teacher, optimizer, teacher_params=teacher), batch)
    assert float(at_teacher["distill/loss"]) == 0.0
    # A resumed run distils against the same teacher.
    saver = checkpoint.Checkpointer(str(tmp_path / "ckpt"), keep=1)
    saver.save(1, checkpoint.learner_arrays(state), checkpoint.RunState("rl", 1, 1, 0.0, 0, {}, {}, []))
    blank = learner.init_state(student, optimizer, teacher_params=jax.tree.map(jnp.zeros_like, teacher))
    restored, _ = checkpoint.restore_learner(saver, blank)
    saver.close()
    for a, b in zip(jax.tree.leaves(restored.teacher_params), jax.tree.leaves(teacher)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
