"""Int8 decoding (`quantize="int8"`): the matmul kernels stored as int8, dequantized at use.

`quantize_params(params)` replaces each kernel of attention (`query`, `key`, `value`, `out`),
of the feed-forward (`ff_in`, `ff_gate`, `ff_out`) and of the routed experts (`moe/ff_in`,
`moe/ff_gate`, `moe/ff_out`) with a `qwix.QArray`: int8 values and a float32 scale per output
channel (per expert and layer too), symmetric absmax (scale = max|w| / 127.5 over the kernel's
input axes), so |w - dequantized w| <= scale / 2 and the kernels take about a quarter of their
float32 bytes. Embeddings, the output projection, norms, biases, the router and the relative
position tables stay float (as MaxText and Hugging Face's int8 decoding leave them).
`dequantize(params)` gives the float tree back inside the jitted searches, at every call of
the model. The decoding cache's int8 half is `init_cache(..., int8=True)` (`ops/kv_cache.py`).

Qwix (Google's JAX quantization library) does the arithmetic: `qwix.quantize` and
`qwix.dequantize` on the parameter tree. Its post-training provider, which intercepts a
module's `einsum`/`dot_general` on its params, is not used: our sublayers cast their kernels and
hand them to pure functions (`ops/layers.py`, `ops/moe.py`) before any product, and the
decoding cache is not a matmul operand it quantizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QUANTIZE_CHOICES = ("none", "int8")
ATTENTION = ("self_attention", "cross_attention")
# (input axes, output axes) of each quantized kernel, counted from its end: a scanned stack's
# leading L axis and the experts' E are output axes too (one scale per layer and expert).
KERNEL_AXES = {"query": (1, 2), "key": (1, 2), "value": (1, 2), "out": (2, 1),
               "ff_in": (1, 1), "ff_gate": (1, 1), "ff_out": (1, 1)}


def check_quantize(quantize: str | None) -> str:
    """`quantize` ("none" for None) if it is a known name; one line otherwise."""
    quantize = "none" if quantize is None else quantize
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize={quantize!r} is not a quantization: choose one of "
                         f"{', '.join(QUANTIZE_CHOICES)} (--quantize=int8: int8 weights and "
                         f"KV cache)")
    return quantize


def quantized_name(path: tuple[str, ...]) -> str | None:
    """The `KERNEL_AXES` name of the kernel at `path` (parameter names), None if it is not
    one that int8 decoding quantizes."""
    if len(path) >= 3 and path[-1] == "kernel" and path[-2] in KERNEL_AXES:
        if path[-3] in ATTENTION and path[-2] in ("query", "key", "value", "out"):
            return path[-2]
        if path[-3] == "ffn" and path[-2].startswith("ff_"):
            return path[-2]
    if len(path) >= 2 and path[-2] == "moe" and path[-1] in ("ff_in", "ff_gate", "ff_out"):
        return path[-1]
    return None


def quantize_params(params: dict, where: str = "the parameters") -> dict:
    """`params` with every kernel `quantized_name` names as a `qwix.QArray` (int8, float32
    scales per output channel); the rest as given. One line where none is found (nothing to
    quantize: not this project's parameter paths) or one is not finite float (no scale
    represents it; checked in the program that quantizes). `where` names the parameters in
    that line."""
    _require_qwix()
    flat = {tuple(_key_name(k) for k in path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    chosen = {path: quantized_name(path) for path in flat}
    chosen = {path: name for path, name in chosen.items() if name is not None}
    if not chosen:
        raise ValueError(f"quantize='int8': {where} hold no attention or feed-forward kernel "
                         f"(<attention>/query/kernel, ffn/ff_in/kernel, moe/ff_in, ...: "
                         f"docs/architecture.md's parameter paths), so nothing would be int8; "
                         f"decode with quantize='none'")
    for path in chosen:
        if not jnp.issubdtype(flat[path].dtype, jnp.floating):
            raise _not_finite(path, where, flat[path].dtype)
    quantized, finite = _quantize_tree(params, tuple(sorted(chosen.items())))
    for path, ok in zip(sorted(chosen), jax.device_get(finite), strict=True):
        if not ok:
            raise _not_finite(path, where, flat[path].dtype)
    return quantized


def _require_qwix() -> None:
    try:
        import qwix  # noqa: F401
    except ImportError:
        raise ValueError("quantize='int8' needs Qwix: pip install 'transformer[quantize]' "
                         "(or qwix)") from None


def _not_finite(path: tuple[str, ...], where: str, dtype) -> ValueError:
    return ValueError(f"quantize='int8': {'/'.join(path)} in {where} is not finite floating "
                      f"point ({dtype}), so it has no int8 scale; decode with quantize='none' "
                      f"(or fix the checkpoint)")


def _quantize_tree(params: dict, chosen: tuple[tuple[tuple[str, ...], str], ...]):
    """(`params` with the kernels at the paths of `chosen`, (path, KERNEL_AXES name) pairs
    in order, as QArrays; whether each of them is finite), in one jitted program (a sharded
    kernel keeps its sharding)."""
    import qwix

    names = dict(chosen)

    def convert(path, leaf):
        name = names.get(tuple(_key_name(k) for k in path))
        if name is None:
            return leaf
        num_in, num_out = KERNEL_AXES[name]
        contracted = range(leaf.ndim - num_out - num_in, leaf.ndim - num_out)
        channels = tuple(axis for axis in range(leaf.ndim) if axis not in contracted)
        return qwix.quantize(leaf.astype(jnp.float32), jnp.int8, channelwise_axes=channels,
                             scale_dtype=jnp.float32)

    def run(tree):
        flat = {tuple(_key_name(k) for k in path): leaf
                for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
        finite = [jnp.isfinite(flat[path]).all() for path, _ in chosen]
        return jax.tree_util.tree_map_with_path(convert, tree), finite

    return jax.jit(run)(params)


def dequantize(params: dict) -> dict:
    """`params` with every `qwix.QArray` dequantized (values times scales, float32); a tree
    without one as it is. Called inside the jitted searches, so the float kernels exist only
    while a step uses them."""
    try:
        import qwix
    except ImportError:  # then no tree holds a QArray
        return params

    def quantized(leaf):
        return isinstance(leaf, qwix.QArray)

    if not any(map(quantized, jax.tree.leaves(params, is_leaf=quantized))):
        return params
    return jax.tree.map(lambda x: qwix.dequantize(x) if quantized(x) else x, params,
                        is_leaf=quantized)


def tree_bytes(tree) -> int:
    """The bytes of a tree's arrays (a QArray's values and scales): the sum of their nbytes."""
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _key_name(key) -> str:
    return str(getattr(key, "key", getattr(key, "name", key)))
