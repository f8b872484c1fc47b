"""Linear attention (Katharopoulos et al., 2020, "Transformers are RNNs"), as pure functions.

The softmax's exp(q·k) is replaced by a kernel phi(q)·phi(k), so that the sums over keys factor:

    out_t = phi(q_t) (sum_s phi(k_s) v_s^T) / (phi(q_t) · sum_s phi(k_s))

with phi(x) = elu(x) + 1 (the paper's) or relu(x) (`FEATURE_MAPS`). Non-causal attention is the
two sums once: O(T) time and memory. Causal attention runs over chunks of C positions: within a
chunk the quadratic form with a causal mask, across chunks a carried state (sum phi(k) v^T
[B, K, H, Hv] and the normaliser sum phi(k) [B, K, H]), so memory stays O(T) and there is no
[T, S] anything. The same carried state, one token at a time, is the recurrent form that
decoding uses instead of a KV cache (`init_state`, `decode_step`).

Shapes are the package's legend (`transformer/__init__.py`), as `attention.dot_product_attention`:
q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] -> [B, T, N, Hv]. Query head n uses kv head
n // G. Sums are float32 whatever the input dtype. The output is in v's dtype.

Packed rows: `segment_ids` [B, T] (self-attention, ids of the packed sequences in contiguous
runs, 0 = padding) keep each query to the keys of its own sequence: the carried state restarts
when a new segment begins. A prefix LM's prefix (`in_prefix`, causal only) also attends to the
later positions of its prefix, through the same scan run backwards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FEATURE_MAPS = {"elu": lambda x: jax.nn.elu(x) + 1.0, "relu": jax.nn.relu}
DEFAULT_CHUNK_SIZE = 64
EPS = 1e-6  # added to the normaliser, as in the paper's code


def _features(x: jax.Array, feature_map: str) -> jax.Array:
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map={feature_map!r}; choose one of {', '.join(FEATURE_MAPS)}")
    return FEATURE_MAPS[feature_map](x.astype(jnp.float32))


def _grouped(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[B, T, N, H] -> [B, T, K, G, H]."""
    b, t, n, h = q.shape
    if n % num_kv_heads:
        raise ValueError(f"query heads N={n} must be a multiple of kv heads K={num_kv_heads}")
    return q.reshape(b, t, num_kv_heads, n // num_kv_heads, h)


def linear_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                     feature_map: str = "elu", kv_valid: jax.Array | None = None,
                     segment_ids: jax.Array | None = None, in_prefix: jax.Array | None = None,
                     chunk_size: int = DEFAULT_CHUNK_SIZE) -> jax.Array:
    """Linear attention, [B, T, N, H], [B, S, K, H], [B, S, K, Hv] -> [B, T, N, Hv].

    Args:
      causal: query t attends keys s <= t (needs T == S).
      feature_map: a key of `FEATURE_MAPS`.
      kv_valid: [B, S], False (or 0) for padded keys, which nobody attends.
      segment_ids: [B, T] (T == S) packed sequences in contiguous runs, 0 = padding: a query
        attends only keys of its own segment. Padded queries return zeros.
      in_prefix: [B, T] (causal only): a prefix LM's prefix (a run at each segment's start),
        whose queries attend the whole prefix of their segment.
      chunk_size: positions per chunk of the causal scan.
    """
    b, t, n, _ = q.shape
    s = k.shape[1]
    kh = k.shape[2]
    hv = v.shape[-1]
    fq = _features(_grouped(q, kh), feature_map)
    fk = _features(k, feature_map)
    vf = v.astype(jnp.float32)
    if kv_valid is not None:
        fk = fk * kv_valid.astype(jnp.float32)[..., None, None]
    if in_prefix is not None and not causal:
        raise ValueError("linear_attention: in_prefix applies to causal attention only")
    if not causal and segment_ids is None:
        num = jnp.einsum("BTKGH,BKHE->BTKGE", fq, jnp.einsum("BSKH,BSKE->BKHE", fk, vf))
        den = jnp.einsum("BTKGH,BKH->BTKG", fq, fk.sum(axis=1))
    else:
        if t != s:
            raise ValueError(f"linear_attention: causal or segment_ids need T == S, got T={t}, "
                             f"S={s}")
        seg = (jnp.ones((b, t), jnp.int32) if segment_ids is None
               else segment_ids.astype(jnp.int32))
        num, den, _ = _causal_scan(fq, fk, vf, seg, seg, strict=False, chunk=chunk_size)
        if not causal or in_prefix is not None:  # + the later keys: the scan run backwards
            later_keys = seg
            queries = jnp.ones((b, t), jnp.bool_)
            if in_prefix is not None:
                queries = in_prefix.astype(jnp.bool_)
                later_keys = jnp.where(queries, seg, 0)
            flip = lambda x: jnp.flip(x, axis=1)  # noqa: E731
            rnum, rden, _ = _causal_scan(flip(fq), flip(fk), flip(vf), flip(seg),
                                         flip(later_keys), strict=True, chunk=chunk_size)
            num = num + jnp.where(queries[..., None, None, None], flip(rnum), 0.0)
            den = den + jnp.where(queries[..., None, None], flip(rden), 0.0)
    out = num / (den + EPS)[..., None]
    return out.reshape(b, t, n, hv).astype(v.dtype)


def init_state(batch: int, num_kv_heads: int, head_dim: int, value_head_dim: int) -> dict:
    """The recurrent state of an empty sequence: {"state": sum phi(k) v^T [B, K, H, Hv],
    "normaliser": sum phi(k) [B, K, H]}, float32."""
    return {"state": jnp.zeros((batch, num_kv_heads, head_dim, value_head_dim), jnp.float32),
            "normaliser": jnp.zeros((batch, num_kv_heads, head_dim), jnp.float32)}


def decode_step(q: jax.Array, k: jax.Array, v: jax.Array, state: dict, *,
                feature_map: str = "elu", valid: jax.Array | None = None,
                in_prefix: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """Causal linear attention of T new positions after those summed in `state` (`init_state`):
    (out [B, T, N, Hv], the state with the new keys added). T = 1 is the recurrence
    S += phi(k) v^T, z += phi(k), out = phi(q) S / phi(q) z. A longer T (a prompt) is one chunk.

    valid [B, T]: new tokens to add (False: padding after the tokens, left out of the state).
    In_prefix [B, T]: the new tokens that form a prefix LM's prefix (a prompt in one call).
    """
    b, t, n, _ = q.shape
    kh = k.shape[2]
    hv = v.shape[-1]
    fq = _features(_grouped(q, kh), feature_map)
    fk = _features(k, feature_map)
    vf = v.astype(jnp.float32)
    seg = jnp.ones((b, t), jnp.int32) if valid is None else valid.astype(jnp.int32)
    carry = (state["state"], state["normaliser"], jnp.ones((b,), jnp.int32))
    num, den, (kv, z, _) = _causal_scan(fq, fk, vf, seg, seg, strict=False, chunk=t,
                                        carry=carry)
    if in_prefix is not None:
        prefix = in_prefix.astype(jnp.bool_)
        flip = lambda x: jnp.flip(x, axis=1)  # noqa: E731
        rnum, rden, _ = _causal_scan(flip(fq), flip(fk), flip(vf), flip(seg),
                                     flip(jnp.where(prefix, seg, 0)), strict=True, chunk=t)
        num = num + jnp.where(prefix[..., None, None, None], flip(rnum), 0.0)
        den = den + jnp.where(prefix[..., None, None], flip(rden), 0.0)
    out = (num / (den + EPS)[..., None]).reshape(b, t, n, hv).astype(v.dtype)
    return out, {"state": kv, "normaliser": z}


def _causal_scan(fq, fk, v, q_seg, k_seg, *, strict: bool, chunk: int, carry=None):
    """Numerator [B, T, K, G, Hv] and normaliser [B, T, K, G] of causal linear attention over
    features fq [B, T, K, G, H], fk [B, T, K, H], and the final carry.

    Query t sums keys s <= t (s < t if `strict`) with k_seg[s] == q_seg[t] != 0. The carry
    (sum phi(k) v^T, sum phi(k), the segment they belong to) holds the keys of earlier chunks
    of the segment that was running when the chunk ended. A new segment starts it afresh.
    """
    b, t, kh, g, h = fq.shape
    hv = v.shape[-1]
    c = max(1, min(chunk, t))
    num_chunks = -(-t // c)
    pad = num_chunks * c - t

    def chunks(x):  # [B, T, ...] -> [T/C, B, C, ...], padded with zeros (segment 0)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape((b, num_chunks, c) + x.shape[2:]).swapaxes(0, 1)

    order = jnp.tril(jnp.ones((c, c), jnp.bool_), k=-1 if strict else 0)

    def step(carry, xs):
        kv, z, running = carry
        fq_c, fk_c, v_c, qs, ks = xs
        same = (qs[:, :, None] == ks[:, None, :]) & (ks[:, None, :] != 0) & order  # [B, C, C]
        a = jnp.einsum("BTKGH,BSKH->BKGTS", fq_c, fk_c) * same[:, None, None].astype(
            jnp.float32)
        num = jnp.einsum("BKGTS,BSKE->BTKGE", a, v_c)
        den = jnp.moveaxis(a.sum(axis=-1), -1, 1)  # [B, C, K, G]
        earlier = ((qs == running[:, None]) & (qs != 0)).astype(jnp.float32)  # [B, C]
        num = num + jnp.einsum("BTKGH,BKHE->BTKGE", fq_c, kv) * earlier[..., None, None, None]
        den = den + jnp.einsum("BTKGH,BKH->BTKG", fq_c, z) * earlier[..., None, None]
        valid = ks != 0
        last_valid = c - 1 - jnp.argmax(valid[:, ::-1], axis=1)
        last = jnp.where(valid.any(axis=1),
                         jnp.take_along_axis(ks, last_valid[:, None], axis=1)[:, 0], running)
        keep = (last == running).astype(jnp.float32)
        fk_last = fk_c * ((ks == last[:, None]) & valid).astype(jnp.float32)[..., None, None]
        kv = kv * keep[:, None, None, None] + jnp.einsum("BSKH,BSKE->BKHE", fk_last, v_c)
        z = z * keep[:, None, None] + fk_last.sum(axis=1)
        return (kv, z, last), (num, den)

    if carry is None:
        carry = (jnp.zeros((b, kh, h, hv), jnp.float32), jnp.zeros((b, kh, h), jnp.float32),
                 jnp.zeros((b,), jnp.int32))
    carry, (num, den) = jax.lax.scan(
        step, carry, (chunks(fq), chunks(fk), chunks(v), chunks(q_seg), chunks(k_seg)))
    num = num.swapaxes(0, 1).reshape((b, num_chunks * c, kh, g, hv))[:, :t]
    den = den.swapaxes(0, 1).reshape((b, num_chunks * c, kh, g))[:, :t]
    return num, den, carry
