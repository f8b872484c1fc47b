"""What the command-line tools share (the `transformer.<verb>` commands; train.py in part): the
flags that name a trained run, quiet logging, and errors as one line.

Importing this module silences the C++ start-up chatter of TensorFlow, XLA, libtpu and gRPC
(their errors stay) unless `TRANSFORMER_VERBOSE=1` is set or `--verbosity`/`-v` is given, and
keeps JAX on the CPU where libtpu (the `tpu` extra, for `--compile_only`) is installed but the
machine has no TPU and no GPU plugin (else JAX loads libtpu, which prints its failed probes):
import it before anything starts a backend or imports TensorFlow.

    from transformer.util import cli
    cli.define_run_flags(average=True)

    def main(argv):
        cli.start(argv)
        with cli.one_line_errors():
            ...
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import logging
import os
import sys
from typing import NoReturn

from absl import flags
from absl import logging as absl_logging

FLAGS = flags.FLAGS
VERBOSE_ENV = "TRANSFORMER_VERBOSE"
# Read by the native libraries when they first log; a value the user set is kept.
# TensorFlow (2.21) prints its oneDNN notice whatever TF_CPP_MIN_LOG_LEVEL says, unless its
# oneDNN kernels are off: they would serve TensorFlow's matrix products, and TensorFlow here only
# reads and tokenizes data.
QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TPU_MIN_LOG_LEVEL": "2", "TPU_STDERR_LOG_LEVEL": "2",
             "GRPC_VERBOSITY": "ERROR", "GLOG_minloglevel": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}


def verbose(argv: list[str]) -> bool:
    """Whether the user asked for the libraries' own logs: TRANSFORMER_VERBOSE set (not 0), or
    absl's --verbosity / -v among `argv`."""
    return (os.environ.get(VERBOSE_ENV, "0") not in ("", "0")
            or any(a.split("=")[0] in ("--verbosity", "-v", "--v") for a in argv[1:]))


def quiet_native_logs(argv: list[str]) -> None:
    """Sets QUIET_ENV (where unset) unless `verbose(argv)`."""
    if not verbose(argv):
        for name, value in QUIET_ENV.items():
            os.environ.setdefault(name, value)


GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin")
TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")  # what JAX's own TPU check reads


def cpu_unless_an_accelerator() -> None:
    """Sets JAX_PLATFORMS=cpu (where unset) when libtpu is installed, no TPU device file
    exists and no GPU plugin is installed: the CPU is all JAX could use there. Also JAX's own
    setting when JAX is already imported (before any backend starts)."""
    if ("JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None
            or any(glob.glob(pattern) for pattern in TPU_DEVICE_FILES)
            or any(importlib.util.find_spec(name) for name in GPU_PLUGINS)):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # `import transformer` imported JAX, which read the variable then
        sys.modules["jax"].config.update("jax_platforms", "cpu")


quiet_native_logs(sys.argv)
cpu_unless_an_accelerator()
# The flags `define_run_flags` defines belong to the command that calls it: its --help lists them.
flags.disclaim_key_flags()


def define_run_flags(*, average: bool) -> None:
    """--workdir (required) and --step, and with `average` --average: which parameters of a
    trained run to load."""
    flags.DEFINE_string("workdir", None, "The training run's workdir.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).", lower_bound=0)
    if average:
        flags.DEFINE_integer("average", None, "Average the last N checkpoints' parameters.",
                             lower_bound=1)
    flags.mark_flags_as_required(["workdir"])


def start(argv: list[str], *, level: int = logging.WARNING, timestamps: bool = False) -> None:
    """Refuses stray arguments and sets up logging: our lines at `level` (`show_our_lines`),
    absl's (orbax's INFO chatter) at WARNING unless --verbosity says otherwise."""
    if len(argv) > 1:
        usage_error(f"unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)
    show_our_lines(level, timestamps=timestamps)


def usage_error(message: str) -> NoReturn:
    """Ends the program on a bad command line: `error: <message>` on stderr as one line (not
    absl's usage text), exit status 1, as absl's own flag errors."""
    sys.exit(f"error: {message} (--help lists the flags)")


def show_our_lines(level: int, *, timestamps: bool) -> None:
    """Our lines (the "transformer" logger) from `level` on stderr as plain text (with the time
    where `timestamps`), through their own handler: not in the glog format absl's handler on
    the root logger would give them."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(message)s" if timestamps else "%(message)s", datefmt="%H:%M:%S"))
    ours = logging.getLogger("transformer")
    ours.handlers = [handler]
    ours.setLevel(level)
    ours.propagate = False


@contextlib.contextmanager
def one_line_errors():
    """A ValueError or OSError (bad input, a missing or damaged file) ends the program with
    `error: <message>` on stderr and exit status 1, not a traceback."""
    try:
        yield
    except (ValueError, OSError) as error:
        sys.exit(f"error: {error}")
