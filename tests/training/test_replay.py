"""Replaying a step (`transformer/training/replay.py`, `python -m transformer.replay`): the
replayed loss equals the logged one bit for bit on the same mesh, a perturbed parameter or
another batch changes it, the listed examples are the batch's, and bad input is one line."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import subprocess_env

from transformer.checkpoint import layout
from transformer.data import listing, make_source
from transformer.training import loop, replay

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, load_config):
    """A tiny run of 5 steps (dropout on) with checkpoints at steps 2, 4 and 5, every step
    logged, on the 8 fake devices."""
    workdir = tmp_path_factory.mktemp("replay") / "run"
    cfg = load_config("tiny.py", **{
        "data.batch_size": 16, "num_train_steps": 5, "checkpoint_every_steps": 2,
        "log_every_steps": 2, "eval_every_steps": 0, "model.d_model": 32, "model.d_ff": 64,
        "model.num_encoder_layers": 1, "model.num_decoder_layers": 1})
    loop.train_and_evaluate(cfg, str(workdir))
    return str(workdir)


@pytest.fixture(scope="module")
def step_3(run_dir):
    """Step 3 replayed (from checkpoint 2)."""
    return replay.replay(run_dir, 3)


def test_a_replayed_step_gives_the_logged_loss_bit_for_bit(run_dir, step_3):
    result = replay.replay(run_dir, 4)  # from checkpoint 2: steps 3 and 4
    assert result.restored == 2 and sorted(result.losses) == [3, 4]
    assert set(result.logged) == {3, 4}
    for step in (3, 4):  # bit for bit: the float32 bytes of both
        assert np.float32(result.logged[step]).tobytes() == \
            np.float32(result.losses[step]).tobytes(), step
        assert result.equal(step)
    assert result.mesh == result.run_mesh
    assert step_3.restored == 2 and step_3.loss == result.losses[3]


def test_a_perturbed_parameter_changes_the_loss(run_dir):
    def perturb(state):  # one weight of the decoder's feed-forward moved by 1e-3 (a key's
        # bias, or the whole embedding shifted alike, would not change a softmax)
        ffn = state.params["decoder"]["layers_0"]["ffn"]["ff_in"]
        ffn["kernel"] = ffn["kernel"].at[0, 0].add(1e-3)
        return state

    result = replay.replay(run_dir, 3, adjust=perturb)
    assert result.loss != result.logged[3] and result.equal(3) is False


def test_the_listed_examples_are_the_batch_s(run_dir, step_3):
    result = step_3
    cfg = layout.load_config(run_dir)
    source = make_source(cfg, run_dir)
    batch = source.train_batch(result.batch_index, (0, source.rows_per_batch))
    assert result.batch_index == 2  # steps 1, 2, 3 read batches 0, 1, 2
    assert len(result.examples) == 16
    for example in result.examples:  # synthetic: the dataset index of each row
        inputs, targets = source.task.example("train", example.index)
        micro, row = divmod(example.slot, source.rows_per_batch)
        np.testing.assert_array_equal(batch["inputs"][micro, row, :len(inputs)], inputs)
        np.testing.assert_array_equal(batch["targets"][micro, row, :len(targets)], targets)
    assert str(result.examples[0]) == f"batch row 0: train example {2 * 16}"


WORDS = ("the cat sat on a mat and dog ran far away from home in rain while birds sang over "
         "green hills near old stone bridges").split()


def test_examples_from_files_name_the_file_and_row(tmp_path, load_config):
    """A language model from jsonl shards: every piece packed into the batch is a piece of a
    document the listing names, read back from that row of that file."""
    rng = np.random.default_rng(0)
    for k in range(3):
        with open(tmp_path / f"part-{k}.jsonl", "w") as f:
            for _ in range(100):
                f.write(json.dumps({"text": " ".join(rng.choice(WORDS, rng.integers(4, 40)))})
                        + "\n")
    cfg = load_config("lm_files.py")
    cfg.data.update(dict(dataset=f"jsonl:{tmp_path}/part-*.jsonl",
                         eval_dataset=f"jsonl:{tmp_path}/part-0.jsonl", vocab_size=64,
                         max_length=32, batch_size=8, shuffle_window=2))
    source = make_source(cfg, str(tmp_path / "run"))
    examples = listing.batch_examples(source, 3)
    assert len(examples) == source.docs_per_batch
    assert {e.file for e in examples} <= {str(tmp_path / f"part-{k}.jsonl") for k in range(3)}
    pieces = {}  # each listed document's pieces as the source cuts them: ids + EOS, 32 a piece
    for example in examples:
        lines = pathlib.Path(example.file).read_text().splitlines()
        ids = [*source.tokenizer.encode([json.loads(lines[example.row])["text"]])[0],
               source.tokenizer.eos_id]
        for i in range(0, len(ids), 32):
            pieces[tuple(ids[i:i + 32])] = example
    batch = source.train_batch(3, (0, source.rows_per_batch))
    seen = set()
    for micro, row in np.ndindex(*batch["targets"].shape[:2]):
        segments = batch["targets_segmentation"][micro, row]
        for segment in set(segments.tolist()) - {0}:
            piece = tuple(batch["targets"][micro, row][segments == segment].tolist())
            assert piece in pieces, (micro, row, segment)
            seen.add(pieces[piece])
    assert len(seen) >= len(examples) // 2  # a few long documents' last pieces may be cut


def test_bad_input_is_one_line(run_dir, tmp_path):
    def refused(workdir, step, pattern):
        with pytest.raises(ValueError, match=pattern) as error:
            replay.check_step(workdir, step)
        assert "\n" not in str(error.value)

    refused(run_dir, 2, r"--step=2: no checkpoint .* precedes it \(its first is step 2\)")
    refused(run_dir, 9, r"--step=9 is beyond the last step .* \(5, of num_train_steps=5\)")
    refused(str(tmp_path), 3, "has no config.json: not a training workdir")
    refused(run_dir, 0, "steps count from 1")


@pytest.mark.slow
def test_the_command_prints_both_losses_and_the_batch(run_dir):
    """`python -m transformer.replay` in its own process (one CPU device: the run's mesh was
    8, so it also says equality holds only to the reduction order there)."""
    done = subprocess.run([sys.executable, "-m", "transformer.replay", f"--workdir={run_dir}",
                           "--step=3", "--max_examples=2"], cwd=ROOT, capture_output=True,
                          text=True, env=subprocess_env(), timeout=600)
    assert "note: replayed on mesh" in done.stdout, done.stderr
    assert "step 3: logged loss" in done.stdout
    assert "batch row 0: train example 32" in done.stdout
    assert "... 14 more" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "transformer.replay", f"--workdir={run_dir}",
                          "--step=2"], cwd=ROOT, capture_output=True, text=True,
                         env=subprocess_env(), timeout=600)
    assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0
    assert "no checkpoint" in bad.stderr
