"""model.positional="relative" (T5's bias, blocks.RelativeBias): cached decoding one token at a
time gives the teacher-forced logits past the bias's max distance, scanned layers too; packed
rows equal their sequences alone (the bias reads each segment's own positions); the bias
tables are each stack's own; bad settings are one-line errors. Agreement with transformers'
T5: tests/huggingface/test_t5.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.model.config import TransformerConfig
from transformer.model.transformer import Transformer, init_cache

V = 40
RELATIVE = dict(vocab_size=V, num_encoder_layers=2, num_decoder_layers=2, d_model=32, d_ff=48,
                num_heads=4, positional="relative", relative_buckets=8, relative_max_distance=6,
                norm="rms_norm", norm_position="pre", activation="geglu", use_bias=False,
                dropout_rate=0.0, attention_scale_dim=1, scale_embeddings=False)


def _params(cfg, inputs, targets):
    params = nn.unbox(Transformer(cfg).init(jax.random.key(0), inputs, targets)["params"])
    return jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, params)  # sharper bias


@pytest.mark.parametrize("scan_layers", [False, True])
def test_cached_decoding_equals_the_teacher_forced_logits(scan_layers):
    cfg = TransformerConfig(**RELATIVE, scan_layers=scan_layers)
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.integers(4, V, (2, 9)), jnp.int32).at[1, 6:].set(0)
    targets = jnp.asarray(rng.integers(4, V, (2, 12)), jnp.int32)  # past distance 6
    params = _params(cfg, inputs, targets)
    model = Transformer(cfg)
    assert params["encoder"]["relative_bias"]["embedding"].shape == (8, 4)
    assert not np.array_equal(params["encoder"]["relative_bias"]["embedding"],
                              params["decoder"]["relative_bias"]["embedding"])
    full = model.apply({"params": params}, inputs, targets)
    encoded = model.apply({"params": params}, inputs, method="encode")
    cache = init_cache(cfg, 2, 16)
    tokens = jnp.concatenate([jnp.full((2, 1), cfg.bos_id), targets[:, :-1]], axis=1)
    steps = []
    for t in range(targets.shape[1]):
        logits, cache = model.apply({"params": params}, encoded, inputs, tokens[:, t:t + 1],
                                    cache=cache, method="decode")
        steps.append(logits)
    # float32 rounding of logits up to ~7 (other sums in another order)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-4, rtol=0)


def test_packed_rows_equal_their_sequences_alone():
    cfg = TransformerConfig(**RELATIVE)
    rng = np.random.default_rng(1)
    a_in = rng.integers(4, V, 5)
    b_in = rng.integers(4, V, 7)
    a_tg = rng.integers(4, V, 4)
    b_tg = rng.integers(4, V, 8)
    inputs = jnp.asarray([np.concatenate([a_in, b_in])], jnp.int32)
    targets = jnp.asarray([np.concatenate([a_tg, b_tg])], jnp.int32)
    params = _params(cfg, inputs, targets)
    model = Transformer(cfg)
    packed = model.apply(
        {"params": params}, inputs, targets,
        inputs_positions=jnp.asarray([list(range(5)) + list(range(7))]),
        targets_positions=jnp.asarray([list(range(4)) + list(range(8))]),
        inputs_segmentation=jnp.asarray([[1] * 5 + [2] * 7]),
        targets_segmentation=jnp.asarray([[1] * 4 + [2] * 8]))
    for (source, target), part in (((a_in, a_tg), slice(0, 4)), ((b_in, b_tg), slice(4, 12))):
        alone = model.apply({"params": params}, jnp.asarray([source], jnp.int32),
                            jnp.asarray([target], jnp.int32))
        np.testing.assert_allclose(packed[:, part], alone, atol=2e-5, rtol=0)


@pytest.mark.parametrize("change, message", [
    (dict(relative_buckets=2), "model.relative_buckets=2"),
    (dict(relative_max_distance=4), "relative_max_distance=4 must be"),
    (dict(attention_window=4, attention_pattern="local"), "softmax attention over all"),
    (dict(attention_kind="linear"), "softmax attention over all"),
])
def test_bad_settings_are_one_line_errors(change, message):
    with pytest.raises(ValueError, match=message) as error:
        TransformerConfig(**RELATIVE | change)
    assert "\n" not in str(error.value)
