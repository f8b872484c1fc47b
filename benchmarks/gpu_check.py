"""One-GPU check: attention parity, train-step throughput and MFU in bfloat16, decode speed.

    bash benchmarks/gpu_check.sh [--dry-run] [--out=gpu_check.json] [--checks=train_step,...]

Needs jax (with CUDA), flax, optax, orbax and ml-collections. No TensorFlow, no SentencePiece, no
network: every batch is synthetic (the copy task) and every model randomly initialised, since
only speed and numerical agreement are measured here.

1. Attention parity: `xla`, `chunked` and `cudnn` (where `attention.cudnn_supports` the inputs)
   on the same bfloat16 inputs with a causal and padding mask: the largest difference from a
   float32 `xla` reference, and forward+backward milliseconds.
2. Train step: the paper's base and big models in bfloat16 (post-LN, shared 37,000 vocabulary,
   dropout 0.1 / 0.3, Adam), rows of 256 target tokens, at ~25k target tokens per step (the
   paper's whole batch on one GPU) and at its per-GPU share (~3.1k: 25k over 8 P100s), through
   `benchmarks/train_step.py`: step time, tokens/s, compile time, memory and MFU against the
   device's dense bf16 peak.
3. Decoding (run before the train steps, which take longest): the base model's beam search
   (beam 4) and greedy search over 256 synthetic source sentences of 32 tokens: sentences/s.
4. Language model (run before the paper's train steps): `configs/lm_125m.py`'s model in
   bfloat16 on 8 rows of 2,048 tokens per step (`benchmarks/workloads/lm_125m.py`): tokens/s
   and MFU per device.
5. Loss chunks (last): the base model at ~25k tokens with the training loss's logits whole
   and in chunks of 8,192 and 2,048 tokens (`loss_chunk_tokens`): step time and memory, to
   size the accelerator default.

Prints one line per result and writes them all as JSON, rewritten after each check so that
the time limit of gpu_check.sh keeps whatever finished. `--dry-run` shrinks every size so the
whole script runs in a minute or two on a CPU (the test suite runs it that way).
"""

from __future__ import annotations

import functools
import json
import pathlib
import runpy
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.ops import attention, masks  # noqa: E402

PAPER = {"base": dict(layers=6, d_model=512, d_ff=2048, num_heads=8, dropout=0.1),
         "big": dict(layers=6, d_model=1024, d_ff=4096, num_heads=16, dropout=0.3)}
DRY = dict(layers=1, d_model=64, d_ff=128, num_heads=4)


def _median_ms(fn, runs: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def attention_parity(dry: bool) -> list[dict]:
    """Each implementation against a float32 `xla` reference, and its fwd+bwd time."""
    b, t, n, h = (2, 64, 4, 16) if dry else (4, 2048, 16, 64)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.bfloat16) for _ in range(3))
    valid = jnp.asarray(np.arange(t)[None] < np.array([[t]] + [[t - 7]] * (b - 1)))
    mask = masks.combine_masks(masks.make_causal_mask(t),
                               masks.make_padding_mask(valid, valid))
    reference = attention.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                mask=mask)
    implementations = ["xla", "chunked"] + (["cudnn"] if attention.cudnn_supports(q, k, v)
                                            else [])
    rows = []
    runs = 3 if dry else 10
    for impl in implementations:
        forward = jax.jit(lambda q, k, v, impl=impl: attention.dot_product_attention(
            q, k, v, mask=mask, implementation=impl))
        backward = jax.jit(jax.grad(lambda q, k, v, impl=impl: attention.dot_product_attention(
            q, k, v, mask=mask, implementation=impl).astype(jnp.float32).sum(), (0, 1, 2)))
        out = forward(q, k, v)
        rows.append({"check": "attention", "implementation": impl, "shape": [b, t, n, h],
                     "dtype": "bfloat16",
                     "max_abs_diff_vs_f32_xla": float(jnp.abs(out.astype(jnp.float32)
                                                              - reference).max()),
                     "forward_ms": _median_ms(functools.partial(forward, q, k, v), runs),
                     "forward_backward_ms": _median_ms(functools.partial(backward, q, k, v),
                                                       runs)})
    if "cudnn" not in implementations:
        rows.append({"check": "attention", "implementation": "cudnn",
                     "skipped": f"cuDNN flash attention unavailable on {jax.devices()[0]}"})
    return rows


def _synthetic_config(size: str, rows: int, length: int, dry: bool):
    """configs/tiny.py turned into the paper's `size` model on synthetic copy batches."""
    cfg = runpy.run_path(str(ROOT / "configs" / "tiny.py"))["get_config"]()
    dims = dict(PAPER[size], **(DRY if dry else {}))
    cfg.data.update(dict(task="copy", vocab_size=512 if dry else 37_000, min_length=length - 1,
                         max_length=length - 1, batch_size=rows))
    cfg.model.update(dict(num_encoder_layers=dims["layers"], num_decoder_layers=dims["layers"],
                          d_model=dims["d_model"], d_ff=dims["d_ff"],
                          num_heads=dims["num_heads"], dropout_rate=dims["dropout"],
                          max_len=length, dtype="bfloat16"))
    cfg.mesh.update(dict(data=1, fsdp=1, tensor=1))
    return cfg


def train_throughput(dry: bool, steps: int) -> list[dict]:
    """Base and big at the paper's whole batch and at its per-GPU share."""
    benchmark = runpy.run_path(str(ROOT / "benchmarks" / "train_step.py"))["benchmark"]
    length = 32 if dry else 256
    batches = {"25k tokens": 4 if dry else 98, "3.1k tokens (paper per GPU)": 2 if dry else 12}
    rows = []
    for size in ("base", "big"):
        for label, num_rows in reversed(batches.items()):  # the small batch first
            cfg = _synthetic_config(size, num_rows, length, dry)
            result = benchmark(cfg, steps, 1 if dry else 3, gemm_size=256 if dry else 1024,
                               gemm_runs=2 if dry else 10)
            rows.append({"check": "train_step", "model": size, "batch": label} | result)
    return rows


def loss_chunks(dry: bool, steps: int) -> list[dict]:
    """The base model at ~25k target tokens with the loss's logits whole (loss_chunk_tokens 0)
    and in chunks of 8,192 (the accelerator default) and 2,048 tokens: what chunking costs or
    saves in step time and memory on this GPU (`train_state.AUTO_LOSS_CHUNK_TOKENS_ACCELERATOR`)."""
    benchmark = runpy.run_path(str(ROOT / "benchmarks" / "train_step.py"))["benchmark"]
    rows = []
    for chunk in ((0, 64) if dry else (0, 8192, 2048)):
        cfg = _synthetic_config("base", 4 if dry else 98, 32 if dry else 256, dry)
        cfg.loss_chunk_tokens = chunk
        result = benchmark(cfg, steps, 1 if dry else 3, gemm_size=256 if dry else 1024,
                           gemm_runs=2 if dry else 10)
        rows.append({"check": "loss_chunks", "model": "base", "loss_chunk_tokens": chunk}
                    | result)
    return rows


def lm_throughput(dry: bool, steps: int) -> list[dict]:
    """The 125M language model's train step in bfloat16, 8 rows of 2,048 tokens."""
    benchmark = runpy.run_path(str(ROOT / "benchmarks" / "train_step.py"))["benchmark"]
    cfg = runpy.run_path(str(ROOT / "benchmarks" / "workloads" / "lm_125m.py"))["get_config"]()
    cfg.model.dtype = "bfloat16"
    cfg.data.batch_size = 2 if dry else 8
    if dry:
        cfg.data.update(dict(vocab_size=512, min_length=31, max_length=31))
        cfg.model.update(dict(vocab_size=512, num_decoder_layers=1, d_model=64, d_ff=128,
                              num_heads=4, num_kv_heads=2, max_len=32))
    result = benchmark(cfg, steps, 1 if dry else 3, gemm_size=256 if dry else 1024,
                       gemm_runs=2 if dry else 10)
    return [{"check": "lm_train_step", "model": "lm_125m"} | result]


def decode_speed(dry: bool) -> list[dict]:
    """Beam 4 and greedy search of a randomly initialised base model, sentences/s."""
    from transformer.config import resolve
    from transformer.inference.translator import Translator
    from transformer.parallel import sharding
    from transformer.training import train_state

    cfg = _synthetic_config("base", 8, 128, dry)
    cfg.model.dtype = "float32" if dry else "bfloat16"
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    run = resolve(cfg, 1)
    params = train_state.init_state(train_state.build_trainer(run, mesh), 0).params
    translator = Translator(run.config, run.model, params, tokenizer=None)
    rng = np.random.default_rng(1)
    count, length = (8, 8) if dry else (256, 32)
    sources = [list(rng.integers(4, cfg.data.vocab_size, size=length - 1)) + [3]
               for _ in range(count)]
    rows = []
    for beam in (4, 1):
        def run(beam=beam):
            out = []
            for start in range(0, count, 64):
                out.append(translator.translate_ids(sources[start:start + 64], beam_size=beam,
                                                    alpha=0.6, max_extra_length=8 if dry else 50))
            return out

        start = time.perf_counter()
        run()
        first = time.perf_counter() - start
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        rows.append({"check": "decode", "model": "base", "beam_size": beam, "sentences": count,
                     "source_length": length, "first_pass_s": first,
                     "sentences_per_sec": count / seconds})
    return rows


CHECKS = {  # run in this order; each given (dry_run, steps)
    "attention": lambda dry_run, steps: attention_parity(dry_run),
    "decode": lambda dry_run, steps: decode_speed(dry_run),
    "lm_train_step": lm_throughput,
    "train_step": train_throughput,
    "loss_chunks": loss_chunks}


def _known_checks(chosen: list[str]) -> bool:
    if unknown := sorted(set(chosen) - set(CHECKS)):
        raise flags.ValidationError(f"unknown {', '.join(unknown)}; choose from "
                                    f"{', '.join(CHECKS)}")
    return True


def define_flags() -> None:
    """The command line's flags: defined only when run as a script."""
    flags.DEFINE_boolean("dry-run", False, "Tiny sizes (runs on a CPU).")
    flags.DEFINE_string("out", "gpu_check.json", "Where the JSON goes.")
    flags.DEFINE_integer("steps", 10, "Timed train steps per setting.", lower_bound=1)
    flags.DEFINE_list("checks", ",".join(CHECKS), f"A subset of {','.join(CHECKS)} (all by "
                      f"default).")
    flags.register_validator("checks", _known_checks)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    args = flags.FLAGS
    chosen = args.checks
    dry_run = args["dry-run"].value
    device = jax.devices()[0]
    header = {"check": "device", "backend": jax.default_backend(), "device": str(device),
              "device_kind": device.device_kind, "jax": jax.__version__,
              "dry_run": dry_run}
    print(json.dumps(header))
    results = [header]
    failed = []
    for name, check in CHECKS.items():
        if name not in chosen:
            continue
        started = time.perf_counter()
        try:
            rows = check(dry_run, args.steps)
        except Exception as error:  # noqa: BLE001 - record it, go on with the other checks
            traceback.print_exc()
            rows = [{"check": name, "error": f"{type(error).__name__}: {error}"}]
            failed.append(name)
        for row in rows:
            print(json.dumps(row))
        results += rows
        print(f"# {name}: {time.perf_counter() - started:.0f} s", flush=True)
        with open(args.out, "w") as f:  # after every check: a timeout keeps what ran
            json.dump(results, f, indent=1)
    print(f"# wrote {args.out}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
