"""LoRA (model/lora.py, training/lora.py): the adapted kernel against numpy, a fresh adapter
leaving the base's logits exact, the frozen base bit-identical through training while the
adapters learn, the same training on two meshes, merging, and the `finetune` checks."""

import json
import runpy

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, _load_config, train_steps
from ml_collections import ConfigDict

from transformer.checkpoint.checkpointer import Checkpointer
from transformer.config import resolve
from transformer.model import lora
from transformer.model.blocks import Weights
from transformer.model.transformer import Transformer, TransformerConfig
from transformer.parallel import sharding
from transformer.training import train_state

TINY = dict(vocab_size=40, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=1,
            num_decoder_layers=2, max_len=16, dropout_rate=0.0, architecture="decoder",
            activation="swiglu", norm="rms_norm", norm_position="pre", positional="rope")
ALL = ",".join(lora.TARGETS)


class _Probe(nn.Module):
    """A parent with a config, as the attention and feed-forward layers are."""

    config: TransformerConfig
    shape: tuple
    axes: tuple
    num_in_axes: int

    @nn.compact
    def __call__(self):
        return Weights(self.shape, self.axes, num_in_axes=self.num_in_axes, use_bias=False,
                       name="out")()[0]


@pytest.mark.parametrize("shape, axes, num_in", [
    ((6, 2, 3), ("heads", "head_dim", "embed"), 2),  # the output projection [N, H, D]
    ((6, 2, 3), ("embed", "heads", "head_dim"), 1)])  # a query projection [D, N, H]
def test_adapted_kernel_is_w_plus_scaled_ab_as_numpy(shape, axes, num_in):
    """W + (alpha/r) A B with A [in..., r] (PEFT's uniform bound 1/sqrt(fan_in)), B [r, out...]
    (zeros), logical axes W's in, W's out and the rank replicated; x W_adapted equals numpy's
    x W + (alpha/r) (x A) B."""
    cfg = TransformerConfig(**TINY, lora_rank=2, lora_alpha=3.0, lora_targets="out")
    probe = _Probe(cfg, shape, axes, num_in)
    boxed = probe.init(jax.random.key(0))["params"]["out"]
    assert boxed[lora.A].names == (*axes[:num_in], None)
    assert boxed[lora.B].names == (None, *axes[num_in:])
    fan_in = int(np.prod(shape[:num_in]))
    a0 = np.asarray(boxed[lora.A].value)
    assert a0.shape == (*shape[:num_in], 2) and 0 < np.abs(a0).max() <= fan_in ** -0.5
    assert not np.asarray(boxed[lora.B].value).any()
    rng = np.random.default_rng(0)
    params = {name: rng.normal(size=np.shape(box.value)).astype(np.float32)
              for name, box in boxed.items()}
    got = np.asarray(probe.apply({"params": {"out": params}}))
    w = params["kernel"].reshape(fan_in, -1).astype(np.float64)
    a = params[lora.A].reshape(fan_in, 2).astype(np.float64)
    b = params[lora.B].reshape(2, -1).astype(np.float64)
    x = rng.normal(size=(5, fan_in))
    # float32 W + 1.5 (A B) over a rank-2 sum: a few ulps of |W| + 1.5 |A||B| (~10)
    np.testing.assert_allclose(got.reshape(fan_in, -1), w + 1.5 * a @ b, rtol=0, atol=1e-5)
    np.testing.assert_allclose(x @ got.reshape(fan_in, -1), x @ w + 1.5 * (x @ a) @ b,
                               rtol=1e-5, atol=1e-4)


def _init(cfg: TransformerConfig):
    tokens = jnp.ones((1, 1), jnp.int32)
    return nn.unbox(Transformer(cfg).init(jax.random.key(0), tokens, tokens)["params"])


def _logits(cfg, params, tokens):
    return Transformer(cfg).apply({"params": params}, tokens, tokens)


def _base_of(params):
    """The params without adapters."""
    if not isinstance(params, dict):
        return params
    return {k: _base_of(v) for k, v in params.items() if k not in (lora.A, lora.B)}


@pytest.mark.parametrize("scan_layers", [False, True])
def test_fresh_adapters_give_the_base_logits_exactly_and_merge_equals_unmerged(scan_layers):
    """B = 0 at init: the adapted model's logits are the base model's bit for bit. With B
    trained (random here), merging W + (alpha/r) A B into the kernels gives a plain model whose
    logits equal the adapted model's within float32 rounding. Per-layer and scanned layouts."""
    base_cfg = TransformerConfig(**TINY, scan_layers=scan_layers)
    cfg = TransformerConfig(**TINY, scan_layers=scan_layers, lora_rank=4, lora_alpha=8.0,
                            lora_targets=ALL)
    params = _init(cfg)
    names = {"/".join(k) for k in _flat(params)}
    layer = "layers" if scan_layers else "layers_1"
    assert f"decoder/{layer}/ffn/ff_gate/lora_b" in names
    assert f"decoder/{layer}/self_attention/out/lora_a" in names
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, 40, (2, 9)), jnp.int32)
    base = _base_of(params)
    np.testing.assert_array_equal(_logits(cfg, params, tokens), _logits(base_cfg, base, tokens))

    rng = np.random.default_rng(2)
    trained = jax.tree_util.tree_map_with_path(
        lambda p, v: rng.normal(0, 0.2, v.shape).astype(np.float32)
        if p[-1].key == lora.B else v, params)
    adapted = _logits(cfg, trained, tokens)
    assert np.abs(np.asarray(adapted) - np.asarray(_logits(base_cfg, base, tokens))).max() > 0.1
    merged = lora.merge(trained, cfg)
    assert jax.tree.structure(merged) == jax.tree.structure(base)
    # the same float32 sums, the merge's W + s A B rounded once more: logits of size ~5
    np.testing.assert_allclose(_logits(base_cfg, merged, tokens), adapted, rtol=0, atol=2e-5)


def _flat(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, (*prefix, k)) if isinstance(v, dict) else {(*prefix, k): v})
    return out


def _config(load_config, **mesh):
    cfg = load_config("tiny.py", **{"model.architecture": "decoder", "model.dropout_rate": 0.0,
                                    "data.batch_size": 16, "data.max_length": 11,
                                    "model.max_len": 12, "model.num_decoder_layers": 1})
    cfg.finetune = ConfigDict(dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0,
                                   lora_targets=["query", "value", "ff_out"]))
    cfg.mesh.update(mesh)
    return cfg


def test_training_moves_only_the_adapters_on_any_mesh(load_config, tmp_path):
    """Three steps of Adam: every base parameter is bit-identical to its init and holds no
    optimizer state; every adapter moved; the state (frozen leaves without optimizer state)
    checkpoints and restores. Data 8 and fsdp 2 x tensor 4 give the same losses, and on the
    latter the adapters are split as their kernels (W's in axis on A, out on B)."""
    cfg = _config(load_config, data=8)
    mesh = sharding.make_mesh(cfg.mesh)
    trainer = train_state.build_trainer(resolve(cfg, mesh.size), mesh)
    state = train_state.init_state(trainer, cfg.seed)
    before = jax.device_get(state.params)
    moments = [leaf.size for leaf in jax.tree.leaves(state.opt_state)]
    adapter_size = sum(v.size for k, v in _flat(before).items() if lora.is_adapter(k[-1]))
    assert sum(moments) - 1 <= 2 * adapter_size + 2  # mu, nu of the adapters; counts
    state, lines, _ = train_steps(cfg, mesh, 3, state=state)
    after = jax.device_get(state.params)
    moved = 0
    for path, value in _flat(after).items():
        if lora.is_adapter(path[-1]):
            moved += not np.array_equal(value, _flat(before)[path])
        else:
            np.testing.assert_array_equal(value, _flat(before)[path], err_msg="/".join(path))
    assert moved == 6, moved  # A and B of 3 targets, 1 layer
    checkpointer = Checkpointer(str(tmp_path), keep=1)
    checkpointer.save(3, state, {"next_batch_index": 3})
    checkpointer.close()
    restored, _ = Checkpointer(str(tmp_path), keep=1).restore(3, trainer.abstract_state)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(got, want)

    split = _config(load_config, data=1, fsdp=2, tensor=4)
    state2, lines2, _ = train_steps(split, sharding.make_mesh(split.mesh), 3)
    # float32 sums over other shards in another order (seen ~1e-7): a 1e-5 relative margin
    np.testing.assert_allclose([float(m["loss"]) for m in lines2],
                               [float(m["loss"]) for m in lines], rtol=1e-5)
    attention = state2.params["decoder"]["layers_0"]["self_attention"]
    assert attention["query"][lora.A].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    assert attention["query"][lora.B].sharding.spec[1] == "tensor"  # heads
    assert state2.params["decoder"]["layers_0"]["ffn"]["ff_out"][lora.A].sharding.spec[0] == (
        "tensor")  # mlp


@pytest.mark.parametrize("finetune, message", [
    (dict(lora_rank=-1), "finetune.lora_rank=-1 must be >= 0"),
    (dict(lora_rank=2, lora_targets="query,proj"), "'proj' names no module"),
    (dict(lora_rank=2, lora_targets="ff_gate"), "'ff_gate' names no module with"),
    (dict(lora_rank=2, lora_dropout=0.1), "finetune.lora_dropout=0.1 is not supported"),
    (dict(lora_rank=2, lora_alpha=0.0), "finetune.lora_alpha=0.0 must be positive"),
    (dict(lora_rank=2, lora_targets="ff_in", num_experts=4), "routed experts take no"),
    (dict(lora_rank=2, lora_targets=""), "names no module; give some of"),
])
def test_bad_finetune_settings_are_one_line(load_config, finetune, message):
    cfg = load_config("tiny.py", **{"model.architecture": "decoder"})
    experts = finetune.pop("num_experts", 0)
    if experts:
        cfg.model.num_experts = experts
        cfg.model.experts_per_token = 2
    cfg.finetune = ConfigDict(finetune)
    with pytest.raises(ValueError, match=message) as error:
        resolve(cfg)
    assert "\n" not in str(error.value)


def test_finetune_config_takes_lora_flags_and_keeps_an_imported_adapters_section(tmp_path):
    """configs/finetune.py has the `finetune` section (off), so --config.finetune.lora_rank=8
    reaches the model; a pretrained run's own section (an imported PEFT adapter's) is kept."""
    recorded = {"model": _load_config("lm_default.py").model.to_dict()}
    (tmp_path / "config.json").write_text(json.dumps(recorded))
    get_config = runpy.run_path(str(ROOT / "configs" / "finetune.py"))["get_config"]
    cfg = get_config(str(tmp_path))
    assert resolve(cfg).model.lora_rank == 0
    cfg.finetune.lora_rank = 8
    cfg.finetune.lora_targets = "query,key,value,out"
    model = resolve(cfg).model
    assert (model.lora_rank, lora.targets(model)) == (8, ("query", "key", "value", "out"))
    section = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_targets="value")
    (tmp_path / "config.json").write_text(json.dumps(recorded | {"finetune": section}))
    assert resolve(get_config(str(tmp_path))).model.lora_targets == "value"
