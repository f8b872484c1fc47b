"""LoRA (model/lora.py, training/lora.py): the adapted kernel against numpy, a fresh adapter
leaving the base's logits exact, the frozen base bit-identical through training while the
adapters learn, the same training on two meshes, merging, and the `finetune` checks. With
`lora_dropout`: the adapter beside the kernel against PEFT's formula in numpy, the branch
equal to the merged kernel, evaluation deterministic, training seeded and resumable."""

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


class _Layer(nn.Module):
    """An attention projection's arithmetic: y = x W + b (+ the adapter's branch)."""

    config: TransformerConfig
    shape: tuple
    axes: tuple
    num_in_axes: int

    @nn.compact
    def __call__(self, x, deterministic):
        kernel, bias, branch = Weights(self.shape, self.axes, num_in_axes=self.num_in_axes,
                                       lora_branch=True, name="out")(deterministic)
        y = jnp.einsum(_spec(self.num_in_axes, len(self.shape)), x, kernel) + bias
        return (y if branch is None else y + branch(x)), branch


def _spec(num_in, ndim):
    ins, outs = "abc"[:num_in], "xyz"[:ndim - num_in]
    return f"...{ins},{ins}{outs}->...{outs}"


@pytest.mark.parametrize("shape, axes, num_in", [
    ((6, 2, 3), ("heads", "head_dim", "embed"), 2),  # the output projection [N, H, D]
    ((6, 2, 3), ("embed", "heads", "head_dim"), 1)])  # a query projection [D, N, H]
def test_dropout_branch_is_pefts_formula_with_the_same_mask(shape, axes, num_in):
    """In training with lora_dropout p, the layer is PEFT's base(x) + lora_B(lora_A(
    dropout(x))) * scaling: numpy's x W + b + (alpha/r) ((x * mask / (1 - p)) A) B with the mask
    the branch draws (the `dropout` rng stream's); the kernel is W itself, not merged."""
    p = 0.4
    cfg = TransformerConfig(**TINY, lora_rank=2, lora_alpha=3.0, lora_dropout=p,
                            lora_targets="out")
    layer = _Layer(cfg, shape, axes, num_in)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, *shape[:num_in])).astype(np.float32)
    boxed = layer.init(jax.random.key(0), x, True)["params"]["out"]
    params = {name: rng.normal(size=np.shape(box.value)).astype(np.float32)
              for name, box in boxed.items()}
    got, branch = layer.apply({"params": {"out": params}}, x, False,
                              rngs={"dropout": jax.random.key(7)})
    assert isinstance(branch, lora.Branch) and branch.rate == p
    mask = np.asarray(jax.random.bernoulli(branch.rng, 1.0 - p, x.shape))
    assert 0.3 < 1 - mask.mean() < 0.5  # ~p of the inputs dropped
    fan_in = int(np.prod(shape[:num_in]))
    flat = x.reshape(-1, fan_in).astype(np.float64)
    dropped = np.where(mask.reshape(-1, fan_in), flat / (1 - p), 0.0)
    w = params["kernel"].reshape(fan_in, -1).astype(np.float64)
    a = params[lora.A].reshape(fan_in, 2).astype(np.float64)
    b = params[lora.B].reshape(2, -1).astype(np.float64)
    want = flat @ w + params["bias"].reshape(-1) + 1.5 * (dropped @ a) @ b
    # float32 sums of <= 12 products of N(0, 1) terms (|y| ~ 10): a few ulps of ~10
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, rtol=0, atol=2e-5)
    evaluated, none = layer.apply({"params": {"out": params}}, x, True)
    assert none is None  # evaluation: the merged kernel, no dropout
    merged = flat @ w + params["bias"].reshape(-1) + 1.5 * (flat @ a) @ b
    np.testing.assert_allclose(np.asarray(evaluated).reshape(want.shape), merged, rtol=0,
                               atol=2e-5)


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


def _trained_b(params, seed=2):
    """`params` with every `lora_b` random (a trained adapter's)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda p, v: rng.normal(0, 0.2, v.shape).astype(np.float32)
        if p[-1].key == lora.B else v, params)


def test_dropout_branch_equals_the_merged_kernel_and_evaluation_is_deterministic():
    """Every target kind (3-D attention kernels, the gated feed-forward): in training the
    adapters run beside the kernels. With lora_dropout 1e-9 (1 - 1e-9 is 1.0 in float32: no
    input dropped, scale 1) the branch's logits equal the merged kernels' (evaluation) within
    float32 rounding. With 0.5, training logits depend on the dropout rng and repeat with it;
    evaluation ignores the rng and equals a dropout-free model's bit for bit."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, 40, (2, 9)), jnp.int32)
    keys = jax.random.key(1), jax.random.key(2)

    def logits(p, params, rng=None):
        cfg = TransformerConfig(**TINY, lora_rank=4, lora_alpha=8.0, lora_dropout=p,
                                lora_targets=ALL)
        return np.asarray(Transformer(cfg).apply(
            {"params": params}, tokens, tokens, deterministic=rng is None,
            rngs={"dropout": keys[1] if rng is None else rng}))

    params = _trained_b(_init(TransformerConfig(**TINY, lora_rank=4, lora_targets=ALL)))
    merged = logits(0.0, params)
    # x W + s (x A) B against x (W + s A B): float32 sums in another order, logits ~5
    np.testing.assert_allclose(logits(1e-9, params, keys[0]), merged, rtol=0, atol=2e-5)
    first, again, other = (logits(0.5, params, k) for k in (keys[0], keys[0], keys[1]))
    np.testing.assert_array_equal(first, again)
    assert np.abs(first - other).max() > 0.1 and np.abs(first - merged).max() > 0.1
    np.testing.assert_array_equal(logits(0.5, params), merged)


def test_int8_quantizes_the_dropout_branch_as_the_kernels(monkeypatch):
    """LoRA and Qwix's int8 training combine: in training with lora_dropout the branch's two
    matmuls (x A over W's input axes, then (x A) B) go through Qwix's quantized einsum as the
    kernels' do, and the adapters' gradients are finite and nonzero."""
    from transformer.model import quantization

    qwix = pytest.importorskip("qwix")
    seen = []
    original = qwix.QtProvider.einsum

    def spy(self, spec, *operands, **kwargs):
        seen.append(spec)
        return original(self, spec, *operands, **kwargs)

    monkeypatch.setattr(qwix.QtProvider, "einsum", spy)
    cfg = TransformerConfig(**TINY | dict(num_decoder_layers=1), lora_rank=4, lora_alpha=8.0,
                            lora_dropout=0.2, lora_targets="out,ff_out")
    params = _trained_b(_init(cfg))
    model = quantization.quantize(Transformer(cfg), "int8")
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, 40, (2, 9)), jnp.int32)
    grads = jax.jit(jax.grad(lambda p: model.apply(
        {"params": p}, tokens, tokens, deterministic=False,
        rngs={"dropout": jax.random.key(1)}).sum()))(params)
    assert seen.count("...ab,abz->...z") == seen.count("...z,zc->...c") == 1  # out
    assert seen.count("...a,az->...z") == seen.count("...z,zb->...b") == 1  # ff_out
    for path, grad in _flat(grads).items():
        if lora.is_adapter(path[-1]):
            assert np.isfinite(grad).all() and np.abs(grad).max() > 0, path


def _flat(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, (*prefix, k)) if isinstance(v, dict) else {(*prefix, k): v})
    return out


def _config(load_config, lora_dropout=0.0, **mesh):
    cfg = load_config("tiny.py", **{"model.architecture": "decoder", "model.dropout_rate": 0.0,
                                    "data.batch_size": 16, "data.max_length": 11,
                                    "model.max_len": 12, "model.num_decoder_layers": 1})
    cfg.finetune = ConfigDict(dict(lora_rank=4, lora_alpha=8.0, lora_dropout=lora_dropout,
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


def test_lora_dropout_training_freezes_the_base_and_resumes_bit_exact(load_config):
    """lora_dropout 0.1, its masks from the run's dropout rng: three steps keep every base
    parameter bit-identical and move every adapter; two steps, then a third from that state
    (a resume), give the three steps' state bit for bit; fsdp 2 x tensor 4 gives data 8's
    losses and adapters (the same masks: JAX's random bits do not depend on the sharding),
    the adapters split as their kernels."""
    cfg = _config(load_config, lora_dropout=0.1, data=8)
    mesh = sharding.make_mesh(cfg.mesh)
    state, lines, trainer = train_steps(cfg, mesh, 3)
    before = _flat(jax.device_get(train_state.init_state(trainer, cfg.seed).params))
    moved = 0
    for path, value in _flat(jax.device_get(state.params)).items():
        if lora.is_adapter(path[-1]):
            moved += not np.array_equal(value, before[path])
        else:
            np.testing.assert_array_equal(value, before[path], err_msg="/".join(path))
    assert moved == 6, moved  # A and B of 3 targets, 1 layer
    half, _, _ = train_steps(cfg, mesh, 2)
    resumed, tail, _ = train_steps(cfg, mesh, 1, state=half, first_batch=2)
    assert float(tail[0]["loss"]) == float(lines[2]["loss"])
    for got, want in zip(jax.tree.leaves(resumed), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(got, want)
    split = _config(load_config, lora_dropout=0.1, data=1, fsdp=2, tensor=4)
    state2, lines2, _ = train_steps(split, sharding.make_mesh(split.mesh), 3)
    # float32 sums over other shards in another order (seen ~1e-7): a 1e-5 relative margin
    np.testing.assert_allclose([float(m["loss"]) for m in lines2],
                               [float(m["loss"]) for m in lines], rtol=1e-5)
    # Adam moved the adapters ~3e-4 a step; other masks move them ~2e-4 apart (seen), the
    # other mesh's float32 sums in another order a few ulps of values <1 (seen 1e-8)
    adapters = {k: v for k, v in _flat(jax.device_get(state.params)).items()
                if lora.is_adapter(k[-1])}
    for path, value in _flat(jax.device_get(state2.params)).items():
        if lora.is_adapter(path[-1]):
            np.testing.assert_allclose(value, adapters[path], rtol=0, atol=1e-6)
    query = state2.params["decoder"]["layers_0"]["self_attention"]["query"]
    assert query[lora.A].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    assert query[lora.B].sharding.spec[1] == "tensor"  # heads


@pytest.mark.parametrize("finetune, message", [
    (dict(lora_rank=-1), "finetune.lora_rank=-1 must be >= 0"),
    (dict(lora_rank=2, lora_targets="query,proj"), "'proj' names no module"),
    (dict(lora_rank=2, lora_targets="ff_gate"), "'ff_gate' names no module with"),
    (dict(lora_rank=2, lora_dropout=1.0), r"finetune.lora_dropout=1.0 must be in \[0, 1\)"),
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
