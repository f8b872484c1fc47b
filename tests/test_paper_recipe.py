"""The paper's configs hold the paper's recipe (docs/paper-recipe.md), every hyperparameter
written out here from the paper, so that a change to `configs/common.py` that departs from it
fails: the block, the dropout, the optimizer and its schedule, the batch, the updates, the
decoding and the averaging."""

import numpy as np
import pytest

from transformer.config import resolve
from transformer.training import optim

PAPER = {  # config file: (N, d_model, d_ff, h, P_drop, updates, checkpoints averaged)
    "wmt14_ende_base.py": (6, 512, 2048, 8, 0.1, 100_000, 5),
    "wmt14_ende_big.py": (6, 1024, 4096, 16, 0.3, 300_000, 20),
    "wmt14_enfr_big.py": (6, 1024, 4096, 16, 0.1, 300_000, 20),
}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_the_model_is_the_papers(name, load_config):
    layers, d_model, d_ff, heads, p_drop, _, _ = PAPER[name]
    model = resolve(load_config(name)).model
    assert (model.architecture, model.num_encoder_layers, model.num_decoder_layers) == (
        "encoder_decoder", layers, layers)
    assert (model.d_model, model.d_ff, model.num_heads, model.num_kv_heads) == (
        d_model, d_ff, heads, heads)
    assert model.d_k == model.d_v == 64  # d_model / h
    assert (model.norm_position, model.norm, model.activation, model.use_bias) == (
        "post", "layer_norm", "relu", True)  # LayerNorm(x + Dropout(Sublayer(x)))
    assert model.positional == "sinusoidal"
    assert model.share_embeddings and model.tie_output_embedding and model.scale_embeddings
    assert (model.dropout_rate, model.attention_dropout_rate, model.relu_dropout_rate) == (
        p_drop, 0.0, 0.0)
    assert model.attention_kind == "softmax" and model.attention_pattern == "global"


@pytest.mark.parametrize("name", sorted(PAPER))
def test_training_is_the_papers(name, load_config):
    *_, updates, averaged = PAPER[name]
    cfg = resolve(load_config(name)).config
    assert cfg.label_smoothing == 0.1 and cfg.z_loss == 0.0
    opt = cfg.optimizer
    assert (opt.name, opt.b1, opt.b2, opt.eps, opt.weight_decay) == ("adam", 0.9, 0.98, 1e-9, 0.0)
    assert opt.clip_norm == 0.0  # the paper clips no gradients
    assert cfg.num_train_steps == updates
    assert (cfg.params_every_minutes, cfg.params_keep) == (10.0, averaged)
    assert (cfg.decode.beam_size, cfg.decode.alpha, cfg.decode.max_extra_length) == (4, 0.6, 50)
    assert cfg.data.source_lang == "en"  # TFDS's wmt14_translate/<x>-en yields <x> -> en


@pytest.mark.parametrize("name", sorted(PAPER))
def test_the_learning_rate_is_the_papers_formula(name, load_config):
    """lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), step 1-based, 4,000
    warmup steps (section 5.3), evaluated in numpy against the schedule optax is given."""
    cfg = resolve(load_config(name)).config
    d_model = cfg.model.d_model
    assert cfg.optimizer.warmup_steps == 4000
    schedule = optim.make_schedule(cfg.optimizer, d_model=d_model,
                                   total_steps=cfg.num_train_steps)
    steps = np.array([1, 2, 100, 3999, 4000, 4001, 10_000, 100_000, 300_000])
    expected = d_model**-0.5 * np.minimum(steps**-0.5, steps * 4000.0**-1.5)
    got = np.array([float(schedule(step - 1)) for step in steps])  # optax counts from 0
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("num_devices", [1, 2, 4, 8])
@pytest.mark.parametrize("name", sorted(PAPER))
def test_each_updates_token_cap_is_25k_on_any_device_count(name, num_devices, load_config):
    """The cap of section 5.1's "about 25,000 source and 25,000 target tokens" per update,
    whatever the devices: the token budget (25,000) and the global batch of rows stay, and
    accumulation makes up the rest. The cap, not the fill: how close a batch comes to 25,000
    tokens depends on the sentence lengths the data brings (docs/paper-recipe.md)."""
    run = resolve(load_config(name), num_devices)
    cfg = run.config
    assert cfg.data.tokens_per_batch == 25_000
    rows = cfg.data.batch_size // (cfg.grad_accum_steps * num_devices)
    assert rows * cfg.grad_accum_steps * num_devices == cfg.data.batch_size == 104
    assert rows <= cfg.data.max_rows_per_device
    assert cfg.data.batch_size * cfg.data.max_length >= 25_000

