"""transformer.inference.runs: `open_run` reads config.json once, loads what the run holds, and
refuses a run of the wrong kind before it reads any parameter."""

import jax
import numpy as np
import pytest

import transformer
from transformer.checkpoint import averaging, layout
from transformer.inference.runs import open_run


def test_open_run_reads_config_json_once_and_loads_the_run(untrained_translation_workdir,
                                                           monkeypatch):
    reads = []
    read_config_file = layout.read_config_file
    monkeypatch.setattr(layout, "read_config_file",
                        lambda workdir: reads.append(workdir) or read_config_file(workdir))
    run = open_run(str(untrained_translation_workdir))
    assert len(reads) == 1  # not again for the vocabulary
    assert run.model.architecture == "encoder_decoder" and run.label == "latest"
    assert run.step == averaging.params_step(str(untrained_translation_workdir))
    assert run.tokenizer is not None and run.tokenizer.vocab_size == run.model.vocab_size
    assert run.mesh.devices.size == 1 and run.resolved.mesh_shape["data"] == 1
    want = averaging.load_params(str(untrained_translation_workdir))
    for got, expected in zip(jax.tree.leaves(run.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(got, expected)


def test_open_run_without_a_vocabulary_when_asked(untrained_vision_workdir):
    run = open_run(str(untrained_vision_workdir), vocabulary="none")
    assert run.tokenizer is None and run.provenance["images"]["class_names"]
    assert open_run(str(untrained_vision_workdir), vocabulary="auto").tokenizer is None
    with pytest.raises(ValueError, match="vocabulary='some' must be one of"):
        open_run(str(untrained_vision_workdir), vocabulary="some")


@pytest.mark.parametrize("loader, fixture, message", [
    (transformer.load, "untrained_lm_workdir", "not a translation model"),
    (transformer.load_generator, "untrained_translation_workdir", "needs a decoder-only model"),
    (transformer.load_classifier, "untrained_lm_workdir", "not an image classifier"),
])
def test_a_run_of_the_wrong_kind_is_refused_before_its_parameters_are_read(
        loader, fixture, message, request, monkeypatch):
    workdir = str(request.getfixturevalue(fixture))

    def no_reading(*args, **kwargs):
        raise AssertionError("parameters read before the run's kind was checked")

    monkeypatch.setattr(averaging, "load_params", no_reading)
    with pytest.raises(ValueError, match=message):
        loader(workdir)
