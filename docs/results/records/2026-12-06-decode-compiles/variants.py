"""One validation decode (fresh process: compiles included) with padded_rows variants."""

import collections
import os
import sys
import time

from jax import monitoring

from transformer.data import make_source
from transformer.inference import translator as T
from transformer.inference.runs import open_run
from transformer.training import scores

events = collections.defaultdict(list)
monitoring.register_event_duration_secs_listener(lambda n, d, **k: events[n].append(d))
min_rows = int(os.environ.get("MIN_ROWS", "1"))
pow2 = os.environ.get("POW2") == "1"
orig = T.padded_rows


def padded(count):
    power = 1 << (max(count, 1) - 1).bit_length()
    size = power if pow2 else orig(count)
    return max(size, min_rows)


T.padded_rows = padded
if os.environ.get("NOSTAGE") == "1":
    T._staged = lambda config, max_length: False
if os.environ.get("NODROP") == "1":

    class F:
        def __init__(self, model, beam, alpha, max_length, stop_ids, int8):
            self.f = T._search_fn(
                model, beam, alpha, max_length, model.config.scan_layers, stop_ids, int8
            )

        def __call__(self, params, inputs, max_lengths):
            return T._to_host(self.f(params, inputs, max_lengths))

    T._BeamSearchDroppingDecided = F
if "BUCKET" in os.environ:
    T.BUCKET = int(os.environ["BUCKET"])
run = open_run(sys.argv[1])
tr = T.from_run(run)
src = make_source(run.config, run.workdir)
split = sys.argv[3] if len(sys.argv) > 3 else "validation"
pairs = src.raw_pairs(split, None)
sources = [s for s, _ in pairs]
refs = [t for _, t in pairs]
bs = int(sys.argv[2])
for rep in range(2):
    t = time.time()
    hyp = tr.translate(sources, batch_size=bs, show_progress=False)
    c = sum(events["/jax/core/compile/backend_compile_duration"])
    n = len(events["/jax/core/compile/backend_compile_duration"])
    print(
        f"{split} batch {bs} min_rows {min_rows} pow2 {pow2} bucket {T.BUCKET} pass {rep}: "
        f"{time.time() - t:.1f} s, "
        f"{n} compiles {c:.1f} s, bleu {scores.bleu(hyp, refs, target_lang='de')['bleu']:.2f}",
        flush=True,
    )
    events.clear()
