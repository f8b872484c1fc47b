"""Each command started the way a user starts it: no JAX_PLATFORMS (the tests' own environment
sets it, which hid libtpu's probes), libtpu installed (the `tpu` extra), a dataset prepared on
first use. stderr must hold only the project's own lines and progress: none of the native
libraries' glog lines (libtpu, TensorFlow, XLA, absl: `W1203 12:00:00.000000 ... file.py:1]`),
TensorFlow's oneDNN notice, absl's "before absl::InitializeLog()" line, Python warnings or
tracebacks. (XLA_FLAGS asks for its cheapest compile, as the other CLI tests do; it prints
nothing.)"""

import importlib.util
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from conftest import FAST_COMPILE, ROOT, SHRUNK_DEFAULT
from PIL import Image

pytestmark = pytest.mark.slow

# What a line from a library, not from us, looks like
FOREIGN = re.compile(
    r"^[IWEF]\d{4} \d\d:\d\d:\d\d"  # glog and absl's Python handler
    r"|absl::InitializeLog|oneDNN|libtpu|TPU|host bounds|dataset_info"
    r"|Traceback|\w+Warning: |^WARNING:|Downloading and preparing")


HOME = tempfile.mkdtemp(prefix="quiet_home")  # what the libraries write under ~ goes here


def _run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """`python args...` from the repository root in a user's environment; fails on a non-zero
    exit status or a foreign line on stderr (or stdout)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": HOME, "XLA_FLAGS": FAST_COMPILE}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, input=stdin,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    foreign = [line for line in (done.stderr + done.stdout).splitlines()
               if FOREIGN.search(line)]
    assert not foreign, f"{args[:2]} printed library lines:\n" + "\n".join(foreign)
    return done


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """configs/default.py shrunk, post-LN (so Marian can express it), 2 updates, its offline
    corpus prepared on first use into an empty data_dir: the first run of `make train`."""
    root = tmp_path_factory.mktemp("quiet")
    workdir = root / "run"
    done = _run("train.py", "--config=configs/default.py", f"--workdir={workdir}",
                f"--config.data.data_dir={root / 'tfds'}",
                f"--config.data.manual_dir={ROOT / 'tests' / 'data' / 'offline_de_en'}",
                "--config.num_train_steps=2", "--config.model.norm_position=post",
                *(f"--config.{key}={value}" for key, value in SHRUNK_DEFAULT.items()))
    assert "preparing offline_de_en" in done.stderr and "step 2/2" in done.stderr
    return workdir


def test_libtpu_is_installed_so_its_probes_are_tried():
    assert importlib.util.find_spec("libtpu"), "make test installs the tpu extra"


def test_training_and_the_commands_on_its_run_print_only_their_own_lines(trained_run, tmp_path):
    done = _run("-m", "transformer.evaluate", f"--workdir={trained_run}", "--split=test",
                "--num_sentences=2")
    assert "BLEU" in done.stdout + done.stderr
    done = _run("-m", "transformer.translate", f"--workdir={trained_run}", "--beam_size=1",
                stdin="See you tomorrow.\n" * 2)
    assert len(done.stdout.splitlines()) == 2
    done = _run("-m", "transformer.visualize", "curves", f"--workdir={trained_run}",
                f"--out={tmp_path / 'curves.png'}")
    assert (tmp_path / "curves.png").stat().st_size > 1000
    done = _run("-m", "transformer.convert", "export", f"--workdir={trained_run}",
                f"--to={tmp_path / 'marian'}")
    assert (tmp_path / "marian" / "model.safetensors").exists()


def test_generate_prints_only_the_continuation(untrained_lm_workdir):
    done = _run("-m", "transformer.generate", f"--workdir={untrained_lm_workdir}",
                "--prompt=She goes", "--max_new_tokens=3", "--temperature=0")
    assert done.stdout.startswith("She goes")


def test_classify_prints_only_its_results(untrained_vision_workdir, tmp_path):
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((28, 28), np.uint8)).save(image)
    done = _run("-m", "transformer.classify", f"--workdir={untrained_vision_workdir}",
                str(image))
    assert done.stdout.startswith(f"{image}: ")
