"""Train-step throughput, MFU and compiled memory for a config, with the data time kept apart.

    python benchmarks/train_step.py --config=configs/tiny.py [--config.a.b=v ...] [--steps 20]
        [--warmup 2] [--devices N]

Builds what `train.py` builds (the mesh from `mesh.*`, `train_state.build_trainer`, `init_state`,
`make_train_step`, `transformer.data.make_source` batches of `process_rows` rows), then:

- compile: `lower` and `compile` of the train step, timed apart from any run;
- memory: the compiled step's `memory_analysis()` per device: temporaries + arguments + outputs
  (the donated state is counted as an argument and as an output; `alias` shows how much of it
  XLA reuses in place);
- data: every batch is built before timing (`source.train_batch`, then `train_state.global_batch`),
  and the build time per batch is reported on its own;
- run: `--warmup` steps, then `--steps` steps each blocked on its result. Steps/s and tokens/s
  (non-pad target tokens, the step metrics' `target_tokens`) are medians over those steps. The
  same steps are then dispatched back to back without blocking ("pipelined": the training
  loop's way), so host dispatch overhead shows as the gap between the two;
- FLOPs: `flops.train_flops_per_token` (matmuls only, at the source's padded lengths) x non-pad
  target tokens / step time = achieved model FLOP/s; MFU against
  `metrics.peak_flops_per_device()` x devices. Where the peak is unknown (CPU), the machine's
  float32 GEMM rate is measured in the same run (the median of jitted 1024x1024 @ 1024x1024
  matmuls, one per device at once, so fake devices share the host's cores as the train step
  does; sampled just before and just after the timed steps, since a shared host's rate drifts)
  and the fraction of it achieved is reported instead. XLA's own count of the step's
  FLOPs (`cost_analysis`, all ops, per device) is shown beside the model count as a check.

`--devices N` fakes N CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N, and
JAX_PLATFORMS=cpu unless set). It must be set before JAX starts, so it is read from the command
line before anything imports jax. Prints a table, then one JSON line.
"""

from __future__ import annotations

import os
import sys


def _devices_from_argv(argv: list[str]) -> int | None:
    """`--devices N` / `--devices=N`, read before jax is imported (absl parses it again)."""
    for i, arg in enumerate(argv):
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
        if arg == "--devices" and i + 1 < len(argv):
            return int(argv[i + 1])
    return None


_FAKE_DEVICES = _devices_from_argv(sys.argv)
if _FAKE_DEVICES is not None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={_FAKE_DEVICES}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from ml_collections import config_flags  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from transformer.config import resolve  # noqa: E402
from transformer.data import make_source  # noqa: E402
from transformer.parallel import sharding  # noqa: E402
from transformer.sizing import flops  # noqa: E402
from transformer.training import metrics, train_state  # noqa: E402
from transformer.util import cli  # noqa: E402, F401  (the CLIs' quiet start-up)

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags: defined only when run as a script (gpu_check.py, sweep.py and
    peers/compare.py run_path this file for `benchmark`, under flags of their own)."""
    config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).",
                                    lock_config=True)
    flags.DEFINE_integer("steps", 20, "Timed steps (after the warm-up).")
    flags.DEFINE_integer("warmup", 2, "Untimed steps first (the first run of a program is "
                         "slower).")
    flags.DEFINE_integer("devices", None, "Fake this many CPU devices (default: what JAX sees).")
    flags.DEFINE_integer("gemm_size", 1024, "Side of the square float32 matmul that measures "
                         "the CPU's rate (where the device's peak is unknown).")
    flags.DEFINE_integer("gemm_runs", 10, "Timed matmuls for the CPU rate.")
    flags.mark_flags_as_required(["config"])


def _times(fn, runs: int) -> list[float]:
    """Wall times of `runs` blocked calls of `fn` (after one untimed call)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def make_gemm(size: int):
    """`(run, flops)`: one float32 [size, size] @ [size, size] per device at once, so fake CPU
    devices share the host's cores as the train step does; `flops` counts all devices."""
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("d",), (jax.sharding.AxisType.Auto,), devices=devices)
    spec = NamedSharding(mesh, P("d"))
    keys = jax.random.split(jax.random.key(0), 2)
    a, b = (jax.device_put(jax.random.normal(k, (len(devices), size, size), jnp.float32), spec)
            for k in keys)
    matmul = jax.jit(lambda x, y: jnp.einsum("dij,djk->dik", x, y), out_shardings=spec)
    return (lambda: matmul(a, b)), 2.0 * size**3 * len(devices)


def _cost_flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and "flops" in cost else None


def benchmark(cfg, steps: int, warmup: int, *, gemm_size: int = 1024,
              gemm_runs: int = 10) -> dict:
    num_devices = jax.device_count()
    run = resolve(cfg, num_devices)
    cfg = run.config
    model_cfg = run.model
    source = make_source(cfg)
    mesh = sharding.make_mesh(cfg.mesh)
    device = jax.devices()[0]
    row = {"backend": jax.default_backend(), "device_kind": device.device_kind,
           "devices": num_devices, "mesh": dict(mesh.shape), "dtype": model_cfg.dtype,
           "d_model": model_cfg.d_model, "d_ff": model_cfg.d_ff, "num_heads": model_cfg.num_heads,
           "layers": [model_cfg.num_encoder_layers, model_cfg.num_decoder_layers],
           "vocab_size": model_cfg.vocab_size, "params": flops.param_counts(model_cfg)["total"],
           "rows_per_microbatch": source.rows_per_batch,
           "grad_accum_steps": int(cfg.grad_accum_steps),
           "source_length": source.source_length, "target_length": source.target_length}

    trainer = train_state.build_trainer(run, mesh)
    row["loss_chunk_tokens"] = trainer.loss_chunk_tokens
    start = time.perf_counter()
    state = jax.block_until_ready(train_state.init_state(trainer, int(cfg.seed)))
    row["init_s"] = time.perf_counter() - start
    train_step = train_state.make_train_step(trainer, cfg)

    # Every batch before any timing: host rows (numpy), then the global device arrays.
    rows = train_state.process_rows(mesh, source.rows_per_batch)
    host_times = []
    put_times = []
    batches = []
    for index in range(warmup + steps):
        start = time.perf_counter()
        local = source.train_batch(index, rows)
        host_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        batches.append(jax.block_until_ready(train_state.global_batch(mesh, local)))
        put_times.append(time.perf_counter() - start)
    row["data_host_ms_per_batch"] = 1e3 * statistics.median(host_times)
    row["data_put_ms_per_batch"] = 1e3 * statistics.median(put_times)

    start = time.perf_counter()
    lowered = train_step.lower(state, batches[0])
    row["lower_s"] = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    row["compile_s"] = time.perf_counter() - start
    memory = compiled.memory_analysis()
    for name in ("temp", "argument", "output", "alias"):
        row[f"{name}_bytes"] = int(getattr(memory, f"{name}_size_in_bytes", 0) or 0)
    row["peak_bytes"] = row["temp_bytes"] + row["argument_bytes"] + row["output_bytes"]
    row["xla_flops_per_device_step"] = _cost_flops(compiled)

    # Where the peak is unknown (CPU), the GEMM rate is sampled just before and just after the
    # timed steps, under the same contention (other processes on a shared host) as they run.
    peak = metrics.peak_flops_per_device(device)
    gemm_times = []
    if peak is None:
        gemm, gemm_flops = make_gemm(gemm_size)
        gemm_times += _times(gemm, gemm_runs)

    # Blocked steps: one wall time per step.
    times = []
    tokens = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        state, step_metrics = compiled(state, batch)
        jax.block_until_ready((state, step_metrics))
        if i >= warmup:
            times.append(time.perf_counter() - start)
            tokens.append(float(step_metrics["target_tokens"]))
    # Pipelined: the same timed batches dispatched back to back, one block at the end.
    start = time.perf_counter()
    for batch in batches[warmup:]:
        state, step_metrics = compiled(state, batch)
    jax.block_until_ready((state, step_metrics))
    pipelined_s = (time.perf_counter() - start) / steps

    step_s = statistics.median(times)
    row.update(steps=steps, warmup=warmup, step_ms=1e3 * step_s, steps_per_sec=1 / step_s,
               step_ms_min=1e3 * min(times), step_ms_max=1e3 * max(times),
               pipelined_step_ms=1e3 * pipelined_s,
               target_tokens_per_step=statistics.mean(tokens),
               tokens_per_sec=statistics.median(t / s for t, s in zip(tokens, times, strict=True)),
               padding_efficiency=statistics.mean(tokens) / (
                   source.rows_per_batch * int(cfg.grad_accum_steps) * source.target_length))
    row["flops_per_target_token"] = flops.train_flops_per_token(
        model_cfg, source_length=source.source_length, target_length=source.target_length)
    row["model_flops_per_device_step_padded"] = (
        row["flops_per_target_token"] * source.target_length * source.rows_per_batch
        * int(cfg.grad_accum_steps) / num_devices)
    row["achieved_flops_per_sec"] = row["flops_per_target_token"] * row["tokens_per_sec"]
    row["peak_flops_per_device"] = peak
    row["mfu"] = None if peak is None else row["achieved_flops_per_sec"] / (peak * num_devices)
    row["gemm_flops_per_sec"] = row["fraction_of_gemm"] = None
    row["gemm_flops_per_sec_before_after"] = None
    if peak is None:
        before = gemm_flops / statistics.median(gemm_times)
        gemm_times += _times(gemm, gemm_runs)
        row["gemm_flops_per_sec"] = gemm_flops / statistics.median(gemm_times)
        row["gemm_flops_per_sec_before_after"] = [
            before, gemm_flops / statistics.median(gemm_times[gemm_runs:])]
        row["fraction_of_gemm"] = row["achieved_flops_per_sec"] / row["gemm_flops_per_sec"]
    return row


def _si(x: float | None, unit: str = "") -> str:
    if x is None:
        return "n/a"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:,.2f} {prefix}{unit}"
    return f"{x:,.2f} {unit}".rstrip()


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def table(r: dict) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    items = [
        ("backend", f"{r['backend']} ({r['device_kind']}), {r['devices']} device(s), {mesh}"),
        ("model", f"d_model {r['d_model']}, d_ff {r['d_ff']}, heads {r['num_heads']}, layers "
                  f"{r['layers'][0]}+{r['layers'][1]}, vocab {r['vocab_size']}, "
                  f"{r['params'] / 1e6:,.2f}M params, {r['dtype']}"),
        ("batch", f"{r['grad_accum_steps']} x {r['rows_per_microbatch']} rows, "
                  f"S={r['source_length']} T={r['target_length']}, "
                  f"{r['target_tokens_per_step']:,.0f} target tokens/step"
                  f" ({100 * r['padding_efficiency']:.0f}% non-pad)"),
        ("init (s)", f"{r['init_s']:.2f}"),
        ("lower / compile (s)", f"{r['lower_s']:.2f} / {r['compile_s']:.2f}"),
        ("data build per batch", f"host {r['data_host_ms_per_batch']:.2f} ms, to devices "
                                 f"{r['data_put_ms_per_batch']:.2f} ms (excluded below)"),
        ("step (ms), median", f"{r['step_ms']:.2f} (min {r['step_ms_min']:.2f}, max "
                              f"{r['step_ms_max']:.2f}, {r['steps']} steps after {r['warmup']})"),
        ("step (ms), pipelined", f"{r['pipelined_step_ms']:.2f}"),
        ("steps/s", f"{r['steps_per_sec']:.2f}"),
        ("tokens/s (non-pad target)", f"{r['tokens_per_sec']:,.0f}"),
        ("model FLOPs / target token", _si(r["flops_per_target_token"])),
        ("FLOPs / device / step", f"model (padded) {_si(r['model_flops_per_device_step_padded'])},"
                                  f" XLA {_si(r['xla_flops_per_device_step'])}"),
        ("achieved", _si(r["achieved_flops_per_sec"], "FLOP/s")),
    ]
    if r["mfu"] is not None:
        items.append(("MFU", f"{100 * r['mfu']:.2f}% of {_si(r['peak_flops_per_device'], 'FLOP/s')}"
                             f" x {r['devices']} (dense bf16 peak)"))
    else:
        before, after = r["gemm_flops_per_sec_before_after"]
        items.append(("float32 GEMM rate (measured)", f"{_si(r['gemm_flops_per_sec'], 'FLOP/s')}"
                      f" (before {_si(before)}, after {_si(after)})"))
        items.append(("fraction of GEMM rate", f"{100 * r['fraction_of_gemm']:.1f}%"))
    items.append(("memory / device", f"{_mib(r['peak_bytes'])} = temp {_mib(r['temp_bytes'])}"
                                      f" + args {_mib(r['argument_bytes'])} + out "
                                      f"{_mib(r['output_bytes'])} "
                                      f"(alias {_mib(r['alias_bytes'])})"))
    width = max(len(k) for k, _ in items)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in items)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.steps < 1 or FLAGS.warmup < 0:
        sys.exit("error: --steps must be >= 1 and --warmup >= 0")
    logging.set_verbosity(logging.WARNING)  # JAX's backend-probing chatter
    try:
        row = benchmark(FLAGS.config, FLAGS.steps, FLAGS.warmup, gemm_size=FLAGS.gemm_size,
                        gemm_runs=FLAGS.gemm_runs)
    except ValueError as error:
        sys.exit(f"error: {error}")
    print(table(row))
    print(json.dumps(row))


if __name__ == "__main__":
    define_flags()
    app.run(main)
