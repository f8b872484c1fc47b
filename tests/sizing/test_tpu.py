"""Compiling for TPU topologies without a TPU (`train.py --compile_only --topology`), multi-slice
meshes, splash attention, and float32 logits under bfloat16. The compile tests need libtpu (the
`tpu` extra, which `make test` installs; its wheels are for Linux x86-64 only, so elsewhere they
skip, saying why). In-process TPU compiles keep out of JAX's persistent cache
(`_tpu_compile`); subprocesses compile through `train.py`, as a user does."""

import collections
import contextlib
import dataclasses
import functools
import math
import os
import pathlib
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.config import resolve
from transformer.model.transformer import OutputHead, Transformer, TransformerConfig
from transformer.ops import attention, expert_parallel, masks, moe, splash
from transformer.parallel import sharding
from transformer.sizing import batches, flops, memory, step_flops, step_time, tpu
from transformer.training import optim, train_state

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def libtpu():
    if not tpu.libtpu_installed():
        pytest.skip(f"libtpu is not installed ({tpu.LIBTPU_MISSING})")


@contextlib.contextmanager
def _tpu_compile():
    """Compiling for abstract TPU devices in this process: libtpu's environment, and no writes to
    the persistent compilation cache (conftest's), whose entries a compile-only TPU executable
    cannot be read back from ("PjRtCompiler must be constructed with a Client")."""
    tpu.prepare_environment()
    saved = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved)


@pytest.mark.parametrize("name, libtpu_name, chips, megacore", [
    ("v4-8", "v4:2x2x1", 4, True), ("v4-32", "v4:2x2x4", 16, True),
    ("v5e-4", "v5e:2x2", 4, False), ("v5litepod-4", "v5e:2x2", 4, False),
    ("v5e-8", "v5e:2x4", 8, False), ("v5e-256", "v5e:16x16", 256, False),
    ("v5p-8", "v5:2x2x1", 4, True), ("v5p-128", "v5:4x4x4", 64, True),
    ("v6e-8", "v6e:2x4", 8, False), ("v5e:2x2", "v5e:2x2", 4, False),
    ("v4:2x2", "v4:2x2x1", 4, True),
])
def test_cloud_names_map_to_libtpu_topologies(name, libtpu_name, chips, megacore):
    topology = tpu.parse_topology(name, num_slices=2)
    assert topology.libtpu_name == libtpu_name and topology.num_devices == 2 * chips
    kwargs = topology.kwargs()
    assert kwargs["chip_config_name"] == ("megacore" if megacore else "default")
    assert kwargs["num_slices"] == 2


@pytest.mark.parametrize("name", ["v7-8", "v4-6", "v5p-7", "v5e-3", "tpu", "v5e:2x2x2", "v4-"])
def test_bad_names_are_one_line_listing_the_accepted_forms(name):
    with pytest.raises(ValueError, match=r"is not a TPU topology; use accelerator types v4-8"):
        tpu.parse_topology(name)


@pytest.mark.parametrize("name, slices, kind", [("v5e-4", 1, "TPU v5 lite"),
                                                ("v4-8", 2, "TPU v4"), ("v5p-8", 1, "TPU v5"),
                                                ("v6e-8", 1, "TPU v6 lite")])
def test_abstract_devices_one_per_chip(libtpu, name, slices, kind):
    tpu.prepare_environment()
    topology = tpu.parse_topology(name, slices)
    devices = tpu.abstract_devices(topology)
    assert len(devices) == topology.num_devices
    assert {d.device_kind for d in devices} == {kind}
    assert sharding.num_slices(devices) == slices


def test_dcn_axes_multiply_the_mesh_axes_across_slices():
    mesh = {"data": 1, "fsdp": -1, "tensor": 2}  # context left out: 1
    assert sharding.hybrid_shape(mesh, 16, 2) == ([1, 4, 1, 2], [2, 1, 1, 1])
    assert sharding.mesh_shape(mesh, 16, 2) == {"data": 2, "fsdp": 4, "context": 1, "tensor": 2}
    assert sharding.mesh_shape({**mesh, "dcn_data": 1, "dcn_fsdp": 2}, 16, 2) == {
        "data": 1, "fsdp": 8, "context": 1, "tensor": 2}
    assert sharding.mesh_shape({**mesh, "dcn_data": 1, "dcn_context": 2}, 16, 2) == {
        "data": 1, "fsdp": 4, "context": 2, "tensor": 2}
    assert sharding.mesh_shape(mesh, 16) == {"data": 1, "fsdp": 8, "context": 1, "tensor": 2}
    with pytest.raises(ValueError, match="mesh.dcn_data=3, mesh.dcn_fsdp=1, mesh.dcn_tensor=1 "
                                         "needs 3 slices, but 2 are available"):
        sharding.mesh_shape({**mesh, "dcn_data": 3}, 16, 2)


def test_config_takes_the_dcn_keys(load_config):
    cfg = load_config("tiny.py")
    cfg.mesh.dcn_data = 2
    assert resolve(cfg, 8, num_slices=2).mesh_shape == {"data": 8, "fsdp": 1, "context": 1,
                                                        "tensor": 1}


def test_hybrid_mesh_over_two_slices(libtpu):
    tpu.prepare_environment()
    devices = tpu.abstract_devices(tpu.parse_topology("v5e-4", 2))
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, devices)
    assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 4, "context": 1, "tensor": 1,
                                "expert": 1}
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert (slices == np.arange(2)[:, None, None, None, None]).all()  # data across slices


def test_a_mesh_axis_the_torus_cannot_hold_whole_splits_a_physical_axis(libtpu, caplog):
    tpu.prepare_environment()
    devices = tpu.abstract_devices(tpu.parse_topology("v5p-128"))  # a 4x4x4 torus
    mesh = sharding.make_mesh({"data": 1, "fsdp": 8, "tensor": 1, "expert": 8}, devices)
    assert dict(mesh.shape) == {"stage": 1, "data": 1, "fsdp": 8, "context": 1, "tensor": 1,
                                "expert": 8}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
    assert "physical axes are split" in caplog.text
    caplog.clear()
    sharding.make_mesh({"data": 1, "fsdp": 16, "tensor": 1, "expert": 4}, devices)
    assert "split" not in caplog.text  # 16 = 4 x 4 and 4: whole physical axes


def _train_py(*args: str, prefix: str = "") -> subprocess.CompletedProcess:
    """`train.py --compile_only ...` in a fresh process (JAX_PLATFORMS unset, as for a user)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    code = (f"{prefix}import runpy, sys; sys.argv = ['train.py', '--compile_only', *{args!r}]; "
            f"runpy.run_path('train.py', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600)


def _check_report(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"per_device_bytes:( \w+=\d+)+", last), result.stdout
    assert "TPU v5 lite: 14.90 GiB HBM" in result.stdout
    assert re.search(r"peak memory per device \(compiler\): .*: fits", result.stdout)
    assert re.search(r"step time estimate: (at least )?[0-9.]+ ms", result.stdout)
    assert re.search(r"MFU estimate: (at most )?[0-9.]+%", result.stdout)
    return result.stdout


def test_train_py_compiles_tiny_for_v5e_2x2(libtpu):
    """tiny.py's encoder-decoder at one layer a stack (its step program and the estimate's 1-
    and 2-layer ones then alike in size: three small compiles)."""
    report = _check_report(_train_py(
        "--config=configs/tiny.py", "--topology=v5e:2x2", "--config.model.num_encoder_layers=1",
        "--config.model.num_decoder_layers=1"))
    assert ("compile only: 4 tpu devices, mesh stage 1 x data 4 x fsdp 1 x context 1 x "
            "tensor 1") in report


def test_train_py_compiles_a_language_model_for_v5e_2x2(libtpu):
    """configs/lm_default.py as a TPU would train it (scanned layers, bfloat16), its vocabulary
    cut to 512 pieces to keep the compile short (measured: 33 s of CPU; 61 s at 8,000)."""
    report = _check_report(_train_py(
        "--config=configs/lm_default.py", "--topology=v5e:2x2", "--config.model.scan_layers=True",
        "--config.model.dtype=bfloat16", "--config.data.vocab_size=512"))
    assert ("compile only: 4 tpu devices, mesh stage 1 x data 4 x fsdp 1 x context 1 x "
            "tensor 1") in report
    assert re.search(r"model: [0-9,]+ params \(float32\), compute bfloat16, remat none, "
                     r"scan_layers True, attention splash", report)


def test_train_py_compiles_for_two_slices(libtpu):
    report = _check_report(_train_py(
        "--config=configs/tiny.py", "--topology=v5e-4", "--num_slices=2",
        "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1"))
    assert "8 x TPU v5 lite; data, fsdp, context, tensor within a slice (4, 1, 1, 1), across " \
           "slices (2, 1, 1, 1)" in report


def test_train_py_topology_errors_are_one_line():
    bad = _train_py("--config=configs/tiny.py", "--topology=v9-8")
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        f"error: --topology='v9-8' is not a TPU topology; use {tpu.ACCEPTED}"]
    missing = _train_py("--config=configs/tiny.py", "--topology=v5e-4",
                        prefix="import sys; sys.modules['libtpu'] = None; ")
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [f"error: {tpu.LIBTPU_MISSING}"]


def test_train_py_a_program_too_big_for_hbm_is_one_line(libtpu):
    """The TPU compiler refuses a program over HBM (with a dump of 100s of log lines)."""
    result = _train_py("--config=configs/lm_125m.py", "--topology=v5e-8")
    assert result.returncode == 1
    line, = result.stderr.strip().splitlines()
    assert re.fullmatch(r"error: does not fit on v5e-8: the TPU compiler says Ran out of memory "
                        r"on HBM, .* \([0-9.]+G\) exceeds available HBM \(15.75G\); .*", line)


def _dots(text: str) -> list[tuple[tuple[str, ...], str, tuple[int, ...]]]:
    """The StableHLO dot_generals of `text`: (operand dtypes, result dtype, result shape)."""
    found = []
    for operands, result in re.findall(
            r"stablehlo\.dot_general.*: \((.*)\) -> tensor<([0-9x]*[a-z0-9]+)>", text):
        *shape, dtype = result.split("x")
        found.append((tuple(re.findall(r"x?([a-z]+[0-9]+)>", operands)), dtype,
                      tuple(map(int, shape))))
    return found


def test_bfloat16_logits_and_attention_logits_accumulate_in_float32():
    """In the lowered HLO of a bfloat16 model, the output projection [B, T, V] and the
    attention logits and weights x values (5-D, in dot_general's order) are dot_generals of bfloat16
    operands with float32 results (preferred_element_type), never rounded to bfloat16."""
    config = TransformerConfig(vocab_size=96, num_encoder_layers=1, num_decoder_layers=1,
                               d_model=32, d_ff=64, num_heads=4, max_len=16, dtype="bfloat16",
                               attention_implementation="xla")
    tokens = jnp.ones((2, 8), jnp.int32)
    model = Transformer(config)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens, tokens)
    dots = _dots(jax.jit(model.apply).lower(params, tokens, tokens).as_text())
    bf16 = ("bf16", "bf16")
    assert (bf16, "f32", (2, 8, 96)) in dots  # logits
    scores = [d for d in dots if d[0] == bf16 and d[1] == "f32" and len(d[2]) == 5]
    assert len(scores) == 6  # QK^T and weights x V of encoder self-, decoder self- and cross-
    # attention
    assert not [d for d in dots if d[1] == "bf16" and d[2][-1] == 96]

    hidden = jnp.ones((2, 8, 32), jnp.bfloat16)
    kernel = jnp.ones((96, 32), jnp.bfloat16)
    head = jax.jit(lambda h, k: OutputHead(h, k, 0).logits()).lower(hidden, kernel).as_text()
    assert _dots(head) == [(bf16, "f32", (2, 8, 96))]
    targets = jnp.ones((2, 8), jnp.int32)
    loss = jax.jit(jax.grad(lambda h, k: optim.projected_cross_entropy_loss(
        h, k, targets, chunk_length=4).loss_sum)).lower(hidden, kernel).as_text()
    assert (bf16, "f32", (2, 4, 96)) in _dots(loss)  # each chunk's logits
    q = jnp.ones((2, 8, 4, 8), jnp.bfloat16)
    weights = jax.jit(attention.attention_weights).lower(q, q).as_text()
    assert _dots(weights) == [(bf16, "f32", (2, 4, 8, 8, 1))]


@pytest.mark.parametrize("causal, segments, kv_heads, window", [
    (True, False, 2, None), (True, True, 4, None), (False, True, 1, (16, 40)),
    (True, True, 2, 48)])
def test_splash_matches_xla_attention_in_interpret_mode(causal, segments, kv_heads, window):
    """The kernel on CPU (Pallas interpret mode) against the "xla" path, forward and the
    gradient of q, with packed rows, padding (id 0), a segment absent from the keys, and local
    windows (two-sided; causal, where 48 looks back only)."""
    b = 2
    t = 128
    n = 4
    h = 64
    q, k, v = (jax.random.normal(jax.random.key(i), shape, jnp.float32)
               for i, shape in enumerate([(b, t, n, h), (b, t, kv_heads, h), (b, t, kv_heads, h)]))
    q_ids = kv_ids = None
    mask = masks.make_causal_mask(t) if causal else None
    if segments:
        q_ids = jnp.asarray(np.repeat([[1, 2, 0, 0], [3, 3, 1, 0]], t // 4, axis=1), jnp.int32)
        kv_ids = q_ids.at[1, :32].set(4)  # segment 3's first rows have nothing to attend to
        mask = masks.combine_masks(mask, masks.make_segment_mask(q_ids, kv_ids))
    ids = dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids)

    def loss(fn, q):
        return jnp.sum(jnp.sin(fn(q)))

    xla = functools.partial(attention.dot_product_attention, k=k, v=v, mask=mask,
                            local_window_size=window if not causal or window is None
                            else (window, 0))
    kernel = functools.partial(splash.splash_attention, k=k, v=v, causal=causal,
                               local_window_size=window, interpret=True, **ids)
    np.testing.assert_allclose(kernel(q), xla(q), atol=2e-5)
    np.testing.assert_allclose(jax.grad(functools.partial(loss, kernel))(q),
                               jax.grad(functools.partial(loss, xla))(q), atol=2e-5)


@pytest.mark.parametrize("architecture", ["decoder", "encoder"])
def test_splash_in_the_model_matches_xla_attention(architecture):
    """A decoder-only LM (causal) and an encoder (both directions), each with a local layer
    (window 40) and a global one: with attention_implementation="splash" (the kernel in Pallas
    interpret mode on a CPU) the logits and parameter gradients equal "xla"'s, on packed rows
    with padding; on a 2 x 2 mesh (the kernel in a shard_map) as well."""
    decoder = architecture == "decoder"
    config = TransformerConfig(
        vocab_size=64, architecture=architecture, num_encoder_layers=0 if decoder else 2,
        num_decoder_layers=2 if decoder else 0, d_model=64, d_ff=128, num_heads=4,
        num_kv_heads=2, max_len=128, positional="rope", norm_position="pre",
        attention_window=40, attention_pattern="local,global", attention_implementation="xla")
    rng = np.random.default_rng(0)
    segments = np.repeat([[1, 2, 0, 0], [1, 1, 2, 3]], 32, axis=1)
    tokens = jnp.asarray(np.where(segments > 0, rng.integers(5, 64, segments.shape), 0))
    positions = jnp.asarray(np.tile(np.arange(32), (2, 4)))
    side = "targets" if decoder else "inputs"
    kwargs = {f"{side}_segmentation": jnp.asarray(segments), f"{side}_positions": positions}

    def loss(implementation, params):
        model = Transformer(dataclasses.replace(config, attention_implementation=implementation))
        logits = model.apply(params, None if decoder else tokens, tokens if decoder else None,
                             **kwargs)
        return jnp.sum(jnp.sin(logits) * (tokens != 0)[..., None]), logits

    params = Transformer(config).init(jax.random.key(0), None if decoder else tokens,
                                      tokens if decoder else None, **kwargs)
    (_, want), want_grads = jax.value_and_grad(functools.partial(loss, "xla"), has_aux=True)(
        params)
    # the kernel runs in both layers (local, global): the TPU's and its interpreted twin each
    assert str(jax.make_jaxpr(functools.partial(loss, "splash"))(params)).count(
        "pallas_call") == 4
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 2}, jax.devices()[:4])
    on_mesh = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))
    for args, context in ((params, contextlib.nullcontext()),
                          (on_mesh, jax.sharding.use_abstract_mesh(mesh.abstract_mesh))):
        with context:
            (_, got), grads = jax.jit(jax.value_and_grad(
                functools.partial(loss, "splash"), has_aux=True))(args)
        np.testing.assert_allclose(got, want, atol=2e-5)
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(g, w, atol=2e-6 * np.abs(w).max())  # float32 sums


def test_auto_attention_is_the_splash_kernel_in_a_tpu_train_step(libtpu, load_config):
    """A language model's train step for v5e:2x2 with attention "auto": the model runs
    "splash", and the compiled program holds its kernels (forward, dq and dkv per layer); on
    CPU devices "auto" stays "auto"."""
    cfg = load_config("lm_default.py", **{"data.vocab_size": 512, "model.num_decoder_layers": 1})
    with _tpu_compile():
        devices = tpu.abstract_devices(tpu.parse_topology("v5e:2x2"))
        run = resolve(cfg, len(devices))
        mesh = sharding.make_mesh(run.config.mesh, devices)
        trainer = train_state.build_trainer(run, mesh)
        assert trainer.model.config.attention_implementation == "splash"
        step = train_state.make_train_step(trainer, run.config)
        text = step.lower(trainer.abstract_state, batches.abstract_batch(run.config, mesh)) \
            .compile().as_text()
    assert text.count("tpu_custom_call") >= 3
    cpu = train_state.build_trainer(run, sharding.make_mesh(run.config.mesh, jax.devices()[:4]))
    assert cpu.model.config.attention_implementation == "auto"


@pytest.mark.parametrize("window", [None, 64])
def test_splash_compiles_for_v5e_2x2_in_a_shard_map(libtpu, window):
    with _tpu_compile():
        _compile_splash_for_v5e_2x2(window)


def _compile_splash_for_v5e_2x2(window: int | None):
    devices = tpu.abstract_devices(tpu.parse_topology("v5e:2x2"))
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 2}, devices)
    heads = jax.NamedSharding(mesh, jax.P(sharding.BATCH_AXES, None, "tensor", None))
    ids = jax.NamedSharding(mesh, jax.P(sharding.BATCH_AXES, None))
    q = jax.ShapeDtypeStruct((4, 256, 8, 128), jnp.bfloat16, sharding=heads)
    kv = jax.ShapeDtypeStruct((4, 256, 2, 128), jnp.bfloat16, sharding=heads)
    seg = jax.ShapeDtypeStruct((4, 256), jnp.int32, sharding=ids)

    def loss(q, k, v, seg):
        out = splash.sharded_splash_attention(q, k, v, mesh, causal=True, q_segment_ids=seg,
                                              kv_segment_ids=seg, local_window_size=window)
        return jnp.sum(out.astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv, seg).compile()
    assert compiled.as_text().count("tpu_custom_call") >= 3  # forward, dq, dkv kernels


def test_dropless_expert_parallel_compiles_for_v5e_2x2(libtpu):
    """Dropless routing over expert 2 x fsdp 2 (`ops/expert_parallel.py`'s all-gather dispatch),
    forward and backward in bfloat16: the TPU program keeps the grouped products ragged,
    has no all-to-all, reduce-scatters the outputs, and gathers tokens only (no all-gather as
    large as the experts' weights)."""
    with _tpu_compile():
        text = _compile_dropless_experts_for_v5e_2x2()
    assert "ragged-dot-metadata" in text  # grouped products, not a product over every expert
    assert "reduce-scatter(" in text and "all-to-all(" not in text
    gathered = [math.prod(int(n) for n in shape.split(",") if n)
                for shape in re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", text)]
    assert gathered and max(gathered) <= 4 * 64 * 128  # the batch's tokens at most


def _compile_dropless_experts_for_v5e_2x2() -> str:
    devices = tpu.abstract_devices(tpu.parse_topology("v5e:2x2"))
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 1, "expert": 2}, devices)
    experts = 4
    d = 128
    f = 256
    b = 4
    t = 64

    def array(shape, spec, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.NamedSharding(mesh, spec))

    rows = jax.P(sharding.BATCH_AXES)
    split = jax.P(sharding.EXPERT_AXIS)
    weights = moe.Experts(ff_in=array((experts, d, f), split),
                          ff_out=array((experts, f, d), split),
                          ff_gate=array((experts, d, f), split))

    def loss(x, logits, weights):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            routing, y, _ = expert_parallel.route_and_dispatch(
                x, logits, weights, k=2, capacity_factor=0.0, activation="swiglu")
        return jnp.sum(y.astype(jnp.float32) ** 2) + routing.aux_loss

    return jax.jit(jax.grad(loss, (0, 1, 2))).lower(
        array((b, t, d), rows), array((b, t, experts), rows, jnp.float32), weights
    ).compile().as_text()


@pytest.mark.slow
def test_sweep_ranks_what_fits_and_says_why_the_rest_was_dropped(libtpu, load_config):
    """A 1-layer decoder LM over v5e:2x2: context 2 (ring) and 1 fit and are ranked with their
    estimates; tensor 3 cannot divide the heads and is dropped in one line."""
    cfg = load_config("tiny.py", **{"model.architecture": "decoder", "data.max_length": 15,
                                    "model.dropout_rate": 0.0, "model.num_decoder_layers": 1,
                                    "model.context_parallel_strategy": "ring"})
    points = [{"mesh.data": 1, "mesh.fsdp": 4 // c, "mesh.context": c, "mesh.tensor": 1,
               "model.remat_policy": "full"} for c in (1, 2)]
    points.append({"mesh.data": 1, "mesh.fsdp": 1, "mesh.context": 1, "mesh.tensor": 3,
                   "model.remat_policy": "none"})
    with _tpu_compile():
        topology = tpu.parse_topology("v5e:2x2")
        report = tpu.sweep_report(cfg, topology, tpu.abstract_devices(topology), points)
    lines = report.splitlines()
    assert lines[0] == "sweep on v5e:2x2: 2 of 3 fit, fastest first"
    ranked = [re.search(r"context (\d) .*: ([0-9.]+) ms", line) for line in lines[1:3]]
    assert sorted(int(m.group(1)) for m in ranked) == [1, 2]
    assert float(ranked[0].group(2)) <= float(ranked[1].group(2))
    assert lines[3:] == ["dropped:", "  data 1 fsdp 1 context 1 tensor 3, remat none: "
                         "mesh.data=1, mesh.fsdp=1, mesh.tensor=3 needs 3 devices, but 4 are "
                         "available; "
                         "make the product 4 or set one axis to -1"]


def test_sweep_tries_fewer_microbatches_down_to_context_ones(load_config):
    """lm_125m at 16 rows, 1 row per device, on 8 devices: context c sizes 2c microbatches
    (a split row counts whole), and the grid halves that down to context 1's 2."""
    cfg = load_config("lm_125m.py", **{"data.batch_size": 16, "data.max_rows_per_device": 1})
    assert [tpu.sweep_microbatches(cfg, 8, c) for c in (1, 2, 4, 8)] == [
        [2], [4, 2], [8, 4, 2], [16, 8, 4, 2]]
    points = tpu.sweep_points(cfg, 8)
    assert len(points) == 3 * (1 + 2 + 3 + 4)
    assert points[-1] == {"mesh.data": 1, "mesh.fsdp": 1, "mesh.context": 8, "mesh.tensor": 1,
                          "model.remat_policy": "dots_no_batch", "grad_accum_steps": 2}
    fixed = load_config("lm_125m.py", **{"data.batch_size": 16, "grad_accum_steps": 4})
    assert tpu.sweep_microbatches(fixed, 8, 8) == [4]


def test_sweep_does_not_try_fewer_microbatches_than_a_count_that_did_not_fit(
        load_config, monkeypatch, capsys):
    """The compiler (stood in for) refuses 2 microbatches at context 4: 1 is not compiled;
    the other points are ranked. Each point's outcome is on stderr as it comes."""
    cfg = load_config("lm_125m.py", **{"data.batch_size": 16, "data.max_rows_per_device": 1,
                                       "model.num_decoder_layers": 1})
    compiled = []

    def plan(run, mesh, topology):
        compiled.append(run.config.grad_accum_steps)
        if run.config.grad_accum_steps < 4:
            raise tpu.DoesNotFit("does not fit on v5e:2x2: stood in")
        return types.SimpleNamespace(peak_bytes=0)

    monkeypatch.setattr(tpu, "_plan", plan)
    monkeypatch.setattr(tpu, "step_estimate", lambda run, *_: types.SimpleNamespace(
        seconds=1.0 / run.config.grad_accum_steps, overlapped_seconds=0.5))
    monkeypatch.setattr(step_flops, "step_flops_per_device", lambda *_: 1.0)
    points = [{"mesh.data": 1, "mesh.fsdp": 1, "mesh.context": 4, "mesh.tensor": 1,
               "model.remat_policy": "full", "grad_accum_steps": a} for a in (8, 4, 2, 1)]
    topology = tpu.parse_topology("v5e:2x2")
    lines = tpu.sweep_report(cfg, topology, jax.devices()[:4], points).splitlines()
    assert compiled == [8, 4, 2]
    assert lines[0] == "sweep on v5e:2x2: 2 of 4 fit, fastest first"
    assert [re.match(r"  \d\. .*, (\d) microbatch\(es\): ([0-9.]+) ms", line).groups()
            for line in lines[1:3]] == [("8", "125.0"), ("4", "250.0")]
    assert lines[3:] == [
        "dropped:",
        "  data 1 fsdp 1 context 4 tensor 1, remat full, 2 microbatch(es): does not fit on "
        "v5e:2x2: stood in",
        "  data 1 fsdp 1 context 4 tensor 1, remat full, 1 microbatch(es): not tried, 2 "
        "microbatch(es) did not fit"]
    shown = capsys.readouterr().err.splitlines()
    assert [re.search(r"sweep: (\d/\d) points, .* ETA \d:\d\d:\d\d: .*(ms|fit)", line).groups()
            for line in shown] == [("1/4", "ms"), ("2/4", "ms"), ("3/4", "fit"), ("4/4", "fit")]


def test_collectives_of_a_context_split_step_counted_by_hand(libtpu, load_config):
    """A causal LM (lm_default's block at d_model 128, d_ff 256, 4 heads of 32, 2 kv heads, 2
    layers, vocabulary 384) over rows of 256 tokens split 4 ways (`context` 4, "all_gather"),
    2 microbatches, remat full, compiled for v5e:2x2. By hand, per layer and microbatch (4 in
    all): its 7 weight matrices (params sharded over fsdp x context) gathered in the forward
    pass and again in the recomputation (q and out 32 KiB, k and v 16 KiB, the three
    feed-forward 64 KiB, bfloat16), the keys and values ([4, 256, 2, 32], 128 KiB) gathered
    in both and their gradients reduce-scattered. The TPU compiler splits an async gather into
    a chain of 3-4 fusions, some inside the attention's loop over blocks: counted per piece
    this read 124 feed-forward gathers for 24."""
    cfg = load_config("lm_default.py", **{
        "data.vocab_size": 384, "data.max_length": 256, "model.max_len": 256,
        "model.num_decoder_layers": 2, "model.d_model": 128, "model.d_ff": 256,
        "model.num_heads": 4, "model.num_kv_heads": 2, "model.scan_layers": True,
        "model.dtype": "bfloat16", "model.remat_policy": "full",
        "model.context_parallel_strategy": "all_gather", "mesh.data": 1, "mesh.fsdp": 1,
        "mesh.context": 4, "mesh.tensor": 1, "data.batch_size": 8, "grad_accum_steps": 2,
        "data.max_rows_per_device": 0})
    with _tpu_compile():
        topology = tpu.parse_topology("v5e:2x2")
        devices = tpu.abstract_devices(topology)
        run = resolve(cfg, len(devices))
        plan = tpu._plan(run, sharding.make_mesh(run.config.mesh, devices), topology)
    counts = collections.Counter()
    for c in plan.collectives:
        counts[c.kind, c.result_bytes, c.group] += c.count
    assert counts["all-gather", 2 * 128 * 4 * 32, 4] == 2 * 2 * 4  # q, out
    assert counts["all-gather", 2 * 128 * 2 * 32, 4] == 2 * 2 * 4  # k, v
    assert counts["all-gather", 2 * 128 * 256, 4] == 3 * 2 * 4  # feed-forward
    assert counts["all-gather", 2 * 4 * 256 * 2 * 32, 4] == 2 * 2 * 4  # keys and values
    assert counts["reduce-scatter", 2 * 4 * 64 * 2 * 32, 4] == 2 * 4  # their gradients


def _dot_flops(text: str) -> int:
    """The matmul FLOPs of StableHLO `text`: 2 x result elements x contracted size over its
    dot_generals (a loop body counted once: the programs below loop only over the loss's
    chunks, alike with and without remat)."""
    total = 0
    for contracting, lhs, result in re.findall(
            r"stablehlo\.dot_general .*contracting_dims = \[([\d, ]*)\] x .*: "
            r"\(tensor<([^>]*)>, tensor<[^>]*>\) -> tensor<([^>]*)>", text):
        lhs_shape = [int(n) for n in lhs.split("x")[:-1]]
        contracted = math.prod(lhs_shape[int(d)] for d in contracting.split(","))
        total += 2 * math.prod(int(n) for n in result.split("x")[:-1]) * contracted
    return total


SMALL_LM = {"data.vocab_size": 256, "data.max_length": 128, "model.max_len": 128,
            "model.num_decoder_layers": 2, "model.d_model": 128, "model.d_ff": 256,
            "model.num_heads": 4, "model.num_kv_heads": 2}


@pytest.mark.parametrize("name, overrides", [
    ("lm_default.py", SMALL_LM),  # decoder, causal, pre-LN, SwiGLU
    ("mlm_default.py", {**SMALL_LM, "model.num_encoder_layers": 2,
                        "model.num_decoder_layers": 0}),  # encoder: no mask to leave out
    ("tiny.py", {}),  # encoder-decoder, post-LN (the paper's block), cross-attention
], ids=["causal-pre-ln", "encoder-pre-ln", "encoder-decoder-post-ln"])
@pytest.mark.parametrize("policy", ["full", "dots_no_batch"])
def test_remat_flops_are_the_matmuls_the_program_recomputes(load_config, name, overrides,
                                                            policy):
    """`step_flops.remat_flops` against a count it does not share assumptions with: the matmul
    FLOPs of the train step as JAX hands it to the compiler (the StableHLO that jax.checkpoint
    wrote, recomputation included), with remat less without, unrolled layers, "xla"
    attention, one CPU device. A TPU program cannot stand in: its compiler windows matmuls
    per program and its cost model does not see the splash kernel. Exact: both sides count
    whole matmuls (integers far below 2^53), and the one known difference is stated here:
    "xla" computes a causal score matrix whole, and flops.py (so remat_flops) counts the
    half its mask keeps, T^2 / 2 x (d_k + d_v) x 2 FLOPs a head, row and layer."""
    programs = {}
    for remat in ("none", policy):
        cfg = load_config(name, **overrides, **{
            "model.scan_layers": False, "model.remat_policy": remat,
            "model.attention_implementation": "xla", "data.batch_size": 4,
            "grad_accum_steps": 1, "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1})
        run = resolve(cfg, 1)
        mesh = sharding.make_mesh(run.config.mesh, jax.devices()[:1])
        trainer = train_state.build_trainer(run, mesh)
        programs[remat] = _dot_flops(train_state.make_train_step(trainer, run.config).lower(
            trainer.abstract_state, batches.abstract_batch(run.config, mesh)).as_text())
    plan = memory.plan(run, mesh)
    m = run.model
    _, rows, _, target = batches.batch_lengths(m, plan.batch)
    causal_layers = m.num_decoder_layers if m.architecture != "encoder" else 0
    masked = rows * causal_layers * target ** 2 * m.num_heads * (m.d_k + m.d_v)
    assert programs[policy] - programs["none"] == step_flops.remat_flops(m, plan) + masked


@pytest.mark.slow
def test_step_estimate_adds_the_splash_kernels_flops_and_their_recomputation(libtpu,
                                                                          load_config):
    """A causal LM at 2,048 tokens with the splash kernel, remat full, for v5e:2x2: one layer,
    unscanned, one microbatch, so the step is its own 1- and 2-layer variants (one TPU compile,
    not three: 61 -> 20 s of CPU; 160 s at 4,096 tokens and 4 layers of 512). The cost model sees
    nothing inside the kernel, so the FLOPs it does not count are about the attention's scores
    and values (flops.py: 3 x forward) and their recomputation (1 x forward): 3% under here, as
    the compiler also counts the layers' elementwise FLOPs (norms, activations, RoPE, casts),
    which flops.py does not. Those are constant per token while the scores' grow with the
    length: 1.5% under at 4,096 tokens, 7% at 1,024. Before remat's recomputation was counted
    as run, the recomputed matmuls the compiler counts came off the term: it read flops.py's
    less the compiler's, under half of it."""
    cfg = load_config("lm_default.py", **{
        "data.vocab_size": 512, "data.max_length": 2048, "model.max_len": 2048,
        "model.num_decoder_layers": 1, "model.d_model": 256, "model.d_ff": 512,
        "model.num_heads": 2, "model.num_kv_heads": 2, "model.scan_layers": False,
        "model.dtype": "bfloat16", "model.remat_policy": "full", "data.batch_size": 4,
        "grad_accum_steps": 1, "data.max_rows_per_device": 0})
    with _tpu_compile():
        topology = tpu.parse_topology("v5e:2x2")
        devices = tpu.abstract_devices(topology)
        run = resolve(cfg, len(devices))
        plan = tpu._plan(run, sharding.make_mesh(run.config.mesh, devices), topology)
        estimate = tpu.step_estimate(run, topology, devices, plan)
    peak = topology.chip.device.peak_flops
    parts = flops.forward_flops(run.model, source_length=2048, target_length=2048)
    attention = parts["attention_scores_values"] * 4 / 4  # forward, the rows of a device
    # remat_flops, the term's recomputation, is checked against the program's own matmuls in
    # test_remat_flops_are_the_matmuls_the_program_recomputes; here that the estimate adds it
    assert estimate.recomputed * peak == pytest.approx(step_flops.remat_flops(run.model, plan),
                                                       rel=1e-12)  # float64 division
    assert estimate.unseen * peak == pytest.approx(4 * attention, rel=0.1)
    before = step_flops.step_flops_per_device(run.model, plan) - estimate.compiler_flops
    assert before < 0.5 * 4 * attention


def test_int8_matmuls_counted_in_the_tpu_program_and_priced_at_the_int8_peak(libtpu,
                                                                            load_config):
    """`model.quantization=int8` (Qwix) on a 1-layer decoder compiled for v5e:2x2 (one TPU
    compile): the compiled program holds the layer's 7 weight matmuls forward (q, k, v, out,
    ff_in, ff_gate, ff_out) as s8 x s8 dots, the backward pass's in bfloat16 (Qwix's int8
    training); their FLOPs per device are the by-hand count exactly (integers); and the
    estimate takes them off the compute at the int8 peak, 393 TOP/s against 197 TFLOP/s."""
    d, heads, kv_heads, d_k, d_ff = 128, 4, 2, 32, 256
    cfg = load_config("lm_default.py", **{
        "data.vocab_size": 256, "data.max_length": 64, "model.max_len": 64,
        "model.num_decoder_layers": 1, "model.d_model": d, "model.d_ff": d_ff,
        "model.num_heads": heads, "model.num_kv_heads": kv_heads, "model.scan_layers": False,
        "model.dtype": "bfloat16", "model.attention_implementation": "xla",
        "model.quantization": "int8", "data.batch_size": 8, "grad_accum_steps": 1,
        "data.max_rows_per_device": 0})
    with _tpu_compile():
        topology = tpu.parse_topology("v5e:2x2")
        devices = tpu.abstract_devices(topology)
        run = resolve(cfg, len(devices))
        plan = tpu._plan(run, sharding.make_mesh(run.config.mesh, devices), topology)
    assert plan.int8_dots == 7
    per_token = 2 * (d * heads * d_k + 2 * d * kv_heads * d_k + heads * d_k * d + 3 * d * d_ff)
    assert plan.int8_flops == per_token * 8 * 64 / 4  # a device's 2 rows of 64 tokens
    assert plan.int8_counted == plan.int8_flops  # no windowed matmul loop: each counted once
    chip = topology.chip
    assert (chip.device.peak_flops, chip.int8_ops) == (197e12, 393e12)

    def estimate(int8_peak):
        one = step_time.program_cost(plan.cost, chip.device.peak_flops,
                                     chip.device.memory_bytes_per_s, plan.int8_flops,
                                     plan.int8_counted, int8_peak)
        return step_time.extrapolate(
            one, one, [], chip.device.name, layers=1, microbatches=1, optimizer_seconds=0.0,
            analytic_flops=0.0, recomputed_flops=0.0, peak_flops=chip.device.peak_flops,
            int8_peak=int8_peak, int8_dots_=plan.int8_dots)

    bf16, int8 = estimate(None), estimate(chip.int8_ops)
    saved = plan.int8_flops * (1 / 197e12 - 1 / 393e12)
    assert int8.int8_saved == pytest.approx(saved, rel=1e-12)  # float64 sums
    assert bf16.compute - int8.compute == pytest.approx(saved, rel=1e-9)
    line = step_time.describe(int8, 1.0, chip.device.peak_flops, chip.int8_ops)[-1]
    assert line.startswith("int8 matmuls: 7 s8 x s8 dot(s) a step in the compiled program")
    assert "priced at the int8 peak 393 TOP/s" in line


def test_sweep_tries_each_quantization_at_every_point(load_config):
    """`--sweep_quantization=none,int8` doubles the grid, each point with each value, and
    names the value in its line; an unknown name is one line before any compile."""
    cfg = load_config("lm_125m.py", **{"data.batch_size": 16, "data.max_rows_per_device": 1})
    plain = tpu.sweep_points(cfg, 8)
    both = tpu.sweep_points(cfg, 8, tpu.sweep_quantizations("none, int8"))
    assert both == [{**p, "model.quantization": q} for p in plain for q in ("none", "int8")]
    assert tpu.sweep_quantizations(None) == ()
    with pytest.raises(ValueError, match=r"^--sweep_quantization names 'int4'; use a "
                                         r"comma-separated list of none, int8, int8_full, fp8$"):
        tpu.sweep_quantizations("none,int4")
