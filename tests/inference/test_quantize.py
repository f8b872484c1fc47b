"""Int8 decoding (`quantize="int8"`): the scheme against numpy, the kernels and the KV cache
int8 with their bytes measured, logits within a first-order bound of the float model's, a
trained model's tokens, a 2x4 mesh, and the refusals."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import _load_config, train_steps
from ml_collections import ConfigDict

from transformer.inference import quantize as quantize_lib
from transformer.inference.generator import Generator
from transformer.inference.translator import Translator, load
from transformer.model.transformer import Transformer, TransformerConfig, init_cache
from transformer.ops import kv_cache
from transformer.parallel import sharding

qwix = pytest.importorskip("qwix")  # the `quantize` extra

V = 32
TINY_LM = dict(vocab_size=V, d_model=32, d_ff=64, num_heads=4, num_kv_heads=2,
               num_encoder_layers=0, num_decoder_layers=2, max_len=32, dropout_rate=0.0,
               norm_position="pre", use_bias=True, tie_output_embedding=False,
               architecture="decoder", activation="swiglu")
# |x - q * s| <= s / 2 in exact arithmetic. In float32, x / s carries a relative error of at
# most 2^-24 (|x / s| <= 127.5: 8e-6 absolute) and q * s another 2^-24 (|q| <= 128: 8e-6 in
# units of s), so the bound in float32 is s * (0.5 + 2e-5).
ROUNDING = 2e-5
# XLA divides by the constant 127.5 as a product with its float32 reciprocal: one rounding
# more than numpy's division, 2^-24 relative each, so the scales agree to 2^-23.
SCALE_RTOL = 2.0 ** -23


def reference_int8(x: np.ndarray, contracted: tuple[int, ...]):
    """numpy's (q, scale) of the scheme: scale = max|x| over the contracted axes / 127.5 (1
    where below sqrt(float32 tiny)), q = round half to even of x / scale, saturated to int8."""
    x = x.astype(np.float32)
    scale = np.max(np.abs(x), axis=contracted, keepdims=True) / np.float32(127.5)
    scale = np.where(scale < np.sqrt(np.finfo(np.float32).tiny), np.float32(1), scale)
    return np.clip(np.round(x / scale), -128, 127).astype(np.int8), scale.astype(np.float32)


def assert_same_int8(q, x, want_q, want_scale):
    """q equals numpy's, but where x / scale lies within float32 rounding (2^-20 relative,
    a few ulps) of a tie (k + 0.5): XLA's division may land on the other side and round to
    the neighbour. Both are within half a scale."""
    ratio = x.astype(np.float64) / want_scale
    near_tie = np.abs(np.abs(ratio - np.floor(ratio)) - 0.5) <= np.abs(ratio) * 2.0 ** -20
    q = np.asarray(q).astype(np.int64)
    assert np.all((q == want_q) | (near_tie & (np.abs(q - want_q) == 1)))


def test_cache_and_kernel_quantization_match_numpy_and_hold_the_bound():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 5, 8)).astype(np.float32) * rng.uniform(0.01, 10, (2, 3, 5, 1))
    x[0, 0, 0] = 0.0  # a zero vector: scale 1, q 0
    x[1, 2, 4, 3] = 50.0  # an outlier sets its vector's scale
    q, scale = map(np.asarray, kv_cache.quantize_int8(jnp.asarray(x)))
    want_q, want_scale = reference_int8(x, (-1,))
    assert_same_int8(q, x, want_q, want_scale)
    np.testing.assert_allclose(scale, want_scale, rtol=SCALE_RTOL)
    assert q.dtype == np.int8 and scale.shape == (2, 3, 5, 1) and scale[0, 0, 0, 0] == 1.0
    assert np.all(np.abs(x - q * scale) <= scale * (0.5 + ROUNDING))
    # Qwix's quantize (the kernels') is the same scheme.
    qa = qwix.quantize(jnp.asarray(x), jnp.int8, channelwise_axes=(0, 1, 2),
                       scale_dtype=jnp.float32)
    assert_same_int8(qa.qvalue, x, want_q, want_scale)

    # The kernels: one scale per output channel, the input axes contracted; a scanned
    # stack's L and the experts' E keep their own scales.
    shapes = {("decoder", "layers_0", "self_attention", "query", "kernel"): ((6, 2, 4), (0,)),
              ("decoder", "layers_0", "self_attention", "out", "kernel"): ((2, 4, 6), (0, 1)),
              ("decoder", "layers", "ffn", "ff_in", "kernel"): ((3, 6, 10), (1,)),
              ("decoder", "layers_1", "moe", "ff_out"): ((4, 10, 6), (1,)),
              ("encoder", "layers", "cross_attention", "value", "kernel"): ((3, 6, 2, 4), (1,))}
    params = {}
    for path, (shape, _) in shapes.items():
        node = params
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = rng.normal(size=shape).astype(np.float32)
    quantized = quantize_lib.quantize_params(params)
    for path, (_, contracted) in shapes.items():
        node, weights = quantized, params
        for name in path:
            node, weights = node[name], weights[name]
        want_q, want_scale = reference_int8(weights, contracted)
        assert_same_int8(node.qvalue, weights, want_q, want_scale)
        np.testing.assert_allclose(np.asarray(node.scale), want_scale, rtol=SCALE_RTOL)
        error = np.abs(np.asarray(quantize_lib.dequantize({"w": node})["w"]) - weights)
        assert np.all(error <= want_scale * (0.5 + ROUNDING))


def tiny_lm(**model):
    values = {**TINY_LM, **model}
    config = TransformerConfig(**values)
    params = nn.unbox(Transformer(config).init(jax.random.key(0), None,
                                               jnp.ones((1, 4), jnp.int32))["params"])
    return config, values, params


def test_int8_params_hold_the_kernels_in_a_quarter_of_their_bytes():
    """Attention, feed-forward and expert kernels are int8 (scales per output channel); the
    embeddings, output projection, norms, biases and router are not."""
    _, _, params = tiny_lm(num_experts=4, experts_per_token=2, moe_shared_expert=True,
                           d_model=16, d_ff=32, max_len=8)
    quantized = quantize_lib.quantize_params(params)
    flat = jax.tree_util.tree_leaves_with_path(
        quantized, is_leaf=lambda x: isinstance(x, qwix.QArray))
    int8 = {jax.tree_util.keystr(path, simple=True, separator="/")
            for path, leaf in flat if isinstance(leaf, qwix.QArray)}
    want = {f"decoder/layers_{i}/{name}" for i in (0, 1) for name in (
        *(f"self_attention/{p}/kernel" for p in ("query", "key", "value", "out")),
        *(f"ffn/{p}/kernel" for p in ("ff_in", "ff_gate", "ff_out")),
        "moe/ff_in", "moe/ff_gate", "moe/ff_out")}
    assert int8 == want
    kernels = [leaf for path, leaf in flat if isinstance(leaf, qwix.QArray)]
    floats = sum(leaf.qvalue.size * 4 for leaf in kernels)
    held = quantize_lib.tree_bytes(kernels)
    # int8 values (a quarter of float32's) plus a float32 scale per output channel, each over
    # at least 16 input values (d_model, N * H, d_ff): 4 more bytes per 16 at most.
    assert held == floats / 4 + sum(leaf.scale.size * 4 for leaf in kernels)
    assert held <= floats / 4 * (1 + 4 / 16)
    assert quantize_lib.tree_bytes(quantized) < quantize_lib.tree_bytes(params) / 2


def test_int8_cache_holds_half_the_bytes_and_its_entries_within_half_a_scale():
    """The int8 cache of a prompt read by the float model: the measured bytes (every array of
    the cache) at most half of the float32 cache's, and the first layer's keys and values
    (projections of the embeddings, which no cache error reaches) within s / 2 of the float
    cache's."""
    config, _, params = tiny_lm()
    model = Transformer(config)
    tokens = jnp.asarray(np.random.default_rng(1).integers(4, V, (2, 12)), jnp.int32)

    def fill(int8):
        cache = init_cache(config, 2, 16, int8=int8)
        return model.apply({"params": params}, None, None, tokens, cache=cache,
                           method="decode")[1]

    floats, int8 = fill(False), fill(True)
    assert quantize_lib.tree_bytes(int8) <= quantize_lib.tree_bytes(floats) / 2
    assert int8["layers_0"]["self_attention"]["key"].dtype == jnp.int8
    for name in ("key", "value"):
        entry = int8["layers_0"]["self_attention"]
        got = np.asarray(kv_cache.read(entry, jnp.float32)[name == "value"])
        want = np.asarray(floats["layers_0"]["self_attention"][name])
        scale = np.asarray(entry[f"{name}_scale"])
        assert np.all(np.abs(got - want) <= scale * (0.5 + ROUNDING))
        assert np.abs(got - want).max() > 0  # quantized, not stored as given


def test_int8_logits_within_the_first_order_bound_of_the_weight_and_cache_errors(monkeypatch):
    """A prompt's logits (greedy decoding's, teacher-forced) with int8 kernels and cache
    against float32's, within `assert_first_order_bound`."""
    config, _, params = tiny_lm()
    tokens = jnp.asarray(np.random.default_rng(2).integers(4, V, (2, 6)), jnp.int32)
    assert_first_order_bound(monkeypatch, config, params, tokens)


@pytest.mark.slow  # torch and transformers imported, a Jacobian over the whole model
def test_an_imported_llama_decodes_int8_within_the_bound(tmp_path, monkeypatch):
    """A checkpoint imported from Hugging Face (a tiny random Llama built by `transformers`:
    grouped-query attention, RoPE, SwiGLU, RMSNorm) opened by `open_run`: its kernels int8 and
    its logits within `assert_first_order_bound`."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformer.huggingface import convert
    from transformer.inference.runs import open_run

    hf_config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        initializer_range=0.2, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_config).eval().save_pretrained(tmp_path / "hf")
    convert.import_checkpoint(str(tmp_path / "hf"), str(tmp_path / "run"),
                              overrides={"model.dtype": "float32"})
    run = open_run(str(tmp_path / "run"), vocabulary="optional")
    int8 = Generator(run.config, run.model, run.params, None, quantize="int8")
    layer = int8.params["decoder"]["layers_1"]
    assert all(isinstance(layer[sub][name]["kernel"], qwix.QArray) for sub, names in (
        ("self_attention", ("query", "key", "value", "out")),
        ("ffn", ("ff_in", "ff_gate", "ff_out"))) for name in names)
    tokens = jnp.asarray([[2, 17, 5, 40]], jnp.int32)
    assert_first_order_bound(monkeypatch, run.model, run.params, tokens)


def assert_first_order_bound(monkeypatch, config, params, tokens):
    """The logits of `tokens` read into an empty cache with int8 kernels and cache, against
    float32's. The bound: first order in every error, each at most half a scale:
    sum |dlogit/dW| * s_W / 2 over the kernels' entries plus sum |dlogit/dk| * s_k / 2 over
    every key and value read from the cache, the derivatives at the float model (jacrev, with
    a zero perturbation added where the cache is read). Doubled: the second-order terms are
    smaller by the relative error, at most 1/255."""
    model = Transformer(config)
    quantized = quantize_lib.quantize_params(params)
    batch, length = tokens.shape

    def logits(params, int8=False):
        cache = init_cache(config, batch, length, int8=int8)
        return model.apply({"params": params}, None, None, tokens, cache=cache,
                           method="decode")[0]

    want = logits(params)
    got = logits(quantize_lib.dequantize(quantized), int8=True)

    reads = []
    read = kv_cache.read
    deltas = None

    def perturbed_read(cache, dtype):  # every read of the cache, in the order of the layers
        k, v = read(cache, dtype)
        reads.append((k, v))
        if deltas is None:
            return k, v
        dk, dv = deltas[len(reads) - 1]
        return k + dk, v + dv

    monkeypatch.setattr(kv_cache, "read", perturbed_read)
    logits(params)
    zeros = [(jnp.zeros_like(k), jnp.zeros_like(v)) for k, v in reads]
    cache_scales = [tuple(kv_cache.quantize_int8(x)[1] for x in pair) for pair in reads]

    def perturbed(params, perturbations):
        nonlocal deltas
        reads.clear()
        deltas = perturbations
        return logits(params)

    d_params, d_cache = jax.jacrev(perturbed, argnums=(0, 1))(params, zeros)
    deltas = None
    error = jnp.zeros_like(want)
    for path, scale in _kernel_scales(quantized):
        jac = d_params
        for name in path:
            jac = jac[name]
        error += (jnp.abs(jac) * scale / 2).sum(axis=tuple(range(want.ndim, jac.ndim)))
    for jacs, scales in zip(d_cache, cache_scales, strict=True):
        for jac, scale in zip(jacs, scales, strict=True):
            error += (jnp.abs(jac) * scale / 2).sum(axis=tuple(range(want.ndim, jac.ndim)))
    difference = np.abs(np.asarray(got) - np.asarray(want))
    assert np.all(difference <= 2 * np.asarray(error))
    assert difference.max() > 0  # the int8 path ran


def _kernel_scales(quantized):
    for path, leaf in jax.tree_util.tree_leaves_with_path(
            quantized, is_leaf=lambda x: isinstance(x, qwix.QArray)):
        if isinstance(leaf, qwix.QArray):
            yield tuple(k.key for k in path), leaf.scale


@pytest.fixture(scope="module")
def trained():
    """(float translator, its config, its params): a tiny encoder-decoder trained STEPS steps
    to reverse sequences of 3 to 5 of 12 ids (configs/tiny.py's task, shrunk)."""
    from transformer.config import resolve

    cfg = _load_config("tiny.py", **{
        "model.d_model": 32, "model.d_ff": 64, "model.num_encoder_layers": 1,
        "model.num_decoder_layers": 1, "model.dropout_rate": 0.0, "data.vocab_size": 16,
        "data.min_length": 3, "data.max_length": 5, "optimizer.warmup_steps": 20,
        "optimizer.learning_rate": 1e-2})
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    state, _, _ = train_steps(cfg, mesh, STEPS)
    params = jax.device_get(state.params)
    run = resolve(cfg, 1)
    return Translator(run.config, run.model, params, None), cfg, params


STEPS = 100


def sources(count=16, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 16, rng.integers(3, 6)).tolist() for _ in range(count)]


def test_a_trained_model_decodes_mostly_the_same_tokens_with_int8(trained):
    translator, cfg, params = trained
    int8 = Translator(translator.config, translator.model_config, params, None, "int8")
    for beam in (1, 4):
        want = translator.translate_ids(sources(), beam_size=beam, alpha=0.6,
                                        max_extra_length=4)
        got = int8.translate_ids(sources(), beam_size=beam, alpha=0.6, max_extra_length=4)
        learned = np.mean([t == r for row, s in zip(want, sources(), strict=True)
                           for t, r in zip(row, s[::-1], strict=False)])
        assert learned >= 0.5, learned  # it reverses (chance: 1/12), so the comparison tells
        assert (got == want).mean() >= 0.9


def test_int8_decoding_on_a_2x4_mesh_gives_the_one_device_tokens(trained):
    """Params sharded over data=2, tensor=4 (as training leaves them) quantize where they
    lie and decode the tokens of the one-device int8 translator."""
    translator, cfg, params = trained
    one = Translator(translator.config, translator.model_config, params, None, "int8")
    cfg = ConfigDict(cfg.to_dict())
    cfg.mesh.data, cfg.mesh.tensor = 2, 4
    from transformer.config import resolve
    from transformer.training import train_state

    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:8])
    trainer = train_state.build_trainer(resolve(cfg, 8), mesh)
    sharded = jax.device_put(params, trainer.state_shardings.params)
    assert dict(mesh.shape)["tensor"] == 4
    with jax.set_mesh(mesh):
        eight = Translator(translator.config, translator.model_config, sharded, None, "int8")
        kernel = eight.params["decoder"]["layers_0"]["ffn"]["ff_in"]["kernel"]
        assert len(kernel.qvalue.sharding.device_set) == 8
        got = eight.translate_ids(sources(8), beam_size=2, alpha=0.6, max_extra_length=4)
    want = one.translate_ids(sources(8), beam_size=2, alpha=0.6, max_extra_length=4)
    np.testing.assert_array_equal(got, want)


def test_int8_decoding_scanned_and_staged_gives_the_same_tokens(trained, monkeypatch):
    """The int8 cache through the other search paths: scanned layers (the cache's leading L
    axis, the kernels' per-layer scales) and a cache grown in stages with decided sentences
    dropped (`grow_cache` pads the int8 values and their scales) give the plain int8 tokens."""
    import dataclasses

    from transformer.checkpoint.checkpointer import stack_layers
    from transformer.inference import translator as translator_lib

    translator, cfg, params = trained
    plain = Translator(translator.config, translator.model_config, params, None, "int8")
    options = dict(beam_size=2, alpha=0.6, max_extra_length=4)
    want = plain.translate_ids(sources(8), **options)
    scanned = Translator(translator.config,
                         dataclasses.replace(translator.model_config, scan_layers=True),
                         stack_layers(params), None, "int8")
    assert scanned.params["decoder"]["layers"]["ffn"]["ff_in"]["kernel"].scale.shape[0] == 1
    np.testing.assert_array_equal(scanned.translate_ids(sources(8), **options), want)
    monkeypatch.setattr(translator_lib, "MIN_STAGED_LENGTH", 0)
    monkeypatch.setattr(translator_lib, "DECODE_STAGE", 3)
    monkeypatch.setattr(translator_lib, "DROP_CHECK", 2)
    np.testing.assert_array_equal(plain.translate_ids(sources(8), **options), want)


def test_local_and_linear_layers_keep_their_float_caches():
    """int8 applies to the caches of global softmax layers: a local layer's ring buffer and a
    linear layer's state stay float, and generation runs with them."""
    config, values, params = tiny_lm(attention_pattern="local,global", attention_window=3)
    cache = init_cache(config, 1, 8, int8=True)
    assert cache["layers_0"]["self_attention"]["key"].dtype == jnp.float32  # local
    assert "key_scale" not in cache["layers_0"]["self_attention"]
    assert cache["layers_1"]["self_attention"]["key"].dtype == jnp.int8  # global
    linear = init_cache(TransformerConfig(**{**TINY_LM, "attention_kind": "linear"}), 1, 8,
                        int8=True)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(linear["layers_0"]))
    cfg = ConfigDict({"model": values, "data": {"objective": "causal"}})
    generator = Generator(cfg, config, params, None, quantize="int8")
    tokens = generator.generate_ids([[5, 6, 7, 8, 9]], prompt_indices=[0], seed=0,
                                    max_new_tokens=6, temperature=0.0, top_k=0, top_p=1.0)
    assert tokens.shape == (1, 6)


def test_a_generator_with_int8_continues_greedily_as_the_float_one():
    """Generator(quantize="int8"): int8 kernels and cache on the language model path (a
    trained-like peaked model: its logits scaled, so that int8's errors change no argmax)."""
    config, values, params = tiny_lm()
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * (8.0 if "logits" in jax.tree_util.keystr(path) else 1.0), params)
    cfg = ConfigDict({"model": values, "data": {"objective": "causal"}})

    class Ids:
        eos_ids = (3,)

        def encode(self, texts):
            return [[4 + ord(c) % (V - 4) for c in text] for text in texts]

        def decode(self, ids):
            return ",".join(map(str, ids))

    options = dict(max_new_tokens=6, temperature=0.0, top_k=0, top_p=1.0, seed=0)
    prompts = ["abcde", "hello", "zq"]
    want = Generator(cfg, config, params, Ids()).generate(prompts, **options)
    int8 = Generator(cfg, config, params, Ids(), quantize="int8")
    assert isinstance(int8.params["decoder"]["layers_0"]["ffn"]["ff_in"]["kernel"],
                      qwix.QArray)
    assert int8.generate(prompts, **options) == want


def test_bad_quantization_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^quantize='int4' is not a quantization: choose one "
                                         r"of none, int8 \(--quantize=int8"):
        load(str(tmp_path / "no_such_run"), quantize="int4")  # before the workdir is read
    config, values, params = tiny_lm()
    cfg = ConfigDict({"model": values, "data": {"objective": "causal"}})
    with pytest.raises(ValueError, match="quantize='fp8' is not a quantization"):
        Generator(cfg, config, params, None, quantize="fp8")
    # Parameters without the kernels int8 decoding quantizes (not this project's paths).
    with pytest.raises(ValueError, match=r"^quantize='int8': the parameters hold no attention "
                                         r"or feed-forward kernel"):
        quantize_lib.quantize_params({"embedding": {"embedding": np.ones((4, 2), np.float32)}})
    # A kernel that no int8 scale represents (a diverged run's NaN), named by its path.
    broken = jax.tree.map(np.array, params)
    broken["decoder"]["layers_1"]["ffn"]["ff_out"]["kernel"][0, 0] = np.nan
    with pytest.raises(ValueError, match=r"^quantize='int8': decoder/layers_1/ffn/ff_out/kernel "
                                         r"in the parameters is not finite"):
        Generator(cfg, config, broken, None, quantize="int8")


@pytest.mark.slow
def test_the_commands_take_quantize(untrained_translation_workdir, untrained_lm_workdir):
    """--quantize=int8 on translate gives the API's int8 translation; an unknown name on
    generate is one line, before the run is read."""
    import subprocess
    import sys

    from conftest import ROOT

    result = subprocess.run([sys.executable, "-m", "transformer.translate",
                             f"--workdir={untrained_translation_workdir}", "--beam_size=1",
                             "--quantize=int8"], input=b"Opens a dialog.\n", cwd=ROOT,
                            capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr
    want = load(str(untrained_translation_workdir), quantize="int8").translate(
        ["Opens a dialog."], beam_size=1)
    assert result.stdout.decode() == want[0] + "\n"
    result = subprocess.run([sys.executable, "-m", "transformer.generate",
                             f"--workdir={untrained_lm_workdir}/missing", "--prompt=a",
                             "--quantize=int4"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: quantize='int4' is not a quantization: choose one of none, int8 "
        "(--quantize=int8: int8 weights and KV cache) (--help lists the flags)"]
