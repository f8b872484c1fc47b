"""Train a Transformer: `python train.py --config=configs/<x>.py --workdir=<dir>`.

Overrides: `--config.a.b=value`. `--summary` prints parameters and FLOPs without allocating
anything (no workdir needed). `--compile_only --mesh_devices=N` compiles the train step for N
(fake CPU) devices on abstract arrays and prints the memory each device would need (no workdir);
`--compile_only --topology=v5p-128 [--num_slices=2]` compiles it for that TPU topology with the
TPU compiler (no TPU needed; `pip install -e ".[tpu]"`) and adds its time and MFU estimates.
Rerunning with the same workdir resumes from its latest checkpoint. `--score_split=test` then
scores the trained run's test split as `python -m transformer.evaluate --split=test` does (a
rerun of a finished run just scores it again).
"""

import logging as pylogging
import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and TensorBoard.")
flags.DEFINE_bool("summary", False, "Print the parameter and FLOPs summary and exit.")
flags.DEFINE_bool("compile_only", False, "Lower and compile the train step, print memory, exit.")
flags.DEFINE_integer("mesh_devices", None, "With --compile_only: the number of devices to plan "
                     "for (fake CPU devices stand in for them).")
flags.DEFINE_string("topology", None, "With --compile_only: a Cloud TPU accelerator type (v5p-128, "
                    "v5e-8, v4-32, ...) or chip grid (v5e:2x2) to compile for; needs libtpu.")
flags.DEFINE_integer("num_slices", 1, "With --topology: the number of slices (multi-slice).")
flags.DEFINE_bool("sweep", False, "With --topology: compile a grid of context splits, remat "
                  "policies and microbatch counts, drop what does not fit, rank the rest by "
                  "estimated step time.")
flags.DEFINE_string("sweep_quantization", None, "With --sweep: model.quantization values to "
                    "try at every point, e.g. none,int8 (default: the config's own).")
flags.DEFINE_string("sweep_stages", None, "With --sweep: pipeline stage counts to add to the "
                    "grid, e.g. 2,4 (each with mesh.pipeline_repeats 1 and 2; default none).")
flags.DEFINE_string("sweep_contexts", None, "With --sweep: the context splits of the grid "
                    "(default 1,2,4,8).")
flags.DEFINE_string("sweep_remat", None, "With --sweep: the remat policies of the grid "
                    "(default none,full,dots_no_batch).")
flags.DEFINE_enum("score_split", None, ["validation", "test"], "After the last update, score "
                  "this split of the trained run as `python -m transformer.evaluate` does.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0, for clusters that "
                    "jax.distributed cannot detect.")
flags.DEFINE_integer("num_processes", None, "Number of processes (with --coordinator_address).")
flags.DEFINE_integer("process_id", None, "This process's index (with --coordinator_address).")
flags.mark_flags_as_required(["config"])
FLAGS = flags.FLAGS


def _quiet_libraries():
    """Our progress lines at INFO on stderr, with the time. The native libraries' start-up
    chatter off (`cli.quiet_native_logs`)."""
    from transformer.util import cli

    cli.quiet_native_logs(sys.argv)
    cli.show_our_lines(pylogging.INFO, timestamps=True)


def _compile_for_topology(cfg, name: str, num_slices: int, config_file: str,
                          sweep: bool = False, sweep_quantization: str | None = None,
                          sweep_grid: dict | None = None):
    """Compiles the train step for a TPU topology's abstract devices
    (`transformer/sizing/tpu.py`). `sweep_grid`: the `--sweep_*` flags' strings."""
    from transformer.sizing import tpu

    grid = sweep_grid or {}
    try:
        topology = tpu.parse_topology(name, num_slices)
        quantizations = tpu.sweep_quantizations(sweep_quantization)
        grid = {"stages": tpu.sweep_values("sweep_stages", grid.get("stages"), ()),
                "contexts": tpu.sweep_values("sweep_contexts", grid.get("contexts"),
                                             tpu.SWEEP_CONTEXTS),
                "remats": tpu.sweep_values("sweep_remat", grid.get("remats"), tpu.SWEEP_REMAT,
                                           str)}
    except ValueError as error:
        sys.exit(f"error: {error}")
    if not tpu.libtpu_installed():
        sys.exit(f"error: {tpu.LIBTPU_MISSING}")
    tpu.prepare_environment()
    from transformer.config import resolve
    from transformer.util import cli

    with cli.one_line_errors():
        devices = tpu.abstract_devices(topology)
        run = resolve(cfg, len(devices), config_file=config_file, num_slices=num_slices)
        if sweep:
            print(tpu.sweep_report(cfg, topology, devices,
                                   tpu.sweep_points(cfg, len(devices), quantizations,
                                                    num_slices=num_slices, **grid)))
        else:
            print(tpu.compile_report(run, topology, devices))


def _compile_only(cfg, mesh_devices: int | None, config_file: str):
    """Plans memory on `mesh_devices` fake CPU devices (default: the devices present)."""
    if mesh_devices is not None:
        if mesh_devices < 1:
            sys.exit(f"error: --mesh_devices={mesh_devices} must be >= 1")
        if "jax" in sys.modules:
            sys.exit("error: --mesh_devices must set up fake devices before JAX starts, but jax "
                     "was imported already (by the config file?); run without --mesh_devices")
        flags_ = [f for f in os.environ.get("XLA_FLAGS", "").split()
                  if not f.startswith("--xla_force_host_platform_device_count")]
        os.environ["XLA_FLAGS"] = " ".join(
            flags_ + [f"--xla_force_host_platform_device_count={mesh_devices}"])
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from transformer.config import resolve
    from transformer.sizing import report
    from transformer.util import cli

    num_devices = jax.device_count() if mesh_devices is None else mesh_devices
    with cli.one_line_errors():
        print(report.compile_report(resolve(cfg, num_devices, config_file=config_file),
                                    num_devices))


def _check_config_file(path: str) -> None:
    """One line when --config names no file (ml_collections defers that error to first use);
    `path` may end in `:<get_config argument>`."""
    path = path.split(":", 1)[0]
    if not os.path.exists(path):
        sys.exit(f"error: --config={path}: no such file; give a config file, e.g. "
                 f"--config=configs/default.py")
    if not os.path.isfile(path):
        sys.exit(f"error: --config={path} is not a file; give a config file, e.g. "
                 f"--config=configs/default.py")


def _check_workdir(workdir: str) -> None:
    """One line when --workdir cannot be a directory: it, or the nearest existing folder above
    it, is a file."""
    existing = workdir
    while not os.path.exists(existing):
        existing = os.path.dirname(existing) or "."
    if not os.path.isdir(existing):
        sys.exit(f"error: --workdir={workdir}: {existing} is a file, not a directory; give a new "
                 f"directory to train in (or a run's workdir to resume it)")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    config_file = config_flags.get_config_filename(FLAGS["config"])
    _check_config_file(config_file)
    cfg = FLAGS.config
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # JAX's backend probing and orbax's chatter
    if FLAGS.summary:
        from transformer.config import resolve
        from transformer.sizing.summary import summarize
        from transformer.util import cli

        with cli.one_line_errors():
            print(summarize(resolve(cfg, config_file=config_file)))
        return
    for flag in ("sweep_quantization", "sweep_stages", "sweep_contexts", "sweep_remat"):
        if FLAGS[flag].value is not None and not FLAGS.sweep:
            sys.exit(f"error: --{flag} goes with --sweep")
    if FLAGS.topology is not None or FLAGS["num_slices"].present or FLAGS.sweep:
        if not FLAGS.compile_only or FLAGS.mesh_devices is not None or FLAGS.topology is None:
            sys.exit("error: --topology (and --num_slices, --sweep) go with --compile_only, "
                     "without --mesh_devices")
        _compile_for_topology(cfg, FLAGS.topology, FLAGS.num_slices, config_file, FLAGS.sweep,
                              FLAGS.sweep_quantization,
                              {"stages": FLAGS.sweep_stages, "contexts": FLAGS.sweep_contexts,
                               "remats": FLAGS.sweep_remat})
        return
    if FLAGS.compile_only:
        _compile_only(cfg, FLAGS.mesh_devices, config_file)
        return
    if not FLAGS.workdir:
        sys.exit("error: --workdir is required to train (or pass --summary)")
    _check_workdir(FLAGS.workdir)
    _quiet_libraries()
    from transformer.parallel import distributed
    from transformer.training.loop import NonFiniteLoss, train_and_evaluate

    try:
        distributed.initialize(cfg.distributed, coordinator_address=FLAGS.coordinator_address,
                               num_processes=FLAGS.num_processes, process_id=FLAGS.process_id)
        state = train_and_evaluate(cfg, FLAGS.workdir, config_file=config_file,
                                   score_split=FLAGS.score_split)
    except (ValueError, NonFiniteLoss) as error:
        sys.exit(f"error: {error}")
    _draw_confusion(FLAGS.workdir, "test")  # a classifier's loop scored its test split
    if FLAGS.score_split:
        _score(FLAGS.workdir, FLAGS.score_split, state, int(cfg.num_train_steps))


def _score(workdir: str, split: str, state, total: int) -> None:
    """--score_split: the trained run's `split` scored, its line printed as
    `python -m transformer.evaluate` prints it; not after a preemption (training unfinished)."""
    import jax

    from transformer.training import evaluation

    if int(jax.device_get(state.step)) < total:
        logging.warning("training stopped before step %d: %s not scored; rerun to finish", total,
                        split)
        return
    try:
        figures = evaluation.score_trained_run(workdir, split)
    except ValueError as error:
        sys.exit(f"error: {error}")
    if figures is not None:
        if "accuracy" in figures:
            _draw_confusion(workdir, split)
        print(evaluation.scores_line(split, figures), flush=True)


def _draw_confusion(workdir: str, split: str) -> None:
    """Process 0 draws the confusion matrix kept for `split`, where there is one (a
    classifier's: its loop scores the test split, and so does --score_split)."""
    import jax
    from etils import epath

    from transformer.training.evaluation import confusion_files
    from transformer.util import plotting

    record, figure = confusion_files(workdir, split)
    if jax.process_index() == 0 and epath.Path(record).exists():
        plotting.plot_confusion_matrix(record, figure)


def _parse_flags(argv):
    """absl's parsing, with a config file that does not load (a syntax error, no get_config)
    an unknown --config.<key>, and a config argument its get_config rejects as one line too
    (ml_collections raises them while absl parses the flags, before main)."""
    config_arg = next((a for a in argv[1:] if a.startswith("--config=")), "--config")
    try:
        return flags.FLAGS(argv)
    except SyntaxError as error:
        sys.exit(f"error: --config={error.filename} line {error.lineno}: {error.msg}; fix the "
                 f"config file")
    except AttributeError as error:
        text = str(error).replace("\\n", "\n").replace("\\'", "'").replace("'", "").strip('"')
        name, *hint = text.splitlines()
        if name.endswith("has no attribute get_config"):
            sys.exit(f"error: {config_arg} defines no get_config(): a config file "
                     f"returns its ConfigDict from get_config(), as configs/default.py does")
        bad = next((a.split("=")[0] for a in argv[1:] if a.startswith("--config.")
                    and name in a.split("=")[0].split(".")), "a --config.<key> override")
        from configs import holders  # reads every config: only on this error

        where = holders(bad.removeprefix("--config.")) if bad.startswith("--config.") else ""
        hint_text = f"; {hint[0]}" if hint else ""
        where_text = f"; {where}" if where else ""
        sys.exit(f"error: {bad}: the config has no key {name!r}{hint_text}{where_text}")
    except flags.Error as error:  # e.g. get_config(arg) rejected its argument
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        sys.exit(f"error: {re.sub(r'^[A-Za-z]*Error: ', '', lines[-1])}")


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
