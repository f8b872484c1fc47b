"""Hugging Face export of a pipelined run (issue 59): a Llama-family lm_* run on data 4 x
stage 2 with 2 circular repeats, its parameters saved sharded over the stages, exports to a
`transformers` Llama whose logits are the pipelined model's and the plain model's."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import params_run

from transformer.config import resolve
from transformer.huggingface import convert
from transformer.model.transformer import Transformer
from transformer.parallel import sharding

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# float32 against float32 (XLA against torch's BLAS, and the pipelined program against the
# plain one): a logit is reached through ~1,300 sums' terms (per layer 64 for each projection,
# 10 attended positions, 64 and 96 in the MLP; 4 layers; 64 in the head), each summed in an
# order another library or thread count may change: worst case n u = 1,300 x 6e-8 ~ 8e-5 of
# the activations' size, ~1 after each RMS norm (the logits here are O(1)). 2e-4 leaves 2.5x.
ATOL = 2e-4
MESH = {"data": 4, "fsdp": 1, "tensor": 1, "stage": 2}


def test_a_pipelined_run_exports_to_llama_with_its_logits(tmp_path, load_config):
    cfg = load_config("lm_default.py", **{
        "data.vocab_size": 128, "model.num_decoder_layers": 4, "model.d_model": 64,
        "model.d_ff": 96, "model.num_heads": 4, "model.num_kv_heads": 2, "model.max_len": 64,
        "model.dropout_rate": 0.0, "model.scan_layers": True, "mesh.pipeline_repeats": 2,
        "mesh.pipeline_microbatches": 2, **{f"mesh.{k}": v for k, v in MESH.items()}})
    run = resolve(cfg, 8)
    model = Transformer(run.model)
    targets = jnp.asarray(np.random.default_rng(0).integers(1, 128, (8, 10)), jnp.int32)
    boxed = model.init(jax.random.key(0), None, targets[:1])["params"]
    mesh = sharding.make_mesh(run.config.mesh)
    shardings = sharding.tree_shardings(boxed, mesh)
    assert shardings["decoder"]["layers"]["ffn"]["ff_in"]["kernel"].spec[0] == "stage"
    params = jax.device_put(nn.unbox(boxed), shardings)
    with nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES), \
            jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the pipelined forward
        compiled = jax.jit(lambda p: model.apply({"params": p}, None, targets)).lower(
            params).compile()
    assert "collective-permute" in compiled.as_text()  # stage to stage: it ran pipelined
    staged = compiled(params)
    workdir = params_run(tmp_path / "run", cfg, params)
    convert.export_workdir(str(workdir), str(tmp_path / "hf"))

    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    inputs = np.concatenate([np.full((8, 1), run.model.bos_id), targets[:, :-1]], axis=1)
    with torch.no_grad():
        theirs = hf_model(input_ids=torch.tensor(inputs, dtype=torch.long)).logits.numpy()
    plain = jax.jit(lambda p: model.apply({"params": p}, None, targets))(jax.device_get(params))
    assert float(np.abs(theirs).max()) < 10  # the O(1) logits the tolerance assumes
    np.testing.assert_allclose(np.asarray(plain), theirs, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(staged), theirs, atol=ATOL, rtol=0)
