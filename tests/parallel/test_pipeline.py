"""Pipeline stages (`parallel/pipeline.py`, `model/pipelined.py`): the circular schedule
against hand-worked cases, its bubble, the one-line refusals, the stage axis of the mesh, and
the pipelined decoder's and ViT's losses and gradients (with and without context parallelism)
against the unpipelined model's on 8 fake CPUs."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.model import experts
from transformer.model.config import TransformerConfig
from transformer.model.transformer import Transformer
from transformer.model.vit import VisionTransformer
from transformer.parallel import pipeline, sharding
from transformer.training import optim

I = pipeline.IDLE


def test_schedule_matches_hand_worked_cases():
    # S=2, M=2, R=1: stage 1 runs each microbatch a tick after stage 0.
    assert pipeline.schedule(2, 2, 1).tolist() == [
        [[0, 0], [I, I]],
        [[1, 0], [0, 0]],
        [[I, I], [1, 0]]]
    # S=2, M=3, R=2: stage 0 runs microbatches 0, 1, 2 of repeat 0, then of repeat 1.
    assert pipeline.schedule(2, 3, 2).tolist() == [
        [[0, 0], [I, I]],
        [[1, 0], [0, 0]],
        [[2, 0], [1, 0]],
        [[0, 1], [2, 0]],
        [[1, 1], [0, 1]],
        [[2, 1], [1, 1]],
        [[I, I], [2, 1]]]


@pytest.mark.parametrize("stages,microbatches,repeats",
                         [(2, 2, 1), (4, 4, 1), (4, 8, 1), (2, 4, 2), (4, 5, 3), (3, 3, 2)])
def test_every_chunk_of_every_microbatch_runs_once_in_layer_order(stages, microbatches, repeats):
    """Microbatch m's chunk c = r S + s (stage s, repeat r) runs exactly once, and after its
    chunk c - 1 (at an earlier tick): M >= S suffices. The bubble is the formula's."""
    table = pipeline.schedule(stages, microbatches, repeats)
    when = {}
    for tick, row in enumerate(table):
        for stage, (m, r) in enumerate(row):
            if m != I:
                key = (int(m), int(r) * stages + stage)
                assert key not in when, f"{key} twice"
                when[key] = tick
    chunks = stages * repeats
    assert set(when) == {(m, c) for m in range(microbatches) for c in range(chunks)}
    for m in range(microbatches):
        assert all(when[m, c - 1] < when[m, c] for c in range(1, chunks))
    idle = (table[..., 0] == I).sum() / table[..., 0].size
    assert idle == pytest.approx(pipeline.bubble_fraction(stages, microbatches, repeats))
    assert pipeline.bubble_fraction(stages, microbatches, repeats) == pytest.approx(
        (stages - 1) / (microbatches * repeats + stages - 1))


def test_fewer_microbatches_than_stages_would_read_before_the_write():
    """Why the check asks M >= S: with M = S - 1 and R = 2, stage 0 starts microbatch 0's
    second repeat before the last stage has finished its first."""
    table = pipeline.schedule(3, 2, 2)
    first_repeat_done = next(t for t, row in enumerate(table) if row[2].tolist() == [0, 0])
    second_repeat_starts = next(t for t, row in enumerate(table) if row[0].tolist() == [0, 1])
    assert second_repeat_starts <= first_repeat_done


def tiny(**fields) -> TransformerConfig:
    """A 4-layer decoder-only model of width 32, scanned, no dropout."""
    return TransformerConfig(**{
        "architecture": "decoder", "vocab_size": 64, "num_encoder_layers": 0,
        "num_decoder_layers": 4, "d_model": 32, "d_ff": 64, "num_heads": 4, "num_kv_heads": 4,
        "max_len": 16, "scan_layers": True, "dropout_rate": 0.0, "attention_dropout_rate": 0.0,
        "relu_dropout_rate": 0.0, **fields})


@pytest.mark.parametrize("fields,match", [
    ({"num_decoder_layers": 6}, r"num_decoder_layers=6 is not divisible by mesh.stage=4 x "
                                r"mesh.pipeline_repeats=1"),
    ({"pipeline_repeats": 2}, r"num_decoder_layers=4 is not divisible by mesh.stage=4 x "
                              r"mesh.pipeline_repeats=2"),
    ({"pipeline_microbatches": 3}, r"mesh.pipeline_microbatches=3 is fewer than mesh.stage=4"),
    ({"architecture": "encoder_decoder", "num_encoder_layers": 4},
     r"model.architecture='encoder_decoder' has a text encoder stack, which the schedule does "
     r"not run yet \(nor carries the encoded rows to a decoder's stages\)"),
    ({"architecture": "encoder", "num_encoder_layers": 4, "num_decoder_layers": 0},
     r"model.architecture='encoder' has a text encoder stack"),
    ({"scan_layers": False}, r"set model.scan_layers=True"),
])
def test_bad_inputs_are_one_line_before_compiling(fields, match):
    shape = sharding.mesh_shape({"data": 2, "fsdp": 1, "tensor": 1, "stage": 4}, 8)
    with pytest.raises(ValueError, match=match) as error:
        sharding.validate_mesh_for_model(shape, tiny(**fields))
    assert "\n" not in str(error.value)
    shape = sharding.mesh_shape({"data": 1, "fsdp": 1, "context": 2, "tensor": 1, "stage": 4}, 8)
    sharding.validate_mesh_for_model(shape, tiny())  # stages compose with context
    sharding.validate_mesh_for_model(shape, tiny(num_experts=4))  # and with routed layers
    with pytest.raises(ValueError, match=r"mesh.pipeline_microbatches=-1 >= 1"):
        tiny(pipeline_microbatches=-1)
    # the same model without stages passes
    unsplit = sharding.mesh_shape({"data": 8, "fsdp": 1, "tensor": 1}, 8)
    sharding.validate_mesh_for_model(unsplit, tiny(**fields))


def test_a_run_config_sets_the_schedule_in_its_mesh_section(load_config):
    """mesh.pipeline_* reach the model's fields through `resolve` (and its checks, before any
    compile); the model section does not take them: a resume may change the layout."""
    from transformer.config import resolve

    def lm(**overrides):
        return load_config("lm_default.py", **{"model.scan_layers": True, "mesh.data": 2,
                                               "mesh.stage": 4, **overrides})

    model = resolve(lm(**{"mesh.pipeline_repeats": 1, "mesh.pipeline_microbatches": 8}),
                    8).model
    assert (model.pipeline_repeats, model.pipeline_microbatches) == (1, 8)
    with pytest.raises(ValueError, match="mesh.pipeline_microbatches=2 is fewer than mesh"):
        resolve(lm(**{"mesh.pipeline_microbatches": 2}), 8)
    cfg = lm()
    cfg.model.pipeline_repeats = 2
    with pytest.raises(ValueError, match="unknown config key 'model.pipeline_repeats'"):
        resolve(cfg, 8)


def test_stage_axis_comes_first_and_splits_the_stacked_layers():
    assert sharding.mesh_shape({"data": -1, "fsdp": 1, "tensor": 1, "stage": 1}, 8) == {
        "data": 8, "fsdp": 1, "context": 1, "tensor": 1}  # unsplit: not named
    assert sharding.mesh_shape({"data": -1, "fsdp": 1, "tensor": 1, "stage": 4}, 8) == {
        "stage": 4, "data": 2, "fsdp": 1, "context": 1, "tensor": 1}
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 1, "stage": 4})
    assert mesh.axis_names[0] == "stage" and mesh.shape["stage"] == 4
    model = Transformer(tiny())
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), None,
                                              jnp.ones((1, 1), jnp.int32))["params"])
    shardings = sharding.tree_shardings(boxed, mesh)
    assert shardings["decoder"]["layers"]["ffn"]["ff_in"]["kernel"].spec[0] == "stage"
    assert "stage" not in jax.tree.leaves(tuple(shardings["embedding"]["embedding"].spec))


def test_a_checkpoint_written_with_4_stages_restores_with_2_and_none(tmp_path):
    """The params saved sharded over 4 stages restore, bit for bit, onto 2 stages and onto a
    mesh without stages (the same paths and shapes; only the shardings differ)."""
    from transformer.checkpoint.checkpointer import Checkpointer

    model = Transformer(tiny())
    boxed = model.init(jax.random.key(0), None, jnp.ones((1, 4), jnp.int32))["params"]
    params = nn.unbox(boxed)

    def placed(mesh_cfg):
        shardings = sharding.tree_shardings(boxed, sharding.make_mesh(mesh_cfg))
        return shardings, jax.device_put(params, shardings)

    shardings, staged = placed({"data": 2, "fsdp": 1, "tensor": 1, "stage": 4})
    assert shardings["decoder"]["layers"]["ffn"]["ff_in"]["kernel"].spec[0] == "stage"
    checkpointer = Checkpointer(str(tmp_path), keep=1, use_async=False)
    checkpointer.save(1, staged, {})
    checkpointer.wait()
    for mesh_cfg in ({"data": 4, "fsdp": 1, "tensor": 1, "stage": 2},
                     {"data": 8, "fsdp": 1, "tensor": 1}):
        shardings, _ = placed(mesh_cfg)
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                params, shardings)
        restored, _ = checkpointer.restore(1, abstract)
        for want, got, sh in zip(jax.tree.leaves(params), jax.tree.leaves(restored),
                                 jax.tree.leaves(shardings), strict=True):
            assert got.sharding == sh
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    checkpointer.close()


def loss_and_grads_per_step(cfg: TransformerConfig, mesh_cfg: dict, steps: int):
    """[(loss, grads)] of `steps` plain SGD steps from the same init and rows, the model
    applied on the mesh `mesh_cfg` (its logical-axis rules and abstract mesh in context)."""
    model = Transformer(cfg)
    targets = jnp.asarray(np.random.default_rng(0).integers(1, 64, (16, 16)), jnp.int32)
    boxed = model.init(jax.random.key(0), None, targets[:1])["params"]

    def loss_fn(p):
        logits = model.apply({"params": p}, None, targets)
        sums = optim.cross_entropy_loss(logits, targets, jnp.ones(targets.shape),
                                        label_smoothing=0.0)
        return sums.loss_sum / sums.weight_sum

    return sgd_steps(loss_fn, boxed, mesh_cfg, steps)


def sgd_steps(loss_fn, boxed, mesh_cfg: dict, steps: int, has_aux: bool = False):
    """[(loss, grads)] of `steps` SGD steps (rate 0.5) of `loss_fn(params)` from the boxed
    params `boxed`, placed and applied on the mesh `mesh_cfg` ([(loss, grads, aux)] where
    `loss_fn` returns (loss, aux))."""
    mesh = sharding.make_mesh(mesh_cfg)
    params = jax.device_put(nn.unbox(boxed), sharding.tree_shardings(boxed, mesh))

    out = []
    with nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES), \
            jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        step = jax.jit(jax.value_and_grad(loss_fn, has_aux=has_aux))
        for _ in range(steps):
            loss, grads = step(params)
            loss, aux = loss if has_aux else (loss, None)
            out.append(jax.device_get((loss, grads) + ((aux,) if has_aux else ())))
            params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    return out


def assert_same(actual, expected):
    """Losses and gradients within 1e-5 relative (the issue's bound). float32 rounding
    (u = 6e-8) of the same sums in another order (the rows split into microbatches, the layers
    into stages) grows with the ~log2(256 tokens) to sqrt(256) terms summed: 5e-7 to 1e-6 of a
    leaf's scale, well inside. The key biases' gradients are zero in exact arithmetic (softmax
    ignores a shift shared by all keys), so their rounding is compared at the tree's scale.
    Over several steps each step's rounding is carried in the parameters to the next: that
    margin of 10-20x covers it while the steps stay few (the issue's 6)."""
    for (loss, grads), (want_loss, want_grads) in zip(actual, expected, strict=True):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
        flat = jax.tree_util.tree_flatten_with_path(want_grads)[0]
        for (path, want), got in zip(flat, jax.tree.leaves(grads), strict=True):
            name = jax.tree_util.keystr(path)
            leaf = scale if "'key']['bias'" in name else float(np.abs(want).max())
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * leaf, err_msg=name)


@pytest.fixture(scope="module")
def unpipelined():
    """The plain model's 6 steps on data 8 (shared by the comparisons; the issue's count)."""
    return loss_and_grads_per_step(tiny(), {"data": 8, "fsdp": 1, "tensor": 1}, 6)


def test_data_2_x_stage_4_gives_the_unpipelined_losses_and_gradients(unpipelined):
    """8 microbatches through 4 stages (each waits 4 ticks in the buffer between passes)."""
    cfg = tiny(pipeline_microbatches=8)
    mesh_cfg = {"data": 2, "fsdp": 1, "tensor": 1, "stage": 4}
    assert_same(loss_and_grads_per_step(cfg, mesh_cfg, 6), unpipelined)


def test_fsdp_2_x_stage_2_x_tensor_2_with_2_repeats_gives_the_same(unpipelined):
    """The circular schedule proper: each microbatch passes both stages twice."""
    cfg = dataclasses.replace(tiny(), pipeline_repeats=2, pipeline_microbatches=4)
    mesh_cfg = {"data": 1, "fsdp": 2, "tensor": 2, "stage": 2}
    assert_same(loss_and_grads_per_step(cfg, mesh_cfg, 6), unpipelined)


@pytest.mark.parametrize("strategy,mesh_cfg,microbatches,repeats", [
    ("ring", {"data": 2, "context": 2}, 4, 1),
    ("all_gather", {"data": 1, "context": 4}, 2, 2),
])
def test_stage_2_with_context_parallelism_gives_the_unpipelined_losses_and_gradients(
        unpipelined, strategy, mesh_cfg, microbatches, repeats):
    """Each stage's self-attention runs `ops/ring.py`'s shard_map over "context" inside the
    stages' vmap (the rows in the load-balanced order): the unpipelined, unsplit model's
    first 2 steps."""
    cfg = tiny(context_parallel_strategy=strategy, pipeline_microbatches=microbatches,
               pipeline_repeats=repeats)
    mesh_cfg = {"fsdp": 1, "tensor": 1, "stage": 2, **mesh_cfg}
    assert_same(loss_and_grads_per_step(cfg, mesh_cfg, 2), unpipelined[:2])


def test_context_microbatches_the_batch_shards_do_not_divide_is_one_line():
    """Context parallelism's attention splits each microbatch's rows over the batch shards."""
    model = Transformer(tiny(pipeline_microbatches=16))
    targets = jnp.ones((16, 16), jnp.int32)
    params = model.init(jax.random.key(0), None, targets[:1])["params"]
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "context": 2, "tensor": 1, "stage": 2})
    with nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES), \
            jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
            pytest.raises(ValueError, match=r"^mesh.pipeline_microbatches=16 leaves 1 rows a "
                                            r"microbatch, which the 2 batch shards") as error:
        jax.eval_shape(lambda p: model.apply({"params": p}, None, targets), params)
    assert "\n" not in str(error.value)


def moe_loss_and_grads_per_step(cfg: TransformerConfig, mesh_cfg: dict, steps: int):
    """`loss_and_grads_per_step` of a routed model, the loss plus its router losses, each
    step's `experts.statistics` appended: [(loss, grads, statistics)]."""
    model = Transformer(cfg)
    targets = jnp.asarray(np.random.default_rng(0).integers(1, 64, (16, 16)), jnp.int32)
    boxed = model.init(jax.random.key(0), None, targets[:1])["params"]

    def loss_fn(p):
        logits, sown = model.apply({"params": p}, None, targets, mutable=[experts.COLLECTION])
        sums = optim.cross_entropy_loss(logits, targets, jnp.ones(targets.shape),
                                        label_smoothing=0.0)
        stats = experts.statistics(sown[experts.COLLECTION])
        return (sums.loss_sum / sums.weight_sum + stats["moe_aux_loss"]
                + stats["router_z_loss"]), stats

    return sgd_steps(loss_fn, boxed, mesh_cfg, steps, has_aux=True)


@pytest.mark.parametrize("mesh_cfg", [
    {"data": 4, "fsdp": 1, "tensor": 1, "stage": 2},
    {"data": 2, "fsdp": 1, "tensor": 1, "stage": 2, "expert": 2}])
def test_routed_layers_in_the_stages_give_the_unpipelined_figures(mesh_cfg):
    """Capacity dispatch (tokens dropped) inside the stages, 2 microbatches, 2 repeats, with
    and without expert parallelism: loss (with the load-balancing and z losses), gradients and
    router statistics of the unpipelined model, over 2 steps. The load-balancing loss is a
    product of two means over the batch: the microbatches' sums are combined, not their losses
    averaged."""
    cfg = tiny(num_experts=4, experts_per_token=2, moe_capacity_factor=1.0)
    plain = moe_loss_and_grads_per_step(cfg, {"data": 8, "fsdp": 1, "tensor": 1}, 2)
    cfg = dataclasses.replace(cfg, pipeline_microbatches=2, pipeline_repeats=2)
    staged = moe_loss_and_grads_per_step(cfg, mesh_cfg, 2)
    assert_same([s[:2] for s in staged], [p[:2] for p in plain])
    assert plain[0][2]["moe_dropped"] > 0
    for (*_, got), (*_, want) in zip(staged, plain, strict=True):
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)


def tiny_vit(**fields) -> TransformerConfig:
    """A 4-layer ViT of width 32 on 8x8 images (4 patches and the class token), scanned."""
    return TransformerConfig(**{
        "architecture": "vision", "image_size": 8, "patch_size": 4, "num_channels": 3,
        "num_classes": 8, "num_encoder_layers": 4, "num_decoder_layers": 0, "d_model": 32,
        "d_ff": 64, "num_heads": 4, "num_kv_heads": 4, "positional": "learned",
        "activation": "gelu", "scan_layers": True, "dropout_rate": 0.0,
        "attention_dropout_rate": 0.0, "relu_dropout_rate": 0.0, **fields})


def vit_loss_and_grads_per_step(cfg: TransformerConfig, mesh_cfg: dict, steps: int):
    """`loss_and_grads_per_step` of the ViT: 16 images, their labels' cross entropy. The head
    starts random, not zero (the paper's init), so the first step's encoder gradients are
    not all zero."""
    model = VisionTransformer(cfg)
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(16, 8, 8, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 8, 16), jnp.int32)
    boxed = model.init(jax.random.key(0), images[:1])["params"]
    head = boxed["head"]["kernel"]
    boxed["head"]["kernel"] = head.replace_boxed(
        jax.random.normal(jax.random.key(1), head.value.shape) * 0.3)

    def loss_fn(p):
        logits = model.apply({"params": p}, images)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)
        return -jnp.mean(picked)

    return sgd_steps(loss_fn, boxed, mesh_cfg, steps)


def test_vit_on_data_2_x_stage_4_gives_the_unpipelined_losses_and_gradients():
    """The ViT's encoder stack through 4 stages, 8 microbatches of 2 images, over 2 steps:
    the unpipelined model's losses and gradients to float32 rounding (`assert_same`'s bound:
    80 tokens a step, fewer terms than the decoder's 256). Its parameter paths are the
    unpipelined model's (the same tree compares leaf by leaf)."""
    plain = vit_loss_and_grads_per_step(tiny_vit(), {"data": 8, "fsdp": 1, "tensor": 1}, 2)
    staged = vit_loss_and_grads_per_step(tiny_vit(pipeline_microbatches=8),
                                         {"data": 2, "fsdp": 1, "tensor": 1, "stage": 4}, 2)
    assert (jax.tree_util.tree_structure(staged[0][1])
            == jax.tree_util.tree_structure(plain[0][1]))
    assert_same(staged, plain)


def test_vit_on_stage_2_x_context_2_x_data_2_gives_the_unpipelined_losses_and_gradients():
    """The ViT (mean pooling: 4 patch tokens, which 2 context shards divide) with its tokens
    split over "context" inside the stages: the unpipelined, unsplit model's first step."""
    plain = vit_loss_and_grads_per_step(tiny_vit(pooling="gap"),
                                        {"data": 8, "fsdp": 1, "tensor": 1}, 1)
    staged = vit_loss_and_grads_per_step(
        tiny_vit(pooling="gap", pipeline_microbatches=2),
        {"data": 2, "fsdp": 1, "context": 2, "tensor": 1, "stage": 2}, 1)
    assert_same(staged, plain)


def test_vit_layers_not_divisible_by_stages_is_one_line():
    """The ViT's stack is `num_encoder_layers`: the mesh check at resolve time names that
    field, and so does the trace, before compiling."""
    config = tiny_vit(num_encoder_layers=6)
    with pytest.raises(ValueError, match=r"^model.num_encoder_layers=6 is not divisible by "
                                         r"mesh.stage=4 x mesh.pipeline_repeats=1$"):
        sharding.validate_mesh_for_model({"data": 2, "tensor": 1, "stage": 4}, config)
    model = VisionTransformer(config)
    images = jnp.zeros((8, 8, 8, 3))
    params = model.init(jax.random.key(0), images[:1])["params"]
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 1, "stage": 4})
    with nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES), \
            jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
            pytest.raises(ValueError, match=r"model.num_encoder_layers=6 is not divisible "
                                             r"by mesh.stage=4 x mesh.pipeline_repeats=1"
                          ) as error:
        jax.eval_shape(lambda p: model.apply({"params": p}, images), params)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_train_step_with_stages_and_accumulation_matches_the_plain_step(load_config):
    """The whole jitted train step (loss, gradient norm, Adam's updated params) of a packed
    batch, 2 accumulation microbatches each cut into 4 pipeline microbatches on data 2 x
    stage 4, against the same step on data 8, over 3 steps."""
    from transformer.config import resolve
    from transformer.training import train_state

    def cfg_for(mesh):
        return load_config("lm_default.py", **{
            "data.vocab_size": 64, "data.max_length": 16, "data.batch_size": 16,
            "grad_accum_steps": 2, "model.d_model": 32, "model.d_ff": 64,
            "model.num_heads": 4, "model.num_kv_heads": 2, "model.num_decoder_layers": 4,
            "model.max_len": 16, "model.dropout_rate": 0.0, "model.scan_layers": True,
            "mesh.pipeline_microbatches": 4, "optimizer.warmup_steps": 1,
            **{f"mesh.{axis}": size for axis, size in mesh.items()}})

    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):  # two packed sequences a row: positions and segment ids per row
        positions = np.tile(np.concatenate([np.arange(10), np.arange(6)]), (2, 16, 1))
        segments = np.tile(np.repeat([1, 2], [10, 6]), (2, 16, 1)).astype(np.int32)
        batches.append({"targets": rng.integers(1, 64, (2, 16, 16)).astype(np.int32),
                        "targets_positions": positions.astype(np.int32),
                        "targets_segmentation": segments})
    results = []
    for mesh_cfg in ({"data": 8}, {"data": 2, "stage": 4}):
        run = resolve(cfg_for(mesh_cfg), 8)
        mesh = sharding.make_mesh(run.config.mesh)
        trainer = train_state.build_trainer(run, mesh)
        state = train_state.init_state(trainer, 0)
        step = train_state.make_train_step(trainer, run.config)
        metrics = []
        for batch in batches:
            state, m = step(state, train_state.global_batch(mesh, batch))
            metrics.append({k: float(m[k]) for k in ("loss", "grad_norm")})
        results.append((metrics, jax.device_get(state.params)))
    (plain, plain_params), (staged, staged_params) = results
    for got, want in zip(staged, plain, strict=True):
        for key in want:  # float32 sums in another order, as `assert_same`
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    # Adam moves each parameter by at most ~lr a step whatever the gradient's size, so a
    # gradient that is rounding alone (the key biases' are zero in exact arithmetic) may step
    # either way: 2 lr a step bounds every difference; the losses and gradient norms above
    # carry the rest.
    bound = 2 * float(run.config.optimizer.learning_rate) * len(batches)
    for want, got in zip(jax.tree.leaves(plain_params), jax.tree.leaves(staged_params),
                         strict=True):
        assert float(np.abs(got - want).max()) <= bound
