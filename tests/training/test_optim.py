"""Tests of transformer.training.optim: schedules, optimizers and the cross-entropy, against
numpy."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from transformer.training import optim


def opt_config(**overrides) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict(
        dict(
            name="adam",
            schedule="paper_rsqrt",
            learning_rate=1e-3,
            warmup_steps=4000,
            b1=0.9,
            b2=0.98,
            eps=1e-9,
            weight_decay=0.0,
            clip_norm=0.0,
        )
    )
    cfg.update(overrides)
    return cfg


# ---- schedules ---------------------------------------------------------------------------------


def paper_lr(step, d_model, warmup=4000):
    return d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


@pytest.mark.parametrize("d_model", [512, 1024])
def test_paper_schedule_matches_formula_at_one_based_step(d_model):
    schedule = optim.make_schedule(opt_config(), d_model=d_model, total_steps=100_000)
    for count in (0, 1, 3998, 3999, 4000, 99999):
        np.testing.assert_allclose(
            float(schedule(count)), paper_lr(count + 1, d_model), rtol=1e-5, err_msg=str(count)
        )
    # The first update uses the formula at step 1, never at 0 (which would be 0).
    np.testing.assert_allclose(float(schedule(0)), d_model**-0.5 * 4000**-1.5, rtol=1e-5)


def test_paper_schedule_peak_at_update_4000():
    for d_model, peak in ((512, 6.99e-4), (1024, 4.94e-4)):
        schedule = optim.rsqrt_schedule(d_model, 4000)
        counts = jnp.arange(8000)
        lrs = np.asarray(jax.jit(jax.vmap(schedule))(counts))
        assert int(np.argmax(lrs)) == 3999  # the 4000th update
        np.testing.assert_allclose(lrs[3999], peak, rtol=1e-3)


def test_warmup_rsqrt_schedule_by_hand():
    schedule = optim.make_schedule(
        opt_config(schedule="rsqrt", learning_rate=2e-3, warmup_steps=100),
        d_model=512,
        total_steps=1000,
    )
    expected = {0: 2e-3 / 100, 49: 1e-3, 99: 2e-3, 399: 1e-3, 899: 2e-3 / 3}
    for count, lr in expected.items():
        np.testing.assert_allclose(float(schedule(count)), lr, rtol=1e-5, err_msg=str(count))


def test_warmup_cosine_schedule_by_hand():
    schedule = optim.warmup_cosine_schedule(1.0, 10, 110, end_fraction=0.1)
    expected = {
        0: 0.1,
        4: 0.5,
        9: 1.0,  # update 10: the peak
        59: 0.1 + 0.9 * 0.5,  # halfway through the decay
        34: 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi / 4)),
        109: 0.1,  # update 110 = total_steps
        500: 0.1,
    }
    for count, lr in expected.items():
        np.testing.assert_allclose(float(schedule(count)), lr, rtol=1e-5, err_msg=str(count))


def test_warmup_linear_schedule_by_hand():
    cfg = opt_config(schedule="linear", learning_rate=1.0, warmup_steps=10, end_fraction=0.1)
    schedule = optim.make_schedule(cfg, d_model=512, total_steps=110)
    expected = {
        0: 0.1,
        9: 1.0,  # update 10: the peak
        59: 0.1 + 0.9 * 0.5,  # halfway through the decay
        84: 0.1 + 0.9 * 0.25,
        109: 0.1,  # update 110 = total_steps
        500: 0.1,
    }
    for count, lr in expected.items():
        np.testing.assert_allclose(float(schedule(count)), lr, rtol=1e-5, err_msg=str(count))


def test_warmup_stable_decay_schedule_by_hand():
    cfg = opt_config(schedule="wsd", learning_rate=2.0, warmup_steps=10, decay_fraction=0.2)
    schedule = optim.make_schedule(cfg, d_model=512, total_steps=100)
    # warmup to update 10, 2.0 to update 80, then a line to 0 at update 100
    expected = {0: 0.2, 9: 2.0, 50: 2.0, 79: 2.0, 84: 1.5, 89: 1.0, 99: 0.0, 200: 0.0}
    for count, lr in expected.items():
        np.testing.assert_allclose(float(schedule(count)), lr, atol=1e-6, err_msg=str(count))
    with pytest.raises(ValueError, match=r"^optimizer\.decay_fraction=0\.0 must be in"):
        optim.make_schedule(opt_config(schedule="wsd", warmup_steps=1, decay_fraction=0.0),
                            d_model=512, total_steps=10)


def test_constant_schedule_with_and_without_warmup():
    cfg = opt_config(schedule="constant", learning_rate=0.5, warmup_steps=0)
    schedule = optim.make_schedule(cfg, d_model=512, total_steps=10)
    assert [float(schedule(c)) for c in (0, 5)] == [0.5, 0.5]
    cfg.warmup_steps = 4
    schedule = optim.make_schedule(cfg, d_model=512, total_steps=10)
    np.testing.assert_allclose([float(schedule(c)) for c in (0, 3, 9)], [0.125, 0.5, 0.5])


def test_bad_schedule_settings_name_the_key():
    with pytest.raises(ValueError, match=r"^optimizer\.schedule='step' is not one of"):
        optim.make_schedule(opt_config(schedule="step"), d_model=512, total_steps=10)
    with pytest.raises(ValueError, match=r"^optimizer\.warmup_steps=0 "):
        optim.make_schedule(opt_config(warmup_steps=0), d_model=512, total_steps=10)
    with pytest.raises(ValueError, match=r"^optimizer\.warmup_steps=4000 must be < "):
        optim.make_schedule(opt_config(schedule="cosine"), d_model=512, total_steps=10)


# ---- cross-entropy -----------------------------------------------------------------------------


def numpy_log_softmax(x):
    x = x.astype(np.float64)
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def numpy_smoothed_ce(logits, targets, weights, eps):
    vocab = logits.shape[-1]
    onehot = np.eye(vocab)[targets]
    q = (1 - eps) * onehot + eps / vocab  # the smoothed target distribution
    per_token = -(q * numpy_log_softmax(logits)).sum(-1)
    return (per_token * weights).sum(), weights.sum()


@pytest.fixture
def batch():
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=3.0, size=(2, 5, 11)).astype(np.float32)
    targets = rng.integers(0, 11, size=(2, 5)).astype(np.int32)
    weights = np.ones((2, 5), np.float32)
    weights[0, 3:] = 0  # padding
    weights[1, 4:] = 0
    targets[weights == 0] = 0
    return logits, targets, weights


def test_label_smoothed_loss_matches_numpy(batch):
    logits, targets, weights = batch
    sums = jax.jit(optim.cross_entropy_loss, static_argnames=("label_smoothing", "z_loss"))(
        logits, targets, weights, label_smoothing=0.1
    )
    loss, count = numpy_smoothed_ce(logits, targets, weights, 0.1)
    np.testing.assert_allclose(sums.loss_sum, loss, rtol=1e-5)
    assert float(sums.weight_sum) == count == 7
    assert float(sums.z_loss_sum) == 0.0
    # The same smoothed targets as optax.smooth_labels with optax's cross-entropy.
    q = optax.smooth_labels(jax.nn.one_hot(targets, 11), 0.1)
    optax_sum = jnp.sum(optax.softmax_cross_entropy(logits, q) * weights)
    np.testing.assert_allclose(sums.loss_sum, optax_sum, rtol=1e-5)


def test_padding_is_excluded(batch):
    logits, targets, weights = batch
    garbage = logits.copy()
    garbage[weights == 0] = 1e4  # anything at padded positions must not matter
    a = optim.cross_entropy_loss(logits, targets, weights, label_smoothing=0.1)
    b = optim.cross_entropy_loss(garbage, targets, weights, label_smoothing=0.1)
    np.testing.assert_allclose(a.loss_sum, b.loss_sum, rtol=1e-6)


def test_bf16_logits_give_float32_results(batch):
    logits, targets, weights = batch
    bf16 = jnp.asarray(logits, jnp.bfloat16)
    sums = optim.cross_entropy_loss(bf16, targets, weights, label_smoothing=0.1, z_loss=1e-4)
    assert all(x.dtype == jnp.float32 for x in sums)
    loss, _ = numpy_smoothed_ce(np.asarray(bf16.astype(jnp.float32)), targets, weights, 0.1)
    np.testing.assert_allclose(sums.loss_sum - sums.z_loss_sum, loss, rtol=1e-5)


def test_no_smoothing_is_nll(batch):
    logits, targets, weights = batch
    logp = numpy_log_softmax(logits)
    nll = -(np.take_along_axis(logp, targets[..., None], -1)[..., 0] * weights).sum()
    total, count = optim.nll_sum(logits, targets, weights)
    np.testing.assert_allclose(total, nll, rtol=1e-5)
    assert float(count) == 7
    sums = optim.cross_entropy_loss(logits, targets, weights, label_smoothing=0.0)
    np.testing.assert_allclose(sums.loss_sum, total, rtol=0)
    # weights=None counts every token.
    total_all, count_all = optim.nll_sum(logits, targets)
    np.testing.assert_allclose(
        total_all, -np.take_along_axis(logp, targets[..., None], -1).sum(), rtol=1e-5
    )
    assert float(count_all) == 10


def test_z_loss_matches_numpy(batch):
    logits, targets, weights = batch
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    z_expected = 1e-3 * (lse**2 * weights).sum()
    sums = optim.cross_entropy_loss(logits, targets, weights, label_smoothing=0.1, z_loss=1e-3)
    np.testing.assert_allclose(sums.z_loss_sum, z_expected, rtol=1e-5)
    loss, _ = numpy_smoothed_ce(logits, targets, weights, 0.1)
    np.testing.assert_allclose(sums.loss_sum, loss + z_expected, rtol=1e-5)


# ---- the projected (chunked) cross-entropy -------------------------------------------------------


@pytest.fixture
def projection():
    """hidden [3, 7, 4], an embedding [13, 4], targets with padding (id 0, weight 0)."""
    rng = np.random.default_rng(1)
    hidden = rng.normal(size=(3, 7, 4)).astype(np.float32)
    embedding = rng.normal(size=(13, 4)).astype(np.float32)
    targets = rng.integers(1, 13, size=(3, 7)).astype(np.int32)
    targets[0, 5:] = 0
    targets[2, 2:] = 0
    return hidden, embedding, targets, (targets != 0).astype(np.float32)


def numpy_projected_ce(hidden, embedding, targets, weights, eps, z):
    """Loss sum and its gradients for hidden and embedding, written out: with p the softmax of
    logits = hidden @ embedding.T and q = (1-eps)*onehot + eps/V, d loss / d logits =
    w * (p * (1 + 2 z lse) - q)."""
    h = hidden.astype(np.float64)
    e = embedding.astype(np.float64)
    logits = h @ e.T
    logp = numpy_log_softmax(logits)
    lse = logits - logp
    lse = lse[..., 0]
    vocab = e.shape[0]
    q = (1 - eps) * np.eye(vocab)[targets] + eps / vocab
    loss = ((-(q * logp).sum(-1) + z * lse**2) * weights).sum()
    d_logits = weights[..., None] * (np.exp(logp) * (1 + 2 * z * lse[..., None]) - q)
    return loss, d_logits @ e, np.einsum("btv,btd->vd", d_logits, h)


@pytest.mark.parametrize("chunk_length", [None, 1, 3, 7, 50])
@pytest.mark.parametrize("vocab_axis", [0, 1])
def test_projected_loss_and_gradients_match_numpy(projection, chunk_length, vocab_axis):
    hidden, embedding, targets, weights = projection
    kernel = embedding if vocab_axis == 0 else embedding.T

    def loss(h, k):
        sums = optim.projected_cross_entropy_loss(
            h, k, targets, weights, vocab_axis=vocab_axis, label_smoothing=0.1, z_loss=1e-2,
            chunk_length=chunk_length)
        return sums.loss_sum, sums

    (loss_sum, sums), (d_hidden, d_kernel) = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(hidden, kernel)
    expected, expected_d_hidden, expected_d_embedding = numpy_projected_ce(
        hidden, embedding, targets, weights, 0.1, 1e-2)
    np.testing.assert_allclose(loss_sum, expected, rtol=1e-5)
    np.testing.assert_allclose(d_hidden, expected_d_hidden, rtol=1e-4, atol=1e-6)
    d_embedding = d_kernel if vocab_axis == 0 else d_kernel.T
    np.testing.assert_allclose(d_embedding, expected_d_embedding, rtol=1e-4, atol=1e-6)
    # The same figures as the unchunked loss of the whole logits.
    whole = optim.cross_entropy_loss(hidden @ embedding.T, targets, weights,
                                     label_smoothing=0.1, z_loss=1e-2)
    for name in ("loss_sum", "weight_sum", "z_loss_sum"):
        np.testing.assert_allclose(getattr(sums, name), getattr(whole, name), rtol=1e-5)
    # Without differentiation (eval) the primal pass gives the same sums.
    plain = jax.jit(loss)(hidden, kernel)[1]
    np.testing.assert_allclose(plain.loss_sum, loss_sum, rtol=1e-6)


def test_projected_loss_gradients_equal_autodiff_of_the_logits(projection):
    """Against jax.grad through the materialised logits, scaled as the train step scales
    (loss_sum / token count), and under jax.vmap."""
    hidden, embedding, targets, weights = projection

    def whole(h, e):
        return optim.cross_entropy_loss(jnp.einsum("btd,vd->btv", h, e), targets, weights,
                                        label_smoothing=0.1).loss_sum / weights.sum()

    def chunked(h, e):
        return optim.projected_cross_entropy_loss(h, e, targets, weights, label_smoothing=0.1,
                                                  chunk_length=2).loss_sum / weights.sum()

    for expected, actual in zip(jax.grad(whole, (0, 1))(hidden, embedding),
                                jax.grad(chunked, (0, 1))(hidden, embedding), strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-7)
    batched = jax.vmap(jax.grad(chunked), in_axes=(None, 0))(hidden, np.stack([embedding] * 2))
    np.testing.assert_allclose(batched[1], jax.grad(whole)(hidden, embedding), rtol=1e-5,
                               atol=1e-7)


def test_projected_loss_in_bfloat16_is_float32_and_close(projection):
    hidden, embedding, targets, weights = projection
    h = jnp.asarray(hidden, jnp.bfloat16)
    e = jnp.asarray(embedding, jnp.bfloat16)
    sums = optim.projected_cross_entropy_loss(h, e, targets, weights, label_smoothing=0.1,
                                              chunk_length=3)
    assert all(x.dtype == jnp.float32 for x in sums)
    logits = jnp.einsum("BTD,VD->BTV", h, e, preferred_element_type=jnp.float32)
    expected = optim.cross_entropy_loss(logits, targets, weights, label_smoothing=0.1)
    np.testing.assert_allclose(sums.loss_sum, expected.loss_sum, rtol=1e-5)
    grads = jax.grad(lambda h: optim.projected_cross_entropy_loss(
        h, e, targets, weights, chunk_length=3).loss_sum)(h)
    assert grads.dtype == jnp.bfloat16


def test_grad_scale_keeps_float16_gradients_that_would_underflow():
    """Hand-worked: hidden [[[1]]], embedding [[0], [-20], [-20], [-20]], target 0, so the
    other tokens' probability is p = e**-20 / (1 + 3 e**-20) = 2.06e-9, below float16's
    smallest subnormal (6e-8). Differentiated as loss_sum x 2**15 (a float16 loss scale),
    their embedding gradient is 2**15 p = 6.8e-5: kept when grad_scale names that factor,
    flushed to 0 when the unscaled gradient is rounded to float16 first."""
    hidden = jnp.ones((1, 1, 1), jnp.float16)
    embedding = jnp.asarray([[0.0], [-20.0], [-20.0], [-20.0]], jnp.float16)
    targets = np.zeros((1, 1), np.int32)
    scale = 2.0**15
    p = np.exp(-20.0) / (1 + 3 * np.exp(-20.0))

    def d_embedding(grad_scale):
        return jax.grad(lambda e: optim.projected_cross_entropy_loss(
            hidden, e, targets, grad_scale=grad_scale).loss_sum * scale)(embedding)

    kept = np.asarray(d_embedding(scale), np.float64)[1:, 0]
    np.testing.assert_allclose(kept, scale * p, rtol=2**-10)
    assert (np.asarray(d_embedding(1.0))[1:] == 0).all()


def test_grad_scale_changes_no_float32_gradient(projection):
    hidden, embedding, targets, weights = projection

    def grads(grad_scale):
        return jax.grad(lambda h, e: optim.projected_cross_entropy_loss(
            h, e, targets, weights, label_smoothing=0.1, chunk_length=3,
            grad_scale=grad_scale).loss_sum * 1024.0, (0, 1))(hidden, embedding)

    for plain, scaled in zip(grads(1.0), grads(1024.0 / weights.sum()), strict=True):
        # Equal to float32 rounding (sums over chunks cancel: absolute, at the array's scale).
        np.testing.assert_allclose(scaled, plain, rtol=1e-5, atol=1e-6 * np.abs(plain).max())


# ---- optimizers --------------------------------------------------------------------------------


def test_adam_matches_explicit_formula_with_config_betas():
    cfg = opt_config(warmup_steps=10, b1=0.8, b2=0.95, eps=1e-3)
    tx, schedule = optim.make_optimizer(cfg, d_model=64, total_steps=100)
    params = {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "b": jnp.array([0.1, 0.2])}
    grads = [
        {"w": jnp.array([[0.3, -0.1], [0.02, 0.5]]), "b": jnp.array([1.0, -0.4])},
        {"w": jnp.array([[-0.2, 0.4], [0.1, 0.05]]), "b": jnp.array([0.3, 0.6])},
    ]
    state = tx.init(params)
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(p) for k, p in params.items()}
    for step, g in enumerate(grads, start=1):
        updates, state = tx.update(g, state, params)
        lr = paper_lr(step, 64, warmup=10)
        np.testing.assert_allclose(float(schedule(step - 1)), lr, rtol=1e-6)
        for k in params:
            gk = np.asarray(g[k], np.float64)
            m[k] = 0.8 * m[k] + 0.2 * gk
            v[k] = 0.95 * v[k] + 0.05 * gk**2
            m_hat = m[k] / (1 - 0.8**step)
            v_hat = v[k] / (1 - 0.95**step)
            expected = -lr * m_hat / (np.sqrt(v_hat) + 1e-3)
            np.testing.assert_allclose(updates[k], expected, rtol=1e-5, err_msg=f"{k} {step}")
        params = optax.apply_updates(params, updates)


def test_clipping_clips_to_global_norm():
    # eps 1 makes Adam's first update depend on the gradient's scale: -lr * g / (|g| + 1).
    params = {"a": jnp.zeros((2,)), "b": jnp.zeros((2, 1))}
    grads = {"a": jnp.array([6.0, 0.0]), "b": jnp.array([[0.0], [8.0]])}  # global norm 10
    lr = float(optim.rsqrt_schedule(64, 10)(0))
    for clip_norm, scale in ((0.0, 1.0), (1.0, 0.1), (20.0, 1.0)):
        cfg = opt_config(warmup_steps=10, eps=1.0, clip_norm=clip_norm)
        tx, _ = optim.make_optimizer(cfg, d_model=64, total_steps=100)
        updates, _ = tx.update(grads, tx.init(params), params)
        for k in params:
            g = np.asarray(grads[k]) * scale
            np.testing.assert_allclose(updates[k], -lr * g / (np.abs(g) + 1.0), rtol=1e-5)


def test_adamw_decays_matrices_only():
    cfg = opt_config(
        name="adamw", schedule="constant", learning_rate=0.5, warmup_steps=0, weight_decay=0.1
    )
    tx, _ = optim.make_optimizer(cfg, d_model=64, total_steps=100)
    params = {
        "embedding": {"embedding": jnp.full((5, 4), 2.0)},
        "ffn": {"ff_in": {"kernel": jnp.full((4, 3), 2.0), "bias": jnp.full((3,), 2.0)}},
        "norm": {"scale": jnp.full((4,), 2.0), "bias": jnp.full((4,), 2.0)},
        # scan_layers: a leading L axis makes biases and scales 2-D; they stay undecayed.
        "layers": {
            "kernel": jnp.full((2, 4, 4), 2.0),
            "bias": jnp.full((2, 4), 2.0),
            "scale": jnp.full((2, 4), 2.0),
        },
    }
    zero_grads = jax.tree.map(jnp.zeros_like, params)  # Adam's part is then exactly 0
    updates, _ = tx.update(zero_grads, tx.init(params), params)
    flat = {
        jax.tree_util.keystr(p): np.asarray(u)
        for p, u in jax.tree_util.tree_leaves_with_path(updates)
    }
    decayed = {"['embedding']['embedding']", "['ffn']['ff_in']['kernel']", "['layers']['kernel']"}
    assert decayed < set(flat)
    for path, update in flat.items():
        expected = -0.5 * 0.1 * 2.0 if path in decayed else 0.0
        np.testing.assert_allclose(update, expected, rtol=1e-6, err_msg=path)


def test_unknown_optimizer_name_is_one_line_naming_the_key():
    with pytest.raises(ValueError) as err:
        optim.make_optimizer(opt_config(name="sgd"), d_model=512, total_steps=10)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("optimizer.name='sgd'")
    assert "adam" in message and "adamw" in message


# ---- moments in bfloat16, Adafactor -------------------------------------------------------------


def _grads(params, steps, seed=0):
    """`steps` gradient trees like `params`, normal draws of varied scale per leaf."""
    rng = np.random.default_rng(seed)
    return [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * rng.uniform(0.1, 3),
                                               jnp.float32), params) for _ in range(steps)]


MOMENT_PARAMS = {"w": jnp.full((6, 5), 0.5), "b": jnp.linspace(-1.0, 1.0, 5)}


def test_float32_moments_are_optax_adamw_exactly():
    cfg = opt_config(name="adamw", schedule="constant", learning_rate=1e-2, warmup_steps=0,
                     weight_decay=0.1, b2=0.95, eps=1e-8)
    tx, schedule = optim.make_optimizer(cfg, d_model=64, total_steps=100)
    reference = optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                            mask=optim.decay_mask)
    params, state, ref_params, ref_state = (MOMENT_PARAMS, tx.init(MOMENT_PARAMS),
                                            MOMENT_PARAMS, reference.init(MOMENT_PARAMS))
    # The same state tree (a checkpoint of either restores into the other).
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    for g in _grads(params, 4):
        updates, state = tx.update(g, state, params)
        ref_updates, ref_state = reference.update(g, ref_state, ref_params)
        params, ref_params = (optax.apply_updates(params, updates),
                              optax.apply_updates(ref_params, ref_updates))
    jax.tree.map(np.testing.assert_array_equal, params, ref_params)  # the same float32 ops


def test_bfloat16_moments_match_adam_with_moments_rounded_to_bfloat16():
    """Both moments are stored in bfloat16; each update runs in float32 from the stored
    moments, as numpy does here with ml_dtypes' bfloat16 rounding."""
    import ml_dtypes

    b1, b2, eps, lr = 0.9, 0.95, 1e-8, 1e-2
    cfg = opt_config(name="adam", schedule="constant", learning_rate=lr, warmup_steps=0,
                     b1=b1, b2=b2, eps=eps, moments_dtype="bfloat16")
    tx, _ = optim.make_optimizer(cfg, d_model=64, total_steps=100)
    state = tx.init(MOMENT_PARAMS)
    adam_state = state[0]
    assert {leaf.dtype for leaf in jax.tree.leaves((adam_state.mu, adam_state.nu))} == {
        jnp.dtype(jnp.bfloat16)}

    def bf16(x):
        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)

    m = {k: np.zeros(p.shape, np.float32) for k, p in MOMENT_PARAMS.items()}
    v = {k: np.zeros(p.shape, np.float32) for k, p in MOMENT_PARAMS.items()}
    f32_tx, _ = optim.make_optimizer(opt_config(**{**cfg, "moments_dtype": "float32"}),
                                     d_model=64, total_steps=100)
    f32_state = f32_tx.init(MOMENT_PARAMS)
    apart = 0.0
    for step, g in enumerate(_grads(MOMENT_PARAMS, 6), start=1):
        updates, state = tx.update(g, state, MOMENT_PARAMS)
        f32_updates, f32_state = f32_tx.update(g, f32_state, MOMENT_PARAMS)
        for k in m:
            gk = np.asarray(g[k])
            m_new = b1 * m[k] + (1 - b1) * gk
            v_new = b2 * v[k] + (1 - b2) * gk * gk
            expected = -lr * (m_new / (1 - b1**step)) / (np.sqrt(v_new / (1 - b2**step)) + eps)
            # The same float32 formula from the same stored moments: float32 rounding (a
            # few ulps, 1e-6 relative), unless XLA's and numpy's values straddle a bfloat16
            # rounding boundary, which these draws do not.
            np.testing.assert_allclose(updates[k], expected, rtol=1e-5, err_msg=f"{k} {step}")
            apart = max(apart, float(np.max(np.abs(updates[k] - f32_updates[k])
                                            / np.abs(f32_updates[k]))))
            m[k], v[k] = bf16(m_new), bf16(v_new)
    assert apart > 1e-4  # the rounding is there: float32 moments give other updates


def test_adafactor_matches_optax_reference():
    """T5's Adafactor (factored second moments, update clipping, relative step) with the
    config's decay rate and factoring threshold is optax.adafactor's, over a few steps, on a
    factored matrix, an unfactored one and a vector."""
    params = {"kernel": jnp.full((8, 12), 0.3), "small": jnp.full((3, 12), -0.2),
              "scale": jnp.linspace(0.5, 1.5, 12)}
    cfg = opt_config(name="adafactor", schedule="constant", learning_rate=1e-2,
                     warmup_steps=0, decay_rate=0.7, min_dim_size_to_factor=8)
    tx, schedule = optim.make_optimizer(cfg, d_model=64, total_steps=100)
    reference = optax.adafactor(schedule, decay_rate=0.7, min_dim_size_to_factor=8)
    state, ref_state = tx.init(params), reference.init(params)
    factored = state[0]
    # kernel [8, 12] is factored (a row and a column statistic), small [3, 12] is not.
    assert factored.v_row["kernel"].shape == (8,) and factored.v_col["kernel"].shape == (12,)
    assert factored.v["small"].shape == (3, 12)
    ref_params = params
    for g in _grads(params, 5, seed=1):
        updates, state = tx.update(g, state, params)
        ref_updates, ref_state = reference.update(g, ref_state, ref_params)
        params, ref_params = (optax.apply_updates(params, updates),
                              optax.apply_updates(ref_params, ref_updates))
    jax.tree.map(np.testing.assert_array_equal, params, ref_params)  # the same float32 ops
    jax.tree.map(np.testing.assert_array_equal, state, ref_state)


def test_adafactor_weight_decay_is_adamws_times_the_learning_rate():
    cfg = opt_config(name="adafactor", schedule="constant", learning_rate=1e-2,
                     warmup_steps=0, weight_decay=0.1)
    tx, _ = optim.make_optimizer(cfg, d_model=64, total_steps=100)
    params = {"kernel": jnp.full((4, 3), 2.0), "bias": jnp.full((3,), 2.0)}
    zero_grads = jax.tree.map(jnp.zeros_like, params)  # Adafactor's own part is then 0
    updates, _ = tx.update(zero_grads, tx.init(params), params)
    np.testing.assert_allclose(updates["kernel"], -0.1 * 1e-2 * 2.0, rtol=1e-6)
    np.testing.assert_array_equal(updates["bias"], 0.0)  # decay_mask: matrices only


def test_adafactor_statistics_keep_their_parameters_axis_names():
    """Boxed params (the trainer's): a factored statistic keeps the logical names of the axes
    it keeps, an unfactored one all of them, a [1] stub none."""
    import flax.linen as nn

    params = {"ff_in": nn.LogicallyPartitioned(jnp.zeros((16, 32)), ("embed", "mlp")),
              "norm": nn.LogicallyPartitioned(jnp.zeros((16,)), ("embed",))}
    cfg = opt_config(name="adafactor", schedule="constant", learning_rate=1e-2,
                     warmup_steps=0, min_dim_size_to_factor=16)
    tx, _ = optim.make_optimizer(cfg, d_model=64, total_steps=100)
    factored = tx.init(params)[0]

    def names(tree):
        return {k: (box.value.shape, box.names) for k, box in tree.items()}

    assert names(factored.v_row) == {"ff_in": ((16,), ("embed",)), "norm": ((1,), (None,))}
    assert names(factored.v_col) == {"ff_in": ((32,), ("mlp",)), "norm": ((1,), (None,))}
    assert names(factored.v) == {"ff_in": ((1,), (None,)), "norm": ((16,), ("embed",))}
    # Unboxed, the state is optax's.
    reference = optax.adafactor(1e-2, min_dim_size_to_factor=16).init(nn.unbox(params))
    jax.tree.map(np.testing.assert_array_equal, nn.unbox(tx.init(params))[0], reference[0])


@pytest.mark.parametrize("key,value,message", [
    ("moments_dtype", "float16", "optimizer.moments_dtype='float16' is not one of float32, "
                                 "bfloat16"),
    ("min_dim_size_to_factor", 0, "optimizer.min_dim_size_to_factor=0 must be an int >= 1"),
])
def test_bad_moment_settings_are_one_line_naming_the_key(key, value, message):
    name = "adafactor" if key == "min_dim_size_to_factor" else "adam"
    with pytest.raises(ValueError, match=f"^{message}") as err:
        optim.make_optimizer(opt_config(name=name, **{key: value}), d_model=64, total_steps=10)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="^optimizer.moments_dtype='bfloat16' is for adam"):
        optim.make_optimizer(opt_config(name="adafactor", moments_dtype="bfloat16"), d_model=64,
                             total_steps=10)
