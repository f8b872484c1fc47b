"""Opening a finished run: the one way every command and loader reads a workdir.

`open_run(workdir)` reads config.json once, resolves it, loads the parameters of the chosen
checkpoint and the run's vocabulary, and builds a mesh over the devices asked for. The
translator, the generator, the classifier, `evaluate`, the Hugging Face export and the
benchmarks take what they need from the `Run` it returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
from etils import epath
from jax.sharding import Mesh
from ml_collections import ConfigDict

from transformer.checkpoint import averaging, layout
from transformer.config import Resolved, resolve
from transformer.data import tokenizer as tokenizer_lib
from transformer.model.config import TransformerConfig
from transformer.parallel import sharding

VOCABULARY_CHOICES = ("required", "optional", "none", "auto")


@dataclasses.dataclass(frozen=True)
class Run:
    """A finished run as its workdir holds it."""

    workdir: str
    resolved: Resolved  # the config resolved for `mesh`
    provenance: dict  # config.json's provenance: versions, vocabulary, image statistics
    params: dict  # a host numpy tree
    step: int  # the training step of `params` (the last one averaged with `average`)
    label: str  # "latest", "step<N>" or "average<N>": how `params` were chosen
    tokenizer: tokenizer_lib.Tokenizer | tokenizer_lib.HuggingFaceTokenizer | None
    mesh: Mesh

    @property
    def config(self) -> ConfigDict:
        return self.resolved.config

    @property
    def model(self) -> TransformerConfig:
        return self.resolved.model


def open_run(workdir: str, *, step: int | None = None, average: int | None = None,
             vocabulary: str = "required",
             devices: Sequence[jax.Device] | None = None,
             check: Callable[[TransformerConfig], None] | None = None) -> Run:
    """The run in `workdir` with the parameters of checkpoint `step` (default the latest) or
    the average of the last `average` checkpoints.

    `vocabulary` says whether the run must have one ("required": an error otherwise),
    may have one ("optional") or is not read ("none", an image classifier). "auto" requires
    one unless the model classifies images. The mesh spreads the batch over `devices`, by
    default the first device alone. `check` sees the model config before anything is loaded,
    so that a run of the wrong kind is refused in one line before the parameters are read.
    """
    if vocabulary not in VOCABULARY_CHOICES:
        raise ValueError(f"vocabulary={vocabulary!r} must be one of {VOCABULARY_CHOICES}")
    values = layout.read_run_config(workdir)
    provenance = values.pop("provenance", {})
    devices = list(jax.devices()[:1] if devices is None else devices)
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, devices)
    run = resolve(ConfigDict(values))
    if check is not None:
        check(run.model)
    resolved = Resolved(run.config, run.model, dict(mesh.shape))
    if vocabulary == "auto":
        vocabulary = "none" if run.model.architecture == "vision" else "required"
    tokenizer = None
    vocab = tokenizer_lib.vocabulary_file(layout.path(workdir, layout.VOCAB))
    if vocabulary == "required" or (vocabulary == "optional" and epath.Path(vocab).is_file()):
        tokenizer = tokenizer_lib.load_run(workdir, run.model.vocab_size,
                                           layout.vocabulary_sha256(provenance))
    params = averaging.load_params(workdir, step=step, average=average)
    at_step = averaging.params_step(workdir, step=step, average=average)
    return Run(workdir, resolved, provenance, params, at_step, _label(step, average),
               tokenizer, mesh)


def _label(step: int | None, average: int | None) -> str:
    if average:
        return f"average{average}"
    return f"step{step}" if step else "latest"
