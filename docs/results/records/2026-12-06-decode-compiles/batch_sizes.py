"""Time beam decoding of the validation split at several translate() batch sizes."""

import sys
import time

from transformer.data import make_source
from transformer.inference.runs import open_run
from transformer.inference.translator import from_run
from transformer.training import scores

run = open_run(sys.argv[1])
tr = from_run(run)
src = make_source(run.config, run.workdir)
pairs = src.raw_pairs("validation", None)
sources = [s for s, _ in pairs]
refs = [t for _, t in pairs]
for bs in [int(b) for b in sys.argv[2].split(",")]:
    for rep in range(2):
        t = time.time()
        hyp = tr.translate(sources, batch_size=bs, show_progress=False)
        dt = time.time() - t
        b = scores.bleu(hyp, refs, target_lang="de")["bleu"]
        print(f"batch {bs} pass {rep}: {dt:.1f} s, bleu {b:.2f}", flush=True)
