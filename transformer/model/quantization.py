"""Quantized training matmuls (`model.quantization`, `model.quantized_matmuls`) with Qwix.

`quantize(model)` returns the Linen model whose weight matmuls of the chosen classes run
quantized: Qwix's quantized training (`qwix.QtProvider`) intercepts `jnp.einsum`,
`jax.lax.dot_general` and `jax.lax.ragged_dot` while the model runs and replaces each matmul of
an activation with a weight of those classes by one on quantized operands:

- int8: both operands symmetric int8, a scale per channel (absmax over the contracted axes
  / 127.5, computed on each call: dynamic, no calibration state), the product accumulated in
  int32 and rescaled;
- int8_full: int8 as above, and the backward pass's two matmuls in int8 too (Qwix's
  ``bwd_qtype``, as MaxText's Qwix "int8" rule sets it): the incoming gradient, times the
  other operand's forward scale, is quantized to int8 (absmax over the axes the gradient
  matmul contracts / 127.5) and multiplied in int32 by that operand's int8 values from the
  forward pass, for the activations' gradient and the weights' gradient alike;
- fp8: both operands float8_e4m3fn scaled the same way (absmax / 448), the gradients
  float8_e5m2 (the usual fp8 training pair, as Transformer Engine and torchtitan use).

The parameters stay float32 (the master weights; nothing is added to the params). The backward
pass is Qwix's quantized training: straight through the rounding. With int8 the gradients'
matmuls run in the compute dtype on the operands as they were before quantization; with
int8_full and fp8 the incoming gradient is quantized (int8, float8_e5m2) and multiplied by the
other operand as the forward pass quantized it.

Classes (`QUANTIZABLE`): `attention` (the query, key, value and output projections of self- and
cross-attention; never the scores QK^T or AV, which multiply two activations), `feed_forward`
(`ffn`: ff_in, ff_gate, ff_out) and `experts` (the routed experts of `moe`; not the router).
The embeddings and the output logits are never quantized: they are not in any class.

Qwix rather than AQT or hand-written code: it is the library MaxText quantizes with (AQT before
it); it quantizes an unchanged Linen model by interception (no layer of this package imports
it, so parameter paths and checkpoints are those of the float model); and its quantized
training defines the scales, the fp8 formats and the backward pass in one maintained place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QUANTIZATIONS = ("none", "int8", "int8_full", "fp8")
QUANTIZABLE = ("attention", "feed_forward", "experts")
DEFAULT_MATMULS = "attention,feed_forward,experts"
# Each class: the modules whose matmuls it holds (the last part of their path) and the names of
# the weights those matmuls multiply (in the module or one of its children).
_CLASSES = {
    "attention": (("self_attention", "cross_attention"), ("query", "key", "value", "out")),
    "feed_forward": (("ffn",), ("ff_in", "ff_gate", "ff_out")),
    "experts": (("moe",), ("ff_in", "ff_gate", "ff_out")),
}
# The forward (weights and activations) and backward (gradients) formats of each choice.
_QTYPES = {"int8": (jnp.int8, None), "int8_full": (jnp.int8, jnp.int8),
           "fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2)}
# The model methods that run matmuls: training's and decoding's entry points.
METHODS = ("__call__", "output_head", "classify", "encode", "decode", "decode_head")


def matmul_classes(value: str) -> tuple[str, ...]:
    """`model.quantized_matmuls` ("attention,feed_forward") as a tuple of known classes."""
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    for name in names:
        if name not in QUANTIZABLE:
            raise ValueError(f"model.quantized_matmuls names {name!r}, which is not a matmul "
                             f"class; use a comma-separated list of {', '.join(QUANTIZABLE)}")
    if not names:
        raise ValueError(f"model.quantized_matmuls is empty; name one or more of "
                         f"{', '.join(QUANTIZABLE)} (or set model.quantization='none')")
    return names


def check(quantization: str, quantized_matmuls: str, platform: str | None = None) -> None:
    """One line for an unknown `model.quantization`, a matmul class that does not exist, or
    fp8 where `platform` ("cpu", "gpu", "tpu"; None: not checked) has no fp8 matmul."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"model.quantization={quantization!r} is not one of "
                         f"{', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return
    matmul_classes(quantized_matmuls)
    if quantization == "fp8" and platform is not None and platform not in FP8_PLATFORMS:
        raise ValueError(f"model.quantization='fp8' needs fp8 matmuls (an H100/H200 GPU); this "
                         f"run's devices are {platform}: use 'int8' or 'none'")


# XLA's CPU backend emulates float8 dots by upcasting (correct, slower than float32, nothing
# to gain); TPUs before v7 likewise. Only GPUs with fp8 tensor cores are accepted.
FP8_PLATFORMS = ("gpu", "cuda")


def quantize(model, quantization: str, quantized_matmuls: str = DEFAULT_MATMULS,
             platform: str | None = None):
    """`model` (a Linen module; unchanged when `quantization` is "none") with the matmuls of
    `quantized_matmuls` quantized for training as `quantization` says, for devices of
    `platform` (checked: fp8 needs a GPU)."""
    check(quantization, quantized_matmuls, platform)
    if quantization == "none":
        return model
    import qwix  # only quantized runs need it

    forward, backward = _QTYPES[quantization]
    classes = matmul_classes(quantized_matmuls)
    modules = sorted({m for c in classes for m in _CLASSES[c][0]})
    rule = qwix.QtRule(module_path=f"(.*/)?({'|'.join(modules)})", weight_qtype=forward,
                       act_qtype=forward, bwd_qtype=backward)
    provider = _weight_matmuls(qwix.QtProvider)([rule])
    provider.classes = classes
    return qwix.quantize_model(model, provider, methods=[m for m in METHODS
                                                        if hasattr(model, m)])


def _weight_matmuls(base):
    """`base` (a Qwix provider class) that quantizes a matching module's matmul only where
    one operand is one of its class's weights; the rest (attention scores, the router) pass
    through unquantized."""
    from qwix._src.utils import flax_util

    class WeightMatmuls(base):
        classes: tuple[str, ...] = ()

        def _weight_shapes(self) -> set[tuple[int, ...]]:
            module = flax_util.get_current_module()
            name = module.path[-1] if module.path else ""
            shapes = set()
            for cls in self.classes:
                modules, weights = _CLASSES[cls]
                if name in modules:
                    params = module.scope.variables().get("params", {})
                    shapes |= {tuple(leaf.shape) for path, leaf in _leaves(params)
                               if any(part in weights for part in path)}
            return shapes

        def _has_weight(self, *operands) -> bool:
            shapes = self._weight_shapes()
            return any(tuple(jnp.shape(x)) in shapes for x in operands)

        def einsum(self, spec, *operands, **kwargs):
            if len(operands) == 2 and self._has_weight(*operands):
                return super().einsum(spec, *operands, **kwargs)
            return jnp.einsum(spec, *operands, **kwargs)

        def dot_general(self, lhs, rhs, dimension_numbers, *args, **kwargs):
            if self._has_weight(lhs, rhs):
                return super().dot_general(lhs, rhs, dimension_numbers, *args, **kwargs)
            return jax.lax.dot_general(lhs, rhs, dimension_numbers, *args, **kwargs)

        def ragged_dot(self, lhs, rhs, group_sizes, *args, **kwargs):
            if self._has_weight(lhs, rhs):
                return super().ragged_dot(lhs, rhs, group_sizes, *args, **kwargs)
            return jax.lax.ragged_dot(lhs, rhs, group_sizes, *args, **kwargs)

    return WeightMatmuls


def _leaves(params):
    """(path names, array) of a nested params dict, boxes removed."""
    flat = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: hasattr(x, "unbox"))[0]
    for path, leaf in flat:
        leaf = leaf.unbox() if hasattr(leaf, "unbox") else leaf
        yield tuple(str(getattr(k, "key", k)) for k in path), leaf

