"""Context parallelism end to end on 8 fake CPU devices: the model with its positions split over
`mesh.context` (decoder-only, encoder-decoder, encoder; causal, packed, windowed, prefix LM)
gives the unsplit model's logits and gradients, and training steps with context 4 the losses
and parameters of context 1, its checkpoint restoring onto a mesh without context.

Equality with the unsplit model alone would also hold if the split model took the plain
attention (XLA's automatic sharding gathers what it needs), so each test also proves that
`ops/ring.py` ran: its `self_attention` is called once per self-attention layer, and the
program as lowered (before XLA partitions it, so before any collective of its own) holds the
strategy's collective, a collective_permute for "ring" and an all_gather for "all_gather"."""

from unittest import mock

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import train_steps
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from transformer.checkpoint.checkpointer import Checkpointer
from transformer.config import resolve
from transformer.model.transformer import Transformer, TransformerConfig
from transformer.ops import ring
from transformer.parallel import sharding
from transformer.training import train_state

B = 4
T = 32
V = 64


def _config(**fields) -> TransformerConfig:
    base = dict(architecture="decoder", vocab_size=V, num_encoder_layers=2,
                num_decoder_layers=2, d_model=32, d_ff=64, num_heads=4, num_kv_heads=2,
                dropout_rate=0.0, positional="rope", norm="rms_norm", norm_position="pre",
                activation="swiglu", use_bias=False, max_len=T, tie_output_embedding=False)
    return TransformerConfig(**{**base, **fields})


def _batch(cfg: TransformerConfig, kind: str) -> dict[str, np.ndarray]:
    """Token rows with padding; "packed" adds segments and positions, "prefix" a prefix."""
    rng = np.random.default_rng(0)
    targets = rng.integers(4, V, size=(B, T)).astype(np.int32)
    targets[0, 27:] = 0  # padding at the end of a row
    batch = {"targets": targets}
    if cfg.architecture != "decoder":
        inputs = rng.integers(4, V, size=(B, T)).astype(np.int32)
        inputs[1, 20:] = 0
        batch["inputs"] = inputs
    if kind == "packed":
        segments = np.ones((B, T), np.int32)
        segments[:, 11:] = 2
        segments[:, 25:] = 3
        segments[0, 27:] = 0
        starts = np.array([0, 11, 25])
        positions = np.arange(T) - starts[np.searchsorted(starts, np.arange(T), "right") - 1]
        batch |= {"targets_segmentation": segments,
                  "targets_positions": np.broadcast_to(positions, (B, T)).astype(np.int32)}
    if kind == "prefix":
        batch["targets_prefix"] = (np.arange(T) < 9)[None].repeat(B, 0).astype(np.int32)
    return batch


def _loss_and_grads(cfg: TransformerConfig, params, batch, mesh=None):
    """A loss reading every logit ((logits * fixed weights).sum()) and its gradient, on `mesh`
    with its rules and abstract mesh in scope (as the train step), or on one device."""
    model = Transformer(cfg)
    weights = np.random.default_rng(1).normal(size=(B, T, V)).astype(np.float32)
    inputs = batch.pop("inputs", None)

    def loss(params, batch):
        logits = model.apply({"params": params}, inputs, batch["targets"],
                             **{k: v for k, v in batch.items() if k != "targets"})
        return jnp.sum(logits * weights)

    fn = jax.value_and_grad(loss)
    if mesh is None:
        return jax.jit(fn)(params, batch)

    def on_mesh(params, batch):
        with nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES), \
                jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(params, batch)

    rows = NamedSharding(mesh, P(sharding.BATCH_AXES))
    step = jax.jit(on_mesh, in_shardings=(sharding.replicated(mesh), rows))
    with mock.patch.object(ring, "self_attention", wraps=ring.self_attention) as spy:
        lowered = step.lower(params, batch)
    _assert_ring_ran(cfg, spy.call_count, lowered.as_text())
    return step(params, batch)


def _self_attention_layers(cfg: TransformerConfig) -> int:
    return ((cfg.num_encoder_layers if cfg.architecture != "decoder" else 0)
            + (cfg.num_decoder_layers if cfg.architecture != "encoder" else 0))


def _assert_ring_ran(cfg: TransformerConfig, calls: int, lowered: str, steps: int = 1):
    """`ops/ring.py`'s attention took every self-attention layer (traced `steps` times), and
    its strategy's collective is in the lowered program (none is there otherwise: XLA adds
    its own collectives later, when it partitions)."""
    assert calls == steps * _self_attention_layers(cfg), calls
    collective = {"ring": "stablehlo.collective_permute",
                  "all_gather": "stablehlo.all_gather"}[cfg.context_parallel_strategy]
    assert collective in lowered


def _assert_same(cfg, kind, mesh_cfg):
    model = Transformer(cfg)
    batch = _batch(cfg, kind)
    params = model.init(jax.random.key(0), batch.get("inputs"), batch["targets"])["params"]
    params = nn.unbox(params)
    expected_loss, expected_grads = _loss_and_grads(cfg, params, dict(batch))
    mesh = sharding.make_mesh(mesh_cfg)
    loss, grads = _loss_and_grads(cfg, params, dict(batch), mesh)
    # A sum of B x T x V = 8,192 logit x weight products, |sum| ~ 30. Each logit is off by
    # float32 rounding (~1e-6 relative: the ring's online softmax against the plain one), and
    # with random signs that adds to ~sqrt(8,192) x 1e-6 of a term, ~3e-6 of the loss. The
    # largest seen was 2.2e-6.
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    flat, flat_expected = (jax.tree_util.tree_leaves_with_path(g) for g in (grads, expected_grads))
    # float32 rounding of the largest gradient: the key biases' gradient is only that (softmax
    # ignores a shift shared by all keys)
    atol = 1e-5 * max(np.abs(e).max() for _, e in flat_expected)
    for (path, g), (_, e) in zip(flat, flat_expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=atol, err_msg=jax.tree_util.keystr(path))


DATA_CONTEXT = {"data": 2, "fsdp": 1, "context": 4, "tensor": 1}
MIXED = {"data": 1, "fsdp": 2, "context": 2, "tensor": 2}
RING = {"data": 1, "fsdp": 1, "context": 8, "tensor": 1}


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("mesh_cfg", [DATA_CONTEXT, MIXED], ids=["data-context", "mixed"])
def test_causal_lm_equals_unsplit(strategy, mesh_cfg):
    _assert_same(_config(context_parallel_strategy=strategy), "plain", mesh_cfg)


@pytest.mark.parametrize("kind, fields", [
    ("packed", {}),
    ("plain", {"attention_pattern": "local,global", "attention_window": 5,
               "context_parallel_strategy": "ring"}),
    ("plain", {"attention_pattern": "local", "attention_window": 3,
               "attention_global_tokens": 2}),
    ("prefix", {"context_load_balance": False}),
], ids=["packed", "windowed-ring", "global-tokens", "prefix-unbalanced"])
def test_decoder_patterns_equal_unsplit(kind, fields):
    _assert_same(_config(**fields), kind, DATA_CONTEXT)


def test_eight_way_ring_equals_unsplit():
    _assert_same(_config(context_parallel_strategy="ring"), "packed", RING)


@pytest.mark.parametrize("fields", [
    {"architecture": "encoder_decoder", "positional": "sinusoidal", "norm_position": "post",
     "norm": "layer_norm", "activation": "relu", "use_bias": True},
    {"architecture": "encoder", "attention_pattern": "local", "attention_window": 4,
     "context_parallel_strategy": "ring"},
], ids=["encoder-decoder", "encoder-windowed"])
def test_encoders_equal_unsplit(fields):
    _assert_same(_config(**fields), "plain", MIXED)


def _train(cfg, mesh, num_steps, **resume):
    """(final state, per-step losses, trainer): `train_steps` with the losses alone."""
    state, lines, trainer = train_steps(cfg, mesh, num_steps, **resume)
    return state, np.array([float(line["loss"]) for line in lines]), trainer


def test_training_with_context_4_matches_context_1(load_config, tmp_path):
    """A decoder LM on the synthetic task (rows of 16 positions, padded), no dropout (under
    load balancing a dropout mask falls on other positions): 3 steps with data 2 x context 4
    give the losses and parameters of data 2 alone; the checkpoint restores onto data 2 and
    goes on as the run that never split."""
    cfg = load_config("tiny.py", **{
        "data.batch_size": 8, "data.max_length": 15, "model.architecture": "decoder",
        "model.dropout_rate": 0.0, "model.max_len": 16, "mesh.data": 2,
        "model.context_parallel_strategy": "ring"})
    unsplit = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 1}, jax.devices()[:2])
    with mock.patch.object(ring, "self_attention", wraps=ring.self_attention) as spy:
        expected_state, expected, _ = _train(cfg, unsplit, 5)
        assert spy.call_count == 0
        cfg.mesh.context = 4
        state, losses, trainer = _train(cfg, sharding.make_mesh(cfg.mesh), 3)
    # ops/ring.py took each of the decoder's self-attention layers, in each trace of the step
    layers = cfg.model.num_decoder_layers
    assert spy.call_count >= layers and spy.call_count % layers == 0, spy.call_count
    # float32 means over a batch's tokens, reordered by the split (seen: 5e-7 relative)
    np.testing.assert_allclose(losses, expected[:3], rtol=1e-5)
    kernel = state.params["decoder"]["layers_0"]["ffn"]["ff_in"]["kernel"]
    assert kernel.sharding.spec == P(("fsdp", "context"), "tensor")  # embed: fsdp x context

    checkpointer = Checkpointer(str(tmp_path), keep=1)
    checkpointer.save(3, state, {"next_batch_index": 3})
    checkpointer.close()
    cfg.mesh.context = 1
    restored, _ = Checkpointer(str(tmp_path), keep=1).restore(
        3, train_state.build_trainer(resolve(cfg, 2), unsplit).abstract_state)
    state, losses, _ = _train(cfg, unsplit, 2, state=restored, first_batch=3)
    np.testing.assert_allclose(losses, expected[3:], rtol=1e-5)
    got, want = (flax.traverse_util.flatten_dict(jax.device_get(s.params), sep="/")
                 for s in (state, expected_state))
    for path, value in want.items():
        # The key biases' gradient is rounding noise (softmax ignores a shift shared by all
        # keys) that Adam turns into steps of +-lr: compare the others.
        if not path.endswith("key/bias"):
            # Adam's steps are ~lr whatever the gradient's size: a gradient's float32
            # rounding (~1e-5 relative, above) moves 5 steps by ~5e-5 of lr, under atol
            # (seen: 2.2e-7); rtol for the weights' own rounding
            np.testing.assert_allclose(got[path], value, rtol=1e-4, atol=1e-6, err_msg=path)
