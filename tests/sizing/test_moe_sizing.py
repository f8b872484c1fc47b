"""Experts in the sizing tools: parameters (total and active) and FLOPs of a routed model
against hand counts, and the summary's active row."""

from transformer.config import resolve
from transformer.model.config import TransformerConfig
from transformer.sizing import flops, summary

D = 16
F = 24
E = 4
V = 32
L = 2
T = 10


def _config(**fields):
    return TransformerConfig(**{**dict(
        architecture="decoder", vocab_size=V, num_decoder_layers=L, d_model=D, d_ff=F,
        num_heads=2, max_len=T, activation="swiglu", use_bias=False, norm="rms_norm",
        norm_position="pre", positional="rope", num_experts=E, experts_per_token=2), **fields})


def test_params_total_and_active():
    dense = flops.param_counts(_config(num_experts=0))["total"]
    expert = 3 * D * F  # ff_in, ff_gate, ff_out
    routed = _config()
    total = dense + L * ((E - 1) * expert + D * E)  # E experts in place of one ffn, routers
    assert flops.param_counts(routed)["total"] == total
    assert flops.active_params(routed) == total - L * (E - 2) * expert
    alternate = _config(moe_layer_interval=2, moe_shared_expert=True)  # layer 1 routed
    assert flops.active_params(alternate) == dense + 2 * expert + D * E


def test_ffn_flops_count_the_active_experts():
    dense = 2.0 * D * F * 3
    routed = _config(moe_shared_expert=True)
    got = flops.forward_flops(routed, source_length=T, target_length=T)["ffn"]
    assert got == L * T * (2.0 * D * E + 2 * dense + dense)
    capacity = _config(moe_capacity_factor=1.5)
    got = flops.forward_flops(capacity, source_length=T, target_length=T)["ffn"]
    assert got == L * T * (2.0 * D * E + 1.5 * 2 * dense)
    dense_model = flops.forward_flops(_config(num_experts=0), source_length=T, target_length=T)
    assert dense_model["ffn"] == L * T * dense


def test_summary_has_the_active_row(load_config):
    cfg = load_config("tiny.py", **{"model.num_experts": 4, "model.experts_per_token": 1})
    text = summary.summarize(resolve(cfg))
    active = flops.active_params(TransformerConfig.from_dict(cfg.model))
    assert "active (1 of 4 experts)" in text and f"{active:,}" in text
