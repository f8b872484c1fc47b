"""Sparse attention patterns and linear attention: sliding windows and global tokens against the
dense formula in numpy with the same mask (xla and chunked, gradients included), the chunked
kernel's block skipping, linear attention against its quadratic form (non-causal, causal,
packed, prefix LM, recurrent decoding), and a tiny decoder LM with a local/global pattern and
with linear attention that trains and decodes as it recomputes."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import np_causal, np_segment, qkv, reference_attention

from transformer.inference import decoding
from transformer.model.transformer import BOS_ID, Transformer, TransformerConfig, init_cache
from transformer.ops import attention, chunked, linear_attention, masks

pytestmark = pytest.mark.usefixtures("strict_dtype_promotion")


def np_window(t, s, left, right):
    """[1, 1, T, S]: query t attends keys t - left .. t + right."""
    offset = np.arange(s)[None, :] - np.arange(t)[:, None]
    return ((offset >= -left) & (offset <= right))[None, None]


def test_make_local_mask_by_hand_and_as_jax_nn_reads_local_window_size():
    mask = masks.make_local_mask(jnp.arange(5), jnp.arange(5), (2, 1))
    expected = [[1, 1, 0, 0, 0],
                [1, 1, 1, 0, 0],
                [1, 1, 1, 1, 0],
                [0, 1, 1, 1, 1],
                [0, 0, 1, 1, 1]]
    np.testing.assert_array_equal(mask[0, 0], np.asarray(expected, bool))
    np.testing.assert_array_equal(masks.make_local_mask(jnp.arange(4), jnp.arange(4), 1),
                                  np_window(4, 4, 1, 1))
    q, k, v = qkv(0, t=7, s=7)
    ours = attend_window(q, k, v, window=(3, 1))
    theirs = jax.nn.dot_product_attention(q, k, v, local_window_size=(3, 1))
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_make_global_mask_by_hand():
    mask = masks.make_global_mask(jnp.array([[1, 0, 0, 1]]))
    expected = [[1, 1, 1, 1], [1, 0, 0, 1], [1, 0, 0, 1], [1, 1, 1, 1]]
    np.testing.assert_array_equal(mask[0, 0], np.asarray(expected, bool))


@functools.partial(jax.jit, static_argnames=("implementation", "key_chunk_size", "window"))
def attend_window(q, k, v, mask=None, implementation="xla", key_chunk_size=4, window=None):
    return attention.dot_product_attention(q, k, v, mask=mask, implementation=implementation,
                                           key_chunk_size=key_chunk_size,
                                           local_window_size=window)


WINDOWS = [((2, 0), "causal"), (3, None), ((1, 4), None), ((0, 0), "segments"),
           ((5, 2), "segments")]


@pytest.mark.parametrize("implementation,chunk", [("xla", 4), ("chunked", 4), ("chunked", 5)])
@pytest.mark.parametrize("window,extra", WINDOWS)
def test_window_matches_the_dense_formula_with_the_same_mask(implementation, chunk, window,
                                                             extra):
    t = 13
    q, k, v = qkv(1, b=2, t=t, s=t, n=4, kh=2)
    left, right = (window, window) if isinstance(window, int) else window
    dense = np_window(t, t, left, right)
    mask = None
    if extra == "causal":
        mask = np_causal(t)
    elif extra == "segments":
        segments = np.array([[1] * 5 + [2] * 6 + [0] * 2, [1] * 13], np.int32)
        mask = np_segment(segments, segments)
    expected = reference_attention(q, k, v, mask=dense if mask is None else dense & mask)
    out = attend_window(q, k, v, None if mask is None else jnp.asarray(mask),
                        implementation=implementation, key_chunk_size=chunk, window=window)
    np.testing.assert_allclose(out, expected, atol=2e-5)


@pytest.mark.parametrize("window,chunk", [((3, 0), 4), ((2, 5), 3), (4, 16)])
def test_chunked_window_gradients_equal_the_dense_paths(window, chunk):
    t = 11
    q, k, v = qkv(2, b=2, t=t, s=t, n=4, kh=2)
    segments = jnp.asarray(np.array([[1] * 6 + [2] * 5, [1] * 9 + [0] * 2], np.int32))
    mask = masks.make_segment_mask(segments, segments)
    weights = jnp.asarray(np.random.default_rng(0).normal(size=(2, t, 4, 8)), jnp.float32)

    def loss(implementation, window_arg, dense_mask):
        def f(q, k, v):
            out = attention.dot_product_attention(q, k, v, mask=dense_mask,
                                                  implementation=implementation,
                                                  key_chunk_size=chunk,
                                                  local_window_size=window_arg)
            return (out * weights).sum()
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)

    local = masks.combine_masks(mask, masks.make_local_mask(jnp.arange(t),
                                                            jnp.arange(t), window))
    expected = loss("xla", None, local)  # the window as a dense mask
    for got in (loss("chunked", window, mask), loss("xla", window, mask)):
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(g, e, atol=2e-5)


def test_chunked_window_with_a_bias_visits_every_block_and_matches_the_dense_formula():
    """With a bias the chunked kernel keeps one query block (so that the bias gradient has one
    block per key block) and applies the window in each block: values and bias gradients."""
    t = 9
    q, k, v = qkv(10, t=t, s=t)
    bias = jnp.asarray(np.random.default_rng(1).normal(size=(1, 4, t, t)), jnp.float32)
    assert chunked.BlockPlan.make(t, t, 4, (2, 0), band=False).num_q_blocks == 1
    expected = reference_attention(q, k, v, mask=np_window(t, t, 2, 0), bias=bias)

    def grad_bias(implementation):
        def f(bias):
            return (attention.dot_product_attention(
                q, k, v, bias=bias, implementation=implementation, key_chunk_size=4,
                local_window_size=(2, 0)) ** 2).sum()
        return jax.jit(jax.grad(f))(bias)

    out = jax.jit(functools.partial(attention.dot_product_attention, implementation="chunked",
                                key_chunk_size=4, local_window_size=(2, 0)))(q, k, v, bias=bias)
    np.testing.assert_allclose(out, expected, atol=2e-5)
    np.testing.assert_allclose(grad_bias("chunked"), grad_bias("xla"), atol=2e-5)


def test_global_tokens_with_a_window_match_the_dense_formula():
    t = 12
    q, k, v = qkv(3, b=2, t=t, s=t)
    is_global = np.zeros((2, t), bool)
    is_global[0, 0] = is_global[1, [0, 7]] = True
    pattern = masks.combine_masks(
        masks.make_causal_mask(t),
        masks.make_local_mask(jnp.arange(t), jnp.arange(t), (2, 0))
        | masks.make_global_mask(jnp.asarray(is_global)))
    dense = np_causal(t) & (np_window(t, t, 2, 0) | is_global[:, None, :, None]
                            | is_global[:, None, None, :])
    np.testing.assert_array_equal(pattern, np.broadcast_to(dense, pattern.shape))
    expected = reference_attention(q, k, v, mask=dense)
    for implementation in ("xla", "chunked"):
        out = attend_window(q, k, v, pattern, implementation=implementation)
        np.testing.assert_allclose(out, expected, atol=2e-5, err_msg=implementation)


def _all_eqns(jaxpr):
    """Every equation of a jaxpr, those of nested jaxprs (scan bodies, custom VJPs) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _all_eqns(sub)


def _scan_lengths(jaxpr) -> list[int]:
    """The trip counts of every lax.scan in a jaxpr (nested ones included)."""
    return [e.params["length"] for e in _all_eqns(jaxpr) if e.primitive.name == "scan"]


def test_chunked_window_visits_only_the_key_blocks_of_its_band():
    """A causal window of 256 over 8192 positions in blocks of 512: each of the 16 query blocks
    visits 2 key blocks (its own and the previous), forward and backward, instead of 16."""
    plan = chunked.BlockPlan.make(8192, 8192, 512, (256, 0))
    assert (plan.num_q_blocks, plan.num_k_blocks, plan.visits) == (16, 16, 2)
    # Query block 0 has only its own key block: its second step repeats it, marked invalid.
    assert plan.table == ((0, 0),) + tuple((i, i + 1) for i in range(15))
    assert plan.valid == ((True, False),) + ((True, True),) * 15
    dense = chunked.BlockPlan.make(8192, 8192, 512, None)
    assert (dense.num_q_blocks, dense.visits) == (1, 16)
    # Wider bands visit more blocks; a window wider than the keys visits all, unblocked.
    assert chunked.BlockPlan.make(8192, 8192, 512, (1024, 1024)).visits == 5
    assert chunked.BlockPlan.make(1000, 1000, 512, 4096).num_q_blocks == 1
    # The traced program runs exactly those scans: forward, and the backward's recomputation.
    x = jax.ShapeDtypeStruct((1, 8192, 2, 16), jnp.float32)

    def grad(window):
        f = lambda q, k, v: attention.dot_product_attention(  # noqa: E731
            q, k, v, implementation="chunked", local_window_size=window).sum()
        return jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(x, x, x).jaxpr

    assert sorted(_scan_lengths(grad((256, 0)))) == [2, 2]
    assert sorted(_scan_lengths(grad(None))) == [16, 16]


def test_attention_logits_accumulate_in_float32_for_half_precision_inputs():
    """bfloat16 inputs: every product of attention (QK^T and the weights times V; xla, chunked,
    windowed) accumulates in float32."""
    q, k, v = qkv(4, t=8, s=8, dtype=jnp.bfloat16)
    for implementation, window in (("xla", None), ("chunked", None), ("chunked", (2, 0))):
        jaxpr = jax.make_jaxpr(functools.partial(
            attention.dot_product_attention, implementation=implementation, key_chunk_size=4,
            local_window_size=window))(q, k, v)
        dots = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"
                and all(x.aval.dtype == jnp.bfloat16 for x in e.invars[:2])]
        assert dots and all(e.params["preferred_element_type"] == jnp.float32 for e in dots)


# --------------------------------------------------------------------------- linear attention


def np_linear(q, k, v, allowed, feature_map="elu"):
    """The quadratic form of linear attention in float64: sum_s phi(q)·phi(k_s) v_s over allowed
    keys, divided by sum_s phi(q)·phi(k_s) + eps."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    phi = {"elu": lambda x: np.where(x > 0, x + 1.0, np.exp(x)),
           "relu": lambda x: np.maximum(x, 0.0)}[feature_map]
    n = q.shape[2]
    kh = k.shape[2]
    k, v = np.repeat(k, n // kh, axis=2), np.repeat(v, n // kh, axis=2)
    a = np.einsum("BTNH,BSNH->BNTS", phi(q), phi(k))
    a = np.where(np.broadcast_to(allowed, a.shape), a, 0.0)
    return np.einsum("BNTS,BSNE->BTNE", a, v) / (a.sum(-1).transpose(0, 2, 1)[..., None]
                                                 + linear_attention.EPS)


@pytest.mark.parametrize("chunk,feature_map", [(4, "elu"), (5, "relu")])  # 4 divides T, 5 not
def test_linear_attention_matches_its_quadratic_form(chunk, feature_map):
    t = 12
    q, k, v = qkv(5, b=2, t=t, s=t, n=4, kh=2, hv=6)
    kv_valid = np.ones((2, t), bool)
    kv_valid[0, 9:] = False
    run = jax.jit(functools.partial(linear_attention.linear_attention, feature_map=feature_map,
                                chunk_size=chunk), static_argnames=("causal",))
    segments = np.array([[1] * 4 + [2] * 5 + [0] * 3, [1] * 7 + [2] * 2 + [3] * 3], np.int32)
    in_prefix = np.zeros((2, t), bool)
    in_prefix[0, :2] = in_prefix[0, 4:7] = in_prefix[1, 7:9] = True
    prefix = np_causal(t) | (in_prefix[:, None, :, None] & in_prefix[:, None, None, :])
    cases = [
        (run(q, k, v), np.ones((1, 1, t, t), bool)),
        (run(q, k, v, kv_valid=jnp.asarray(kv_valid)), kv_valid[:, None, None, :]),
        (run(q, k, v, causal=True), np_causal(t)),
        (run(q, k, v, causal=True, kv_valid=jnp.asarray(kv_valid)),
         np_causal(t) & kv_valid[:, None, None, :]),
        (run(q, k, v, segment_ids=jnp.asarray(segments)), np_segment(segments, segments)),
        (run(q, k, v, causal=True, segment_ids=jnp.asarray(segments)),
         np_causal(t) & np_segment(segments, segments)),
        (run(q, k, v, causal=True, segment_ids=jnp.asarray(segments),
             in_prefix=jnp.asarray(in_prefix)), prefix & np_segment(segments, segments)),
    ]
    for i, (out, allowed) in enumerate(cases):
        np.testing.assert_allclose(out, np_linear(q, k, v, allowed, feature_map), atol=2e-5,
                                   rtol=1e-4, err_msg=f"case {i}")


def test_linear_attention_cross_shapes_and_gradients():
    """T != S (non-causal) works; gradients equal those of the quadratic form in JAX."""
    q, _, _ = qkv(6, b=2, t=5, s=9)
    _, k, v = qkv(7, b=2, t=5, s=9)
    allowed = np.ones((1, 1, 5, 9), bool)
    np.testing.assert_allclose(linear_attention.linear_attention(q, k, v),
                               np_linear(q, k, v, allowed), atol=2e-5)
    t = 10
    q, k, v = qkv(8, t=t, s=t, n=4, kh=2)

    def quadratic(q, k, v):
        phi = linear_attention.FEATURE_MAPS["elu"]
        kk = jnp.repeat(k, 2, axis=2)
        vv = jnp.repeat(v, 2, axis=2)
        a = jnp.einsum("BTNH,BSNH->BNTS", phi(q), phi(kk)) * jnp.tril(jnp.ones((t, t)))
        num = jnp.einsum("BNTS,BSNE->BTNE", a, vv)
        return num / (a.sum(-1).transpose(0, 2, 1)[..., None] + linear_attention.EPS)

    def loss(f):
        return jax.jit(jax.grad(lambda *x: (f(*x) ** 2).sum(), argnums=(0, 1, 2)))(q, k, v)

    chunked = functools.partial(linear_attention.linear_attention, causal=True, chunk_size=3)
    for g, e in zip(loss(chunked), loss(quadratic), strict=True):
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-4)


def test_linear_attention_decode_step_equals_the_parallel_form():
    """A prompt in one call (padding after it left out, the prefix bidirectional), then one
    token at a time from the recurrent state: the outputs of the parallel causal form."""
    t = 9
    prompt = 4
    q, k, v = qkv(9, b=2, t=t, s=t, n=4, kh=2)
    in_prefix = np.zeros((2, t), bool)
    in_prefix[:, :3] = True
    expected = linear_attention.linear_attention(q, k, v, causal=True,
                                                 in_prefix=jnp.asarray(in_prefix))
    state = linear_attention.init_state(2, 2, 8, 8)
    pad = 3  # the prompt call carries 3 padding positions after the prompt
    padded = [jnp.pad(x[:, :prompt], ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v)]
    valid = jnp.arange(prompt + pad)[None, :] < prompt
    out, state = jax.jit(linear_attention.decode_step)(
        *padded, state, valid=jnp.broadcast_to(valid, (2, prompt + pad)),
        in_prefix=jnp.asarray(np.pad(in_prefix[:, :prompt], ((0, 0), (0, pad)))))
    outs = [out[:, :prompt]]
    step = jax.jit(linear_attention.decode_step)
    for i in range(prompt, t):
        out, state = step(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], state)
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), expected, atol=2e-5)


# --------------------------------------------------------------------------- a tiny decoder LM


LM = TransformerConfig(architecture="decoder", vocab_size=17, num_encoder_layers=0,
                       num_decoder_layers=2, d_model=16, d_ff=32, num_heads=4, num_kv_heads=2,
                       dropout_rate=0.0, positional="rope", norm="rms_norm", norm_position="pre",
                       max_len=24, attention_implementation="chunked")
PATTERNS = {
    "local/global": dict(attention_window=3, attention_pattern="local,global"),
    "linear": dict(attention_kind="linear", scan_layers=True),
    "local": dict(attention_window=2, attention_pattern="local", scan_layers=True),
    "global tokens": dict(attention_window=2, attention_pattern="local,global",
                          attention_global_tokens=3),
}


@pytest.mark.parametrize("fields,message", [
    (dict(attention_pattern="local,glob"), "each comma-separated entry must be global or local"),
    (dict(attention_pattern="local"), "has local layers: set model.attention_window"),
    (dict(attention_window=8), "has no effect with attention_pattern='global'"),
    (dict(attention_window=0, attention_pattern="local"), "attention_window=0 must be >= 1"),
    (dict(attention_kind="linear", attention_window=8, attention_pattern="local"),
     "attention_kind='linear' attends to every position"),
    (dict(attention_window=8, attention_pattern="local,global", scan_layers=True),
     "cannot stack"),
    (dict(attention_kind="performer"), "attention_kind='performer' is not one of"),
    (dict(linear_feature_map="exp"), "linear_feature_map='exp' is not one of"),
])
def test_bad_attention_settings_are_one_line_naming_the_key(fields, message):
    with pytest.raises(ValueError, match=message) as error:
        dataclasses.replace(LM, **fields)
    assert "\n" not in str(error.value)


def test_layer_windows_follow_the_pattern_over_the_layers():
    cfg = dataclasses.replace(LM, num_decoder_layers=5, attention_window=4,
                              attention_pattern="local,local,global")
    assert [cfg.layer_window(i) for i in range(5)] == [4, 4, None, 4, 4]
    assert LM.layer_window(0) is None


def _train(cfg, steps=30):
    """Next-token loss before and after `steps` Adam updates on one repeated batch of two
    counting sequences (packed: two segments in row 1)."""
    import optax

    tokens = np.array([[5 + (i % 9) for i in range(20)],
                       [6 + (i % 7) for i in range(10)] + [7 + (i % 5) for i in range(10)]],
                      np.int32)
    segments = np.array([[1] * 20, [1] * 10 + [2] * 10], np.int32)
    positions = np.array([list(range(20)), list(range(10)) * 2], np.int32)
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), None, tokens[:, :4])["params"]
    opt = optax.adam(1e-2)

    def loss_fn(params):
        logits = model.apply({"params": params}, None, tokens, targets_positions=positions,
                             targets_segmentation=segments)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = opt.init(params)
    first = None
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        first = loss if first is None else first
    return model, params, float(first), float(loss)


@pytest.fixture(scope="module", params=[
    "local/global", "linear", "global tokens", pytest.param("local", marks=pytest.mark.slow)])
def trained(request):
    with jax.numpy_dtype_promotion("standard"):
        cfg = dataclasses.replace(LM, **PATTERNS[request.param])
        return (request.param,) + _train(cfg)


def test_pattern_lm_trains(trained):
    name, _, _, first, last = trained
    assert last < 0.6 * first, (name, first, last)


def _recomputing_decode_fn(model, params):
    """A `decode_fn` without a cache: its state is the decoder inputs so far [R, L], and each
    step runs the training path (teacher forcing) over all of them."""

    def decode_fn(tokens, state):
        inputs = jax.lax.dynamic_update_slice(state["inputs"], tokens, (0, state["i"]))
        targets = jnp.pad(inputs[:, 1:], ((0, 0), (0, 1)))  # shift_right(targets) == inputs
        logits = model.apply({"params": params}, None, targets,
                             targets_segmentation=jnp.ones_like(targets))
        logits = jax.lax.dynamic_slice_in_dim(logits, state["i"], 1, axis=1)
        return logits, {"inputs": inputs, "i": state["i"] + 1}

    return decode_fn


def test_pattern_lm_decodes_as_full_recomputation(trained):
    """Greedy and beam search over the bounded cache (ring buffers of w positions for local
    layers, a recurrent state for linear ones) choose the tokens that recomputing the whole
    prefix at every step chooses."""
    name, model, params, _, _ = trained
    cfg = model.config
    steps = 12
    beam = 3
    with jax.numpy_dtype_promotion("standard"):
        cache = init_cache(cfg, 2, steps + 1)
        first = cache["layers" if cfg.scan_layers else "layers_0"]["self_attention"]
        if cfg.attention_kind == "linear":
            assert set(first) == {"state", "normaliser"}
        else:
            assert first["key"].shape[-2] == cfg.attention_window  # not steps + 1

        def cached(tokens, cache):
            return model.apply({"params": params}, None, None, tokens, cache=cache,
                               method="decode")

        def recomputing(rows):
            return {"inputs": jnp.zeros((rows, steps + 1), jnp.int32),
                    "i": jnp.zeros((), jnp.int32)}

        recompute = _recomputing_decode_fn(model, params)
        bos = jnp.full((2,), BOS_ID)
        kwargs = dict(bos=bos, max_lengths=jnp.full((2,), steps), max_length=steps, eos_id=1)
        greedy = functools.partial(decoding.greedy_search, **kwargs)
        np.testing.assert_array_equal(jax.jit(functools.partial(greedy, cached))(cache),
                                      jax.jit(functools.partial(greedy, recompute))(recomputing(2)),
                                      err_msg=name)
        search = functools.partial(decoding.beam_search, beam_size=beam, alpha=0.6, **kwargs)
        by_cache = jax.jit(functools.partial(
            search, cached, cache_batch_axis=1 if cfg.scan_layers else 0))(
            init_cache(cfg, 2 * beam, steps + 1))
        by_recompute = jax.jit(functools.partial(search, recompute))(recomputing(2 * beam))
        np.testing.assert_array_equal(by_cache[0], by_recompute[0], err_msg=name)
        np.testing.assert_allclose(by_cache[1], by_recompute[1], atol=1e-4, err_msg=name)


def test_pattern_lm_prefill_with_padding_and_a_prefix_equals_the_training_pass(trained):
    """A prefix-LM prompt prefilled in one call with padding after it (as the generator does;
    longer than the ring buffer), then tokens one at a time from the prompt's own length: the
    logits of the teacher-forced training pass with the same prefix."""
    name, model, params, _, _ = trained
    inputs = np.array([[BOS_ID, 5, 6, 7, 8, 9, 10, 11], [BOS_ID, 9, 8, 7, 6, 5, 6, 7]], np.int32)
    targets_prefix = np.array([[1, 1, 1, 1, 0, 0, 0, 0]] * 2, np.int32)  # inputs 0..4: prompt
    with jax.numpy_dtype_promotion("standard"):
        expected = model.apply({"params": params}, None,
                               np.pad(inputs[:, 1:], ((0, 0), (0, 1)), constant_values=5),
                               targets_prefix=targets_prefix)
        decode = jax.jit(functools.partial(model.apply, method="decode"))
        prompt = 5
        padded = np.pad(inputs[:, :prompt], ((0, 0), (0, 3)))  # 3 pads after the prompt
        in_prefix = np.arange(prompt + 3)[None].repeat(2, 0) < prompt
        logits, cache = decode({"params": params}, None, None, padded,
                               cache=init_cache(model.config, 2, 8), targets_prefix=in_prefix)
        got = [logits[:, :prompt]]
        cache = {**cache, "index": jnp.asarray(prompt, jnp.int32)}
        for i in range(prompt, 8):
            logits, cache = decode({"params": params}, None, None, inputs[:, i:i + 1],
                                   cache=cache)
            got.append(logits)
    np.testing.assert_allclose(jnp.concatenate(got, axis=1), expected, atol=1e-4, rtol=1e-4,
                               err_msg=name)
