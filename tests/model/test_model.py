"""Tests of transformer.model.transformer: parameter paths and logical axes, parameter counts,
masking
behaviour (causality, padding, packing, permutation equivariance), incremental decoding with
the explicit cache, dropout, dtypes and config validation.

Parameters come from `jax.eval_shape(model.init)` (the structure, no allocation) filled with
seeded numpy draws: `model.init` itself costs ~10 s of compilation on CPU per config.
"""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from transformer.checkpoint.checkpointer import stack_layers, unstack_layers
from transformer.model.transformer import Transformer, TransformerConfig, init_cache, shift_right

V = 40
D = 32
F = 64
NH = 4
TINY = dict(vocab_size=V, d_model=D, d_ff=F, num_heads=NH, num_encoder_layers=2,
            num_decoder_layers=2, max_len=32, dropout_rate=0.0)


def tiny(**overrides) -> TransformerConfig:
    return TransformerConfig(**{**TINY, **overrides})


BASE = tiny()  # post-LN, sinusoidal, multi-head, tied output, not scanned
B = 2  # the shapes most tests share (one compilation per config)
S0 = 10
T0 = 8


# --------------------------------------------------------------------------- helpers


def _dummy_batch(cfg):
    inputs = jnp.ones((1, 4), jnp.int32)
    targets = jnp.ones((1, 3), jnp.int32)
    if cfg.architecture == "decoder":
        return None, targets
    if cfg.architecture == "encoder":
        return inputs, None
    return inputs, targets


@functools.cache
def abstract_variables(cfg):
    """The boxed (logically partitioned) variables as ShapeDtypeStructs."""
    return jax.eval_shape(Transformer(cfg).init, jax.random.key(0), *_dummy_batch(cfg))


def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    params = nn.unbox(abstract_variables(cfg))["params"]
    return {k: tuple(v.shape) for k, v in traverse_util.flatten_dict(params, sep="/").items()}


def param_dtypes(cfg):
    params = nn.unbox(abstract_variables(cfg))["params"]
    return {v.dtype for v in jax.tree.leaves(params)}


@functools.cache
def random_params(cfg, seed=0):
    """Seeded parameters with the structure of `model.init`: kernels ~ N(0, 1/fan_in),
    norm scales ~ 1, biases ~ 0.1, embeddings ~ N(0, 0.3^2)."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        names = [p.key for p in path]
        shape = leaf.shape
        if names[-1] == "scale":
            value = 1.0 + 0.1 * rng.normal(size=shape)
        elif names[-1] == "bias":
            value = 0.1 * rng.normal(size=shape)
        elif names[-1] == "embedding":
            value = 0.3 * rng.normal(size=shape)
        else:
            core = shape[1:] if "layers" in names else shape
            fan_in = core[0] if names[-2] in ("query", "key", "value") else math.prod(core[:-1])
            value = rng.normal(size=shape) / math.sqrt(fan_in)
        return jnp.asarray(value, jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, nn.unbox(abstract_variables(cfg)))


@functools.cache
def forward(cfg, deterministic=True):
    model = Transformer(cfg)

    @jax.jit
    def run(variables, inputs, targets, packing=None, rng=None):
        rngs = None if rng is None else {"dropout": rng}
        return model.apply(variables, inputs, targets, **(packing or {}),
                           deterministic=deterministic, rngs=rngs)

    return run


@functools.cache
def incremental(cfg, prefill):
    """Teacher-forced decoding through the cache: `prefill` tokens first, then one at a time
    in a lax.scan. Returns logits [B, T, V] and the final cache index."""
    model = Transformer(cfg)

    @jax.jit
    def run(variables, inputs, targets):
        b, t = targets.shape
        encoded = None
        if cfg.architecture == "encoder_decoder":
            encoded = model.apply(variables, inputs, method=Transformer.encode)
        tokens = shift_right(targets)
        cache = init_cache(cfg, b, t)
        first, cache = model.apply(variables, encoded, inputs, tokens[:, :prefill],
                                   cache=cache, method=Transformer.decode)

        def step(cache, token):
            logits, cache = model.apply(variables, encoded, inputs, token[:, None],
                                        cache=cache, method=Transformer.decode)
            return cache, logits[:, 0]

        cache, rest = jax.lax.scan(step, cache, tokens[:, prefill:].T)
        return jnp.concatenate([first, rest.swapaxes(0, 1)], axis=1), cache["index"]

    return run


def tokens(seed, shape, low=3):
    return jnp.asarray(np.random.default_rng(seed).integers(low, V, size=shape), jnp.int32)


def std_batch(seed=0):
    return tokens(seed, (B, S0)), tokens(seed + 1, (B, T0))


# --------------------------------------------------------------------------- parameter paths


def expected_param_shapes(cfg):
    """The parameter paths and shapes docs/architecture.md pins, written out."""
    d, f, n, kh, h, hv, v = (cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.num_kv_heads, cfg.d_k,
                             cfg.d_v, cfg.vocab_size)
    out = {"embedding/embedding": (v, d)}

    def attention(prefix):
        out.update({f"{prefix}/query/kernel": (d, n, h), f"{prefix}/key/kernel": (d, kh, h),
                    f"{prefix}/value/kernel": (d, kh, hv), f"{prefix}/out/kernel": (n, hv, d)})
        if cfg.use_bias:
            out.update({f"{prefix}/query/bias": (n, h), f"{prefix}/key/bias": (kh, h),
                        f"{prefix}/value/bias": (kh, hv), f"{prefix}/out/bias": (d,)})

    def ffn(prefix):
        out.update({f"{prefix}/ff_in/kernel": (d, f), f"{prefix}/ff_out/kernel": (f, d)})
        if cfg.activation == "swiglu":
            out[f"{prefix}/ff_gate/kernel"] = (d, f)
        if cfg.use_bias:
            out.update({f"{prefix}/ff_in/bias": (f,), f"{prefix}/ff_out/bias": (d,)})

    def norm(prefix):
        out[f"{prefix}/scale"] = (d,)
        if cfg.norm == "layer_norm":
            out[f"{prefix}/bias"] = (d,)

    stacks = {"encoder": cfg.num_encoder_layers, "decoder": cfg.num_decoder_layers}
    if cfg.architecture == "encoder":
        del stacks["decoder"]
    if cfg.architecture == "decoder":
        del stacks["encoder"]
    for part, num in stacks.items():
        for i in range(num):
            layer = f"{part}/layers_{i}"
            attention(f"{layer}/self_attention")
            norm(f"{layer}/norm_attention")
            ffn(f"{layer}/ffn")
            norm(f"{layer}/norm_ffn")
            if part == "decoder" and cfg.architecture == "encoder_decoder":
                attention(f"{layer}/cross_attention")
                norm(f"{layer}/norm_cross")
        if cfg.norm_position == "pre":
            norm(f"{part}/norm")
    if "decoder" in stacks and not cfg.tie_output_embedding:
        out["decoder/logits/kernel"] = (d, v)
    if cfg.scan_layers:  # layers_{i}/x [shape] -> layers/x [L, shape]
        scanned = {}
        for path, shape in out.items():
            parts = path.split("/")
            if len(parts) > 1 and parts[1].startswith("layers_"):
                path = "/".join([parts[0], "layers"] + parts[2:])
                shape = (stacks[parts[0]],) + shape
            scanned[path] = shape
        out = scanned
    return out


PATH_CONFIGS = {
    "paper": dict(),
    "gqa_dv_untied": dict(num_kv_heads=2, d_v=6, tie_output_embedding=False),
    "pre_rms_swiglu_nobias": dict(norm_position="pre", norm="rms_norm", activation="swiglu",
                                  use_bias=False, num_kv_heads=1),
    "pre_ln_scan": dict(norm_position="pre", scan_layers=True, num_decoder_layers=3),
    "decoder_only": dict(architecture="decoder", num_kv_heads=2, positional="rope"),
    "encoder_only": dict(architecture="encoder", norm_position="pre"),
}


@pytest.mark.parametrize("name", list(PATH_CONFIGS))
def test_parameter_paths_and_shapes(name):
    cfg = tiny(**PATH_CONFIGS[name])
    assert param_shapes(cfg) == expected_param_shapes(cfg)
    assert param_dtypes(cfg) == {jnp.dtype(jnp.float32)}


def test_expected_paths_spot_checks():
    """A few paths spelled out literally, so the builder above cannot drift unnoticed."""
    shapes = param_shapes(tiny(num_kv_heads=2, d_v=6, tie_output_embedding=False))
    assert shapes["embedding/embedding"] == (V, D)
    assert shapes["encoder/layers_0/self_attention/query/kernel"] == (D, NH, 8)
    assert shapes["encoder/layers_1/self_attention/key/kernel"] == (D, 2, 8)
    assert shapes["decoder/layers_1/cross_attention/value/kernel"] == (D, 2, 6)
    assert shapes["decoder/layers_0/cross_attention/out/kernel"] == (NH, 6, D)
    assert shapes["decoder/layers_0/ffn/ff_in/kernel"] == (D, F)
    assert shapes["decoder/layers_0/norm_cross/bias"] == (D,)
    assert shapes["decoder/logits/kernel"] == (D, V)
    scanned = param_shapes(tiny(scan_layers=True))
    assert scanned["encoder/layers/self_attention/query/kernel"] == (2, D, NH, 8)
    assert not any("layers_" in path for path in scanned)


def test_untied_source_embedding_is_a_second_table():
    shapes = param_shapes(tiny(share_embeddings=False))
    tables = [path for path, shape in shapes.items() if shape == (V, D)]
    assert "embedding/embedding" in tables and len(tables) == 2
    assert len(shapes) == len(param_shapes(BASE)) + 1


def _specs(cfg):
    specs = nn.get_partition_spec(abstract_variables(cfg))["params"]
    return {k: tuple(v) for k, v in traverse_util.flatten_dict(specs, sep="/").items()}


def test_logical_axis_names():
    cfg = tiny(tie_output_embedding=False, activation="swiglu")
    specs = _specs(cfg)
    layer = "decoder/layers_1"
    assert specs["embedding/embedding"] == ("vocab", "embed")
    assert specs[f"{layer}/self_attention/query/kernel"] == ("embed", "heads", "head_dim")
    assert specs[f"{layer}/self_attention/query/bias"] == ("heads", "head_dim")
    assert specs[f"{layer}/cross_attention/key/kernel"] == ("embed", "kv_heads", "head_dim")
    assert specs[f"{layer}/cross_attention/key/bias"] == ("kv_heads", "head_dim")
    assert specs[f"{layer}/cross_attention/value/kernel"] == ("embed", "kv_heads", "head_dim")
    assert specs[f"{layer}/self_attention/out/kernel"] == ("heads", "head_dim", "embed")
    assert specs[f"{layer}/self_attention/out/bias"] == ("embed",)
    assert specs[f"{layer}/ffn/ff_in/kernel"] == ("embed", "mlp")
    assert specs[f"{layer}/ffn/ff_gate/kernel"] == ("embed", "mlp")
    assert specs[f"{layer}/ffn/ff_in/bias"] == ("mlp",)
    assert specs[f"{layer}/ffn/ff_out/kernel"] == ("mlp", "embed")
    assert specs[f"{layer}/norm_ffn/scale"] == ("embed",)
    assert specs["decoder/logits/kernel"] == ("embed", "vocab")
    # Every parameter is named on every axis, with names from the one rules table.
    names = {"embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers"}
    shapes = param_shapes(cfg)
    assert specs.keys() == shapes.keys()
    for path, spec in specs.items():
        assert len(spec) == len(shapes[path]) and set(spec) <= names, (path, spec)


def test_logical_axis_names_scanned():
    cfg = tiny(scan_layers=True, norm_position="pre")
    specs = _specs(cfg)
    assert specs["encoder/layers/self_attention/query/kernel"] == (
        "layers", "embed", "heads", "head_dim")
    assert specs["decoder/layers/cross_attention/out/kernel"] == (
        "layers", "heads", "head_dim", "embed")
    assert specs["decoder/layers/norm_cross/scale"] == ("layers", "embed")
    assert specs["decoder/norm/scale"] == ("embed",)
    assert specs["embedding/embedding"] == ("vocab", "embed")
    for path, spec in specs.items():
        assert (spec[0] == "layers") == ("/layers/" in path), (path, spec)


# --------------------------------------------------------------------------- parameter counts


def paper_param_count(vocab, d_model, d_ff, layers=6):
    """Shared embedding + 6 encoder and 6 decoder layers (post-LN: no final norms)."""
    attention = 4 * (d_model * d_model + d_model)
    ffn = d_model * d_ff + d_ff + d_ff * d_model + d_model
    norm = 2 * d_model
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    return vocab * d_model + layers * (encoder_layer + decoder_layer)


def count(cfg):
    return sum(math.prod(shape) for shape in param_shapes(cfg).values())


def test_paper_base_and_big_parameter_counts():
    base = TransformerConfig()  # the defaults are the paper's base model
    assert (base.d_model, base.d_ff, base.num_heads, base.d_k, base.vocab_size) == (
        512, 2048, 8, 64, 37000)
    assert paper_param_count(37000, 512, 2048) == 63_082_496
    assert count(base) == 63_082_496
    big = TransformerConfig(d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3)
    assert count(big) == paper_param_count(37000, 1024, 4096)
    assert round(count(big) / 1e6, 1) == 214.2


# --------------------------------------------------------------------------- masking behaviour


ENCODER_ONLY = tiny(architecture="encoder", positional="none")


def test_encoder_without_positions_is_permutation_equivariant():
    variables = random_params(ENCODER_ONLY)
    inputs = np.array(tokens(2, (B, S0)))
    inputs[1, 3] = 0  # padding travels with its position
    perm = np.random.default_rng(3).permutation(S0)
    run = forward(ENCODER_ONLY)
    logits = np.asarray(run(variables, jnp.asarray(inputs), None))  # encoder, then E^T
    permuted = np.asarray(run(variables, jnp.asarray(inputs[:, perm]), None))
    np.testing.assert_allclose(permuted, logits[:, perm], atol=2e-5)
    assert np.abs(permuted - logits).max() > 0.1


def test_decoder_is_causal():
    variables = random_params(BASE)
    inputs, targets = std_batch(4)
    j = 3
    changed = np.array(targets)
    changed[:, j] = np.where(changed[:, j] == 5, 6, 5)
    run = forward(BASE)
    logits = run(variables, inputs, targets)
    logits_changed = run(variables, inputs, jnp.asarray(changed))
    assert logits.shape == (B, T0, V)
    # Logits at t predict targets[t] from targets[:t]: target j affects positions > j only.
    np.testing.assert_allclose(logits_changed[:, : j + 1], logits[:, : j + 1], atol=1e-5)
    assert np.abs(np.asarray(logits_changed[:, j + 1]) - np.asarray(logits[:, j + 1])).max() > 1e-3


def test_padding_does_not_change_unpadded_logits():
    variables = random_params(BASE)
    inputs = np.array(tokens(5, (B, 7)))
    targets = np.array(tokens(6, (B, 5)))
    inputs[1, 4:] = 0  # row 1 is shorter in both
    targets[1, 3:] = 0
    logits = forward(BASE)(variables, jnp.asarray(inputs), jnp.asarray(targets))
    padded_inputs = np.pad(inputs, ((0, 0), (0, S0 - 7)))
    padded_targets = np.pad(targets, ((0, 0), (0, T0 - 5)))
    padded = forward(BASE)(variables, jnp.asarray(padded_inputs), jnp.asarray(padded_targets))
    np.testing.assert_allclose(padded[0, :5], logits[0], atol=2e-5)
    np.testing.assert_allclose(padded[1, :3], logits[1, :3], atol=2e-5)
    # The source padding matters only as padding: a real token there changes the logits.
    padded_inputs[1, 4] = 7
    other = forward(BASE)(variables, jnp.asarray(padded_inputs), jnp.asarray(padded_targets))
    assert np.abs(np.asarray(other[1, :3]) - np.asarray(padded[1, :3])).max() > 1e-3


def test_packed_rows_equal_sequences_alone():
    variables = random_params(BASE)
    rng = np.random.default_rng(7)
    a_in = rng.integers(3, V, 4)
    a_tg = rng.integers(3, V, 3)
    b_in = rng.integers(3, V, 5)
    b_tg = rng.integers(3, V, 4)

    def pack(first, second, length):
        row = np.concatenate([first, second])
        pad = length - len(row)
        segments = np.array([1] * len(first) + [2] * len(second) + [0] * pad)
        positions = np.concatenate([np.arange(len(first)), np.arange(len(second)),
                                    np.zeros(pad, int)])
        return np.pad(row, (0, pad)), segments, positions

    rows = [(pack(a_in, b_in, S0), pack(a_tg, b_tg, T0)),
            (pack(b_in, a_in, S0), pack(b_tg, a_tg, T0))]
    inputs, inputs_seg, inputs_pos = (np.stack([r[0][i] for r in rows]) for i in range(3))
    targets, targets_seg, targets_pos = (np.stack([r[1][i] for r in rows]) for i in range(3))
    packing = dict(inputs_positions=inputs_pos, targets_positions=targets_pos,
                   inputs_segmentation=inputs_seg, targets_segmentation=targets_seg)
    packed = np.asarray(forward(BASE)(variables, jnp.asarray(inputs), jnp.asarray(targets),
                                      jax.tree.map(jnp.asarray, packing)))
    alone_inputs = np.stack([np.pad(a_in, (0, S0 - 4)), np.pad(b_in, (0, S0 - 5))])
    alone_targets = np.stack([np.pad(a_tg, (0, T0 - 3)), np.pad(b_tg, (0, T0 - 4))])
    alone = np.asarray(forward(BASE)(variables, jnp.asarray(alone_inputs),
                                     jnp.asarray(alone_targets)))
    np.testing.assert_allclose(packed[0, :3], alone[0, :3], atol=2e-5)
    np.testing.assert_allclose(packed[0, 3:7], alone[1, :4], atol=2e-5)
    np.testing.assert_allclose(packed[1, :4], alone[1, :4], atol=2e-5)
    np.testing.assert_allclose(packed[1, 4:7], alone[0, :3], atol=2e-5)
    # Without the segment ids the second sequence would see the first one.
    unpacked = np.asarray(forward(BASE)(variables, jnp.asarray(inputs), jnp.asarray(targets)))
    assert np.abs(unpacked[0, 3:7] - alone[1, :4]).max() > 1e-3


# --------------------------------------------------------------------------- decoding


DECODE_CONFIGS = {
    "post_ln_sinusoidal": (dict(), 1),
    "pre_ln_rope_mqa_rms": (dict(norm_position="pre", positional="rope", num_kv_heads=1,
                                 norm="rms_norm"), 2),
    "decoder_only_rope_gqa": (dict(architecture="decoder", positional="rope", num_kv_heads=2,
                                   norm_position="pre"), 1),
}


@pytest.mark.parametrize("name", list(DECODE_CONFIGS))
def test_incremental_decoding_equals_full_forward(name):
    overrides, prefill = DECODE_CONFIGS[name]
    cfg = tiny(**overrides)
    variables = random_params(cfg)
    inputs, targets = std_batch(8)
    inputs = inputs.at[1, 7:].set(0)  # source padding: the cached cross-attention masks it
    if cfg.architecture == "decoder":
        inputs = None
    full = forward(cfg)(variables, inputs, targets)
    stepped, index = incremental(cfg, prefill)(variables, inputs, targets)
    assert full.shape == stepped.shape == (B, T0, V)
    assert int(index) == T0
    np.testing.assert_allclose(stepped, full, atol=1e-4, rtol=1e-4)
    assert np.abs(np.asarray(full[:, 1:] - full[:, :-1])).max() > 0.1  # not constant


def test_scan_layers_equals_unrolled_layers_in_forward_and_decoding():
    scanned_cfg = dataclasses.replace(BASE, scan_layers=True)
    variables = random_params(BASE)
    stacked = {"params": stack_layers(variables["params"])}  # the checkpoint converter
    round_trip = unstack_layers(stacked["params"])
    assert jax.tree.structure(round_trip) == jax.tree.structure(variables["params"])
    for a, b in zip(jax.tree.leaves(round_trip), jax.tree.leaves(variables["params"]),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    abstract = nn.unbox(abstract_variables(scanned_cfg))
    assert jax.tree.structure(stacked) == jax.tree.structure(abstract)
    assert jax.tree.map(jnp.shape, stacked) == jax.tree.map(lambda x: x.shape, abstract)
    inputs, targets = std_batch(9)
    inputs = inputs.at[0, 6:].set(0)
    unrolled = forward(BASE)(variables, inputs, targets)
    np.testing.assert_allclose(forward(scanned_cfg)(stacked, inputs, targets), unrolled,
                               atol=2e-5)
    stepped, index = incremental(scanned_cfg, 3)(stacked, inputs, targets)
    assert int(index) == T0
    np.testing.assert_allclose(stepped, unrolled, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_remat_changes_no_logits(scan_layers):
    variables = random_params(BASE)
    inputs, targets = std_batch(14)
    expected = forward(BASE)(variables, inputs, targets)
    if scan_layers:
        variables = {"params": stack_layers(variables["params"])}
    cfg = dataclasses.replace(BASE, remat_policy="full", scan_layers=scan_layers)
    np.testing.assert_allclose(forward(cfg)(variables, inputs, targets), expected, atol=2e-5)


def test_output_head_and_decode_without_a_cache():
    """`output_head` is the logits unprojected; `decode` always returns (logits, cache)."""
    cfg = tiny(tie_output_embedding=False)
    variables = random_params(cfg)
    inputs, targets = std_batch(15)
    model = Transformer(cfg)

    @jax.jit
    def run(variables):
        head = model.apply(variables, inputs, targets, method=Transformer.output_head)
        encoded = model.apply(variables, inputs, method=Transformer.encode)
        decoded = model.apply(variables, encoded, inputs, targets, method=Transformer.decode)
        return head, model.apply(variables, inputs, targets), decoded

    head, logits, (decoded, cache) = run(variables)
    assert cache is None
    assert head.hidden.shape == (B, T0, D) and head.kernel.shape == (D, V)
    assert head.vocab_axis == 1
    np.testing.assert_allclose(head.logits(), logits, atol=1e-5)
    np.testing.assert_allclose(decoded, logits, atol=1e-5)


def test_init_cache_layout():
    cfg = tiny(num_kv_heads=2, d_v=6, dtype="bfloat16")
    cache = init_cache(cfg, 3, 5)
    assert int(cache["index"]) == 0
    assert sorted(cache) == ["index", "layers_0", "layers_1"]
    assert cache["layers_0"]["self_attention"]["key"].shape == (3, 2, 5, 8)  # heads first
    assert cache["layers_0"]["self_attention"]["value"].shape == (3, 2, 5, 6)
    assert cache["layers_0"]["self_attention"]["key"].dtype == jnp.bfloat16
    scanned = init_cache(dataclasses.replace(cfg, scan_layers=True), 3, 5)
    assert scanned["layers"]["self_attention"]["key"].shape == (2, 3, 2, 5, 8)
    with pytest.raises(ValueError, match="max_len"):
        init_cache(cfg, 1, cfg.max_len + 1)


# --------------------------------------------------------------------------- dropout, grads, dtypes


def test_dropout_and_gradients():
    # One layer each side keeps the compilation short; "rbg" keys compile much faster than
    # threefry on CPU and exercise the same rng plumbing (make_rng, scan splitting).
    cfg = tiny(dropout_rate=0.1, attention_dropout_rate=0.1, relu_dropout_rate=0.1,
               num_encoder_layers=1, num_decoder_layers=1)
    variables = random_params(cfg)
    inputs, targets = std_batch(10)
    model = Transformer(cfg)

    @jax.jit
    def run(variables, rng):
        deterministic = model.apply(variables, inputs, targets, deterministic=True,
                                    rngs={"dropout": rng})

        def loss(variables):
            logits = model.apply(variables, inputs, targets, deterministic=False,
                                 rngs={"dropout": rng})
            nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)
            return nll.mean(), logits

        (_, dropped), grads = jax.value_and_grad(loss, has_aux=True)(variables)
        return deterministic, dropped, grads

    det, dropped, grads = run(variables, jax.random.key(1, impl="rbg"))
    det_again, dropped_again, _ = run(variables, jax.random.key(1, impl="rbg"))
    det_other, dropped_other, _ = run(variables, jax.random.key(2, impl="rbg"))
    # deterministic=True ignores the rng: reproducible.
    np.testing.assert_array_equal(det_again, det)
    np.testing.assert_array_equal(det_other, det)
    # deterministic=False drops: outputs change, the same rng reproduces them.
    assert np.abs(np.asarray(dropped) - np.asarray(det)).max() > 1e-2
    np.testing.assert_array_equal(dropped_again, dropped)
    assert np.abs(np.asarray(dropped_other) - np.asarray(dropped)).max() > 1e-2
    # jax.grad through the whole model: every parameter gets a finite, nonzero gradient.
    flat = traverse_util.flatten_dict(grads["params"], sep="/")
    assert flat.keys() == param_shapes(cfg).keys()
    for path, g in flat.items():
        assert np.isfinite(np.asarray(g)).all(), path
        assert np.abs(np.asarray(g)).max() > 0, path


def test_bfloat16_compute_with_float32_params():
    cfg = dataclasses.replace(BASE, dtype="bfloat16")
    assert param_dtypes(cfg) == {jnp.dtype(jnp.float32)}
    variables = random_params(BASE)
    inputs, targets = std_batch(11)
    logits16 = np.asarray(forward(cfg)(variables, inputs, targets), np.float32)
    logits32 = np.asarray(forward(BASE)(variables, inputs, targets))
    assert np.isfinite(logits16).all()
    error = np.abs(logits16 - logits32).max()
    assert 1e-4 < error < 0.05 * np.abs(logits32).max(), error  # bf16 compute happened


def test_decoder_only_and_encoder_only_shapes():
    dec = tiny(architecture="decoder")
    variables = random_params(dec)
    _, targets = std_batch(12)
    changed = np.array(targets)
    changed[:, 5] = np.where(changed[:, 5] == 5, 6, 5)
    run = forward(dec)
    logits = run(variables, None, targets)
    logits_changed = run(variables, None, jnp.asarray(changed))
    assert logits.shape == (B, T0, V)
    np.testing.assert_allclose(logits_changed[:, :6], logits[:, :6], atol=1e-5)
    assert np.abs(np.asarray(logits_changed[:, 6:] - logits[:, 6:])).max() > 1e-3

    enc = ENCODER_ONLY
    variables = random_params(enc)
    inputs, _ = std_batch(13)
    changed = np.array(inputs)
    changed[:, -1] = np.where(changed[:, -1] == 5, 6, 5)
    logits = forward(enc)(variables, inputs, None)
    logits_changed = forward(enc)(variables, jnp.asarray(changed), None)
    assert logits.shape == (B, S0, V)
    # Bidirectional: the last token changes the first position's logits.
    assert np.abs(np.asarray(logits_changed[:, 0] - logits[:, 0])).max() > 1e-3


# --------------------------------------------------------------------------- config


BAD_CONFIGS = [
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(num_kv_heads=8), "num_kv_heads"),
    (dict(positional="alibi"), "positional"),
    (dict(architecture="decoder_only"), "architecture"),
    (dict(norm="batch_norm"), "norm"),
    (dict(norm_position="middle"), "norm_position"),
    (dict(activation="tanh"), "activation"),
    (dict(remat_policy="some"), "remat_policy"),
    (dict(attention_implementation="flash"), "attention_implementation"),
    (dict(dtype="int8"), "dtype"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(num_heads=0), "num_heads"),
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(d_ff=-1), "d_ff"),
    (dict(max_len=0), "max_len"),
    (dict(dropout_rate=1.0), "dropout_rate"),
    (dict(attention_dropout_rate=-0.1), "attention_dropout_rate"),
    (dict(relu_dropout_rate=1.5), "relu_dropout_rate"),
    (dict(positional="rope", d_k=7), "positional"),
    (dict(positional="sinusoidal", d_model=33, num_heads=1), "positional"),
    (dict(num_encoder_layers=0), "num_encoder_layers"),
    (dict(pad_id=5), "pad_id"),  # 0, or None where id 0 is an ordinary token
    (dict(pad_id=None, attention_kind="linear"), "pad_id"),  # local layers: segment ids
    (dict(bos_id=V), "bos_id"),
    (dict(eos_id=-1), "eos_id"),
]


@pytest.mark.parametrize("overrides,field", BAD_CONFIGS)
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"\bmodel\.{field}\b"):
        tiny(**overrides)


def test_num_heads_must_divide_d_model_unless_d_k_is_set():
    # d_model=30 with 4 heads and no d_k: heads of 30 // 4 = 7 would silently give
    # N * d_k = 28 != d_model. TransformerConfig's check for this can never fire.
    with pytest.raises(ValueError, match="num_heads"):
        tiny(d_model=30)
    assert tiny(d_model=30, d_k=8).d_k == 8  # explicit d_k is allowed


def test_config_defaults_and_from_dict():
    cfg = tiny(num_kv_heads=None, d_k=None, d_v=None)
    assert (cfg.num_kv_heads, cfg.d_k, cfg.d_v) == (NH, D // NH, D // NH)
    assert tiny(d_k=6).d_v == 6
    assert TransformerConfig.from_dict(dict(TINY)) == BASE
    with pytest.raises(ValueError, match="unknown model config keys.*'bogus'"):
        TransformerConfig.from_dict({**TINY, "bogus": 1})
    # Decoder-only and encoder-only need no layers on the other side.
    assert tiny(architecture="decoder", num_encoder_layers=0).num_encoder_layers == 0


def test_too_long_inputs_raise():
    variables = random_params(BASE)
    with pytest.raises(ValueError, match="max_len"):
        Transformer(BASE).apply(variables, jnp.ones((1, 33), jnp.int32),
                                jnp.ones((1, 4), jnp.int32))
