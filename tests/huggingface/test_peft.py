"""LoRA adapters in and out in PEFT's format (transformer/huggingface/adapters.py) against
`peft` itself on a tiny random Llama (nothing downloaded): a PEFT adapter imported here gives
peft's logits; exported again it is the same tensors, which peft loads onto the exported base;
merged, a plain checkpoint with the adapted model's logits; one-line refusals; lora_dropout:
peft's LoraLayer in train mode given our dropout mask equals ours, and the setting goes out
to adapter_config.json and back."""

import json

import flax.linen as nn
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_huggingface import TOKENS, _hf_logits, _llama

from transformer.checkpoint import averaging, layout
from transformer.config import resolve
from transformer.huggingface import adapters, convert
from transformer.model import lora
from transformer.model.blocks import Weights
from transformer.model.transformer import Transformer, TransformerConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

MODULES = ["q_proj", "v_proj", "o_proj", "down_proj"]  # query, value, out, ff_out
# Ours (XLA) against torch in float32, the adapter's terms included: along a path from an
# embedding to a logit the sums hold ~1,400 terms whose rounding errors (2^-24 relative each,
# of either sign) add as a random walk: ~sqrt(1400) x 6e-8 ~ 2e-6 of logits of size ~1-3,
# ~6e-6; the 2e-5 leaves a 3x margin (test_huggingface's ATOL bounds the worst order).
ATOL = 2e-5


def _adapter(tmp_path, hf_model, name="adapter", rank=4):
    """A PEFT LoRA adapter with random A and B (init_lora_weights=False), saved; the peft
    model."""
    torch.manual_seed(1)
    config = peft.LoraConfig(r=rank, lora_alpha=8, target_modules=MODULES, lora_dropout=0.05,
                             init_lora_weights=False)  # dropout: kept on import, off in eval
    model = peft.get_peft_model(hf_model, config).eval()
    model.save_pretrained(str(tmp_path / name))
    return model


def _our_logits(workdir):
    run = resolve(layout.load_config(workdir))
    params = averaging.load_params(workdir)
    model = Transformer(run.model)
    targets = np.concatenate([TOKENS[:, 1:], np.zeros((2, 1), np.int32)], axis=1)
    logits = jax.jit(lambda p, t: model.apply({"params": p}, None, t))(params, targets)
    return run, np.asarray(logits), targets


def test_peft_adapter_in_out_and_merged_equal_peft(tmp_path):
    hf_dir = tmp_path / "llama"
    base = _llama(hf_dir)
    plain = _hf_logits(base, TOKENS)
    peft_model = _adapter(tmp_path, base)
    expected = _hf_logits(peft_model, TOKENS)
    assert np.abs(expected - plain).max() > 1e-2  # the adapter changes the logits

    workdir = str(tmp_path / "run")
    convert.import_checkpoint(str(hf_dir), workdir, overrides={"model.dtype": "float32"},
                              adapter=str(tmp_path / "adapter"))
    run, ours, targets = _our_logits(workdir)
    assert (run.model.lora_rank, run.model.lora_alpha, run.model.lora_dropout) == (4, 8.0, 0.05)
    assert run.model.lora_targets == "query,value,out,ff_out"
    # teacher forcing: the decoder reads BOS + targets[:t], TOKENS[:t+1], as transformers at t
    np.testing.assert_allclose(ours[targets != 0], expected[targets != 0], atol=ATOL, rtol=0)

    out = tmp_path / "exported"
    convert.export_workdir(workdir, str(out))
    original = load_file(str(tmp_path / "adapter" / adapters.WEIGHTS_FILE))
    exported = load_file(str(out / convert.ADAPTER_DIR / adapters.WEIGHTS_FILE))
    assert sorted(exported) == sorted(original)
    for name, value in exported.items():
        np.testing.assert_array_equal(value, original[name], err_msg=name)
    config = json.loads((out / convert.ADAPTER_DIR / adapters.CONFIG_FILE).read_text())
    assert sorted(config["target_modules"]) == sorted(MODULES)
    reloaded = peft.PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(str(out)),
        str(out / convert.ADAPTER_DIR)).eval()
    # the same base and adapter tensors, bit for bit, through the same torch code
    np.testing.assert_array_equal(_hf_logits(reloaded, TOKENS), expected)

    merged_dir = tmp_path / "merged"
    convert.export_workdir(workdir, str(merged_dir), merge_lora=True)
    assert not (merged_dir / convert.ADAPTER_DIR).exists()
    merged = transformers.LlamaForCausalLM.from_pretrained(str(merged_dir)).eval()
    # W + s A B rounded once in float32 (2^-24 relative of weights ~0.2) against peft's
    # unmerged x W + s (x A) B: far under the forward pass's own rounding (ATOL)
    np.testing.assert_allclose(_hf_logits(merged, TOKENS), expected, atol=ATOL, rtol=0)
    theirs = peft_model.merge_and_unload()
    weight = theirs.model.layers[1].self_attn.o_proj.weight.detach().numpy()
    ours_merged = load_file(str(merged_dir / convert.SINGLE_FILE))
    np.testing.assert_allclose(ours_merged["model.layers.1.self_attn.o_proj.weight"], weight,
                               atol=1e-6, rtol=0)  # weights ~0.2-1: a few float32 ulps


def test_adapter_for_another_base_and_unsupported_options_are_one_line(tmp_path):
    hf_dir = tmp_path / "llama"
    _llama(hf_dir)
    small = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))
    _adapter(tmp_path, small, "other")
    with pytest.raises(ValueError, match=r"lora_A.weight has shape \(4, 32\); the base "
                                         r"checkpoint implies \(4, 64\)"):
        convert.import_checkpoint(str(hf_dir), str(tmp_path / "a"),
                                  adapter=str(tmp_path / "other"))
    config_file = tmp_path / "other" / adapters.CONFIG_FILE
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(config | {"use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        convert.import_checkpoint(str(hf_dir), str(tmp_path / "b"),
                                  adapter=str(tmp_path / "other"))
    config_file.write_text(json.dumps(config))
    tensors = load_file(str(tmp_path / "other" / adapters.WEIGHTS_FILE))
    partial = {k: v for k, v in tensors.items() if ".layers.1." not in k}
    save_file(partial, str(tmp_path / "other" / adapters.WEIGHTS_FILE))
    with pytest.raises(ValueError, match="lacks base_model.model.model.layers.1"):
        convert.import_checkpoint(str(hf_dir), str(tmp_path / "c"),
                                  adapter=str(tmp_path / "other"))


class _Projection(nn.Module):
    """A targeted feed-forward kernel's layer as ours computes it: x W + b + its branch."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, deterministic):
        kernel, bias, branch = Weights((6, 5), ("embed", "mlp"), lora_branch=True,
                                       name="ff_in")(deterministic)
        y = x @ kernel + bias
        return (y if branch is None else y + branch(x)), branch


class _Masked(torch.nn.Module):
    """Inverted dropout with a given keep mask in train mode, the identity in eval mode (in
    place of peft's torch.nn.Dropout)."""

    def __init__(self, keep, rate):
        super().__init__()
        self.keep, self.rate = torch.from_numpy(keep.copy()), rate

    def forward(self, x):
        if not self.training:
            return x
        return torch.where(self.keep, x / (1 - self.rate), torch.zeros_like(x))


def _tiny_peft(rate):
    """peft's LoRA (r 2, alpha 3, random A and B) on a torch Linear(6, 5) named `proj`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(6, 5))
    config = peft.LoraConfig(r=2, lora_alpha=3, target_modules=["proj"], lora_dropout=rate,
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


def test_peft_lora_layer_in_train_mode_equals_ours_with_our_dropout_mask():
    """PEFT's train-mode LoraLayer, base(x) + lora_B(lora_A(dropout(x))) * scaling, with its
    torch.nn.Dropout given the mask our branch draws (torch's own mask comes from torch's
    generator, which no JAX key reproduces), equals our layer in training; in eval mode (no
    dropout) it equals our merged kernel."""
    rate = 0.3
    peft_model = _tiny_peft(rate).train()
    layer = peft_model.base_model.model.proj
    tensors = {k: v.detach().numpy() for k, v in layer.state_dict().items()}
    params = {"kernel": tensors["base_layer.weight"].T, "bias": tensors["base_layer.bias"],
              lora.A: tensors["lora_A.default.weight"].T,
              lora.B: tensors["lora_B.default.weight"].T}
    cfg = TransformerConfig(vocab_size=8, d_model=6, d_ff=5, num_heads=1, lora_rank=2,
                            lora_alpha=3.0, lora_dropout=rate, lora_targets="ff_in")
    x = np.random.default_rng(0).normal(size=(4, 7, 6)).astype(np.float32)
    ours, branch = _Projection(cfg).apply({"params": {"ff_in": params}}, x, False,
                                          rngs={"dropout": jax.random.key(3)})
    keep = np.asarray(jax.random.bernoulli(branch.rng, 1 - rate, x.shape))
    assert 0 < keep.mean() < 1
    layer.lora_dropout["default"] = _Masked(keep, rate)
    with torch.no_grad():
        theirs = peft_model(torch.from_numpy(x)).numpy()
    # float32 sums of 6 (base) and 6 + 2 (adapter) products of terms ~1: a few ulps of ~2
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=1e-5)
    evaluated, _ = _Projection(cfg).apply({"params": {"ff_in": params}}, x, True)
    with torch.no_grad():
        theirs = peft_model.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(evaluated), theirs, rtol=0, atol=1e-5)


def test_lora_dropout_goes_out_to_adapter_config_and_back(tmp_path):
    """A PEFT adapter's lora_dropout is read into the `finetune` section; ours is written to
    adapter_config.json, where peft reads it."""
    _tiny_peft(0.05).save_pretrained(str(tmp_path / "theirs"))
    assert adapters.read_config(str(tmp_path / "theirs"))["lora_dropout"] == 0.05
    cfg = TransformerConfig(vocab_size=8, d_model=6, d_ff=5, num_heads=1, lora_rank=2,
                            lora_alpha=3.0, lora_dropout=0.15, lora_targets="ff_in")
    adapters.write(str(tmp_path / "ours"), {}, [], cfg, str(tmp_path))
    assert adapters.read_config(str(tmp_path / "ours"))["lora_dropout"] == 0.15
    assert peft.LoraConfig.from_pretrained(str(tmp_path / "ours")).lora_dropout == 0.15
