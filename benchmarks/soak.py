"""Soak: `train.py` on a small config for many steps while N faults (default 100) land at seeded
random moments, each followed by a restart of the same command. Then every train loss, the set
of metric lines (step, split) and the final parameters are compared with an uninterrupted run.

    python benchmarks/soak.py --faults=100 --out=soak.json          # 24 min on 2 CPU cores
    python benchmarks/soak.py --faults=10 --processes=2 --out=soak2.json  # 2 x 4 devices: 10 min

Faults, in a seeded mix (each kind once, in a shuffled order, before any kind twice):
  sigkill          SIGKILL at a random step (with 2 processes: process 0, 1 or both)
  sigterm          SIGTERM at a random step (preemption: the run saves that step and exits 0)
  kill_in_save     SIGKILL inside an async save, before the rename (TRANSFORMER_FAULT_INJECT=kill@N)
  kill_after_save  SIGKILL just after a checkpoint completes (killafter@N): the moment when metric
                   lines still buffered for a later log step used to be lost for good
  disk_full        the next save fails with ENOSPC (enospc@N): exit status 1, one `error:` line
                   (with 2 processes: process 0's save fails, and both exit 1 at its next save)
  damaged          the latest complete checkpoint's state manifest truncated between two runs: the
                   next run moves it aside and resumes from the one before
With --spikes=K, K loss spikes besides (spike@N: update N's loss and gradient x1e3) at seeded
steps, injected in every run, the uninterrupted reference's too, with optimizer.skip_spikes on:
each spiked update must be skipped in both, and a run resumed before one spikes it again.
Each fault's outcome is checked (exit status, the checkpoint it leaves, the log line it must
print). Anything unexpected is listed under "problems". One summary line is printed and the
whole summary written as JSON (`--out`). The exit status is 0 when every check passed.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
KINDS = ("sigkill", "sigterm", "kill_in_save", "kill_after_save", "disk_full", "damaged")
FAULT_ENV = "TRANSFORMER_FAULT_INJECT"  # transformer/checkpoint/faults.py (not imported: no jax)
SPIKE_WINDOW = 10  # optimizer.spike_window with --spikes: spikes come after it fills
# The runs' config with --spikes: configs/tiny.py with the spike-skipping keys, which it does
# not declare (so --config.optimizer.skip_spikes=True cannot set them).
SPIKE_CONFIG = f"""from configs.tiny import get_config as tiny


def get_config():
    cfg = tiny()
    cfg.optimizer.skip_spikes = True
    cfg.optimizer.spike_window = {SPIKE_WINDOW}
    cfg.optimizer.spike_threshold = 6.0
    cfg.optimizer.max_skipped_in_a_row = 10
    return cfg
"""


class Soak:
    """Runs of one `train.py` command in one workdir, and what they logged."""

    def __init__(self, workdir: pathlib.Path, *, steps: int, checkpoint_every: int,
                 log_every: int, eval_every: int, processes: int, devices: int,
                 heartbeat: int, config: tuple[str, ...] = (), spiked: tuple[int, ...] = ()):
        self.workdir, self.processes, self.devices = workdir, processes, devices
        self.checkpoint_every, self.runs, self.seconds = checkpoint_every, 0, 0.0
        self.spikes = f"spike@{','.join(map(str, spiked))}" if spiked else ""
        config_file = "configs/tiny.py"
        if spiked:
            config_file = workdir.parent / "spike_config.py"
            config_file.write_text(SPIKE_CONFIG)
        self.flags = [f"--config={config_file}", f"--config.num_train_steps={steps}",
                      f"--config.log_every_steps={log_every}",
                      f"--config.eval_every_steps={eval_every}",
                      f"--config.checkpoint_every_steps={checkpoint_every}",
                      "--config.keep_checkpoints=3", "--config.data.batch_size=16",
                      "--config.data.eval_examples=32",
                      f"--config.distributed.heartbeat_timeout_seconds={heartbeat}",
                      *(f"--config.{setting}" for setting in config)]

    def start(self, fault: str | None = None) -> list[subprocess.Popen]:
        """The command, once per process (output to `<workdir>.run<n>.p<i>.log`)."""
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={self.devices}")
        env.pop(FAULT_ENV, None)
        if fault or self.spikes:  # the spikes in every run, with the process fault if any
            env[FAULT_ENV] = ";".join(f for f in (self.spikes, fault) if f)
        command = [sys.executable, "train.py", f"--workdir={self.workdir}", *self.flags]
        if self.processes > 1:
            # No persistent compilation cache with several processes
            # (tests/training/test_multihost.py).
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
            command += [f"--coordinator_address=127.0.0.1:{free_port()}",
                        f"--num_processes={self.processes}"]
        else:
            env.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".cache" / "jax"))
            env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
        self.runs += 1
        procs = []
        for i in range(self.processes):
            log = open(f"{self.workdir}.run{self.runs}.p{i}.log", "w")
            extra = [f"--process_id={i}"] if self.processes > 1 else []
            procs.append(subprocess.Popen(command + extra, cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
            procs[-1].log = pathlib.Path(log.name)
            procs[-1].started = time.monotonic()
        return procs

    def wait(self, procs, timeout: float = 900) -> list[int]:
        """Exit statuses. A process still running after `timeout` s is killed (status None)."""
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, p.started + timeout - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes.append(None)
        self.seconds += time.monotonic() - min(p.started for p in procs)
        return codes

    def lines(self) -> list[dict]:
        """metrics.jsonl (a last line still being written is left out)."""
        path = self.workdir / "metrics.jsonl"
        found = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return found

    def logged_step(self) -> int:
        return max((r["step"] for r in self.lines() if r["split"] == "train"), default=0)

    def checkpoints(self) -> list[int]:
        directory = self.workdir / "checkpoints"
        return sorted(int(p.name) for p in directory.iterdir()
                      if p.name.isdigit()) if directory.is_dir() else []

    def wait_for_step(self, procs, step: int, timeout: float = 900) -> bool:
        """Waits until train step `step` is logged; False if a process ended first."""
        deadline = time.monotonic() + timeout
        while self.logged_step() < step:
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def schedule(faults: int, rng: random.Random) -> list[str]:
    """`faults` kinds: shuffled rounds of all kinds, so every kind comes once before any twice."""
    kinds = []
    while len(kinds) < faults:
        round_ = list(KINDS)
        rng.shuffle(round_)
        kinds += round_
    return kinds[:faults]


class Faults:
    """Delivers faults to a Soak and checks each outcome."""

    def __init__(self, soak: Soak, rng: random.Random, total: int):
        self.soak, self.rng, self.total = soak, rng, total
        self.problems: list[str] = []
        self.expect_next: list[str] = []  # log lines the next run must print
        self.delivered: list[dict] = []
        self.damaged_step: int | None = None  # damaged, not yet met by a run

    def check_log(self, procs) -> None:
        text = procs[0].log.read_text()
        for line in self.expect_next:
            if line not in text:
                self.problems.append(f"run {self.soak.runs}: expected {line!r} in {procs[0].log}")
        self.expect_next, self.damaged_step = [], None
        if "Traceback" in text:
            self.problems.append(f"run {self.soak.runs}: a traceback in {procs[0].log}")

    def resume_step(self) -> int:
        """The checkpoint the next run resumes from (0: none)."""
        steps = [s for s in self.soak.checkpoints() if s != self.damaged_step]
        return max(steps, default=0)

    def expect_resume(self) -> None:
        if self.resume_step() and self.damaged_step is None:
            self.expect_next.append(f"resuming from {self.soak.workdir / 'checkpoints'}/"
                                    f"{self.resume_step()}\n")

    def next_save(self) -> int:
        every = self.soak.checkpoint_every
        return min((self.resume_step() // every + 1) * every, self.total)

    def ready(self, kind: str) -> bool:
        """Whether `kind` can be delivered now (a damaged checkpoint needs one to fall back
        on, and no other damage pending)."""
        return kind != "damaged" or (len(self.soak.checkpoints()) >= 2
                                     and self.damaged_step is None)

    def deliver(self, kind: str) -> bool:
        """One fault and its restart (or, for `damaged`, the damage the next run meets).
        False when too few steps are left for it."""
        done = self.soak.logged_step()
        if done >= self.total - 3:
            return False
        record = {"kind": kind, "run": self.soak.runs + 1, "logged_step_before": done}
        getattr(self, kind)(record, done)
        self.delivered.append(record)
        return True

    def _victims(self) -> list[int]:
        return self.rng.choice([[0], [1], [0, 1]]) if self.soak.processes > 1 else [0]

    def _signal_at_random_step(self, record, done, sig) -> tuple[list, list, int]:
        target = min(self.rng.randint(done + 1, done + self.soak.checkpoint_every + 2),
                     self.total - 3)
        self.expect_resume()
        procs = self.soak.start()
        reached = self.soak.wait_for_step(procs, target)
        victims = self._victims()
        for i in victims:
            procs[i].send_signal(sig)
        codes = self.soak.wait(procs, timeout=900)
        record.update(target=target, victims=victims, exit=codes,
                      logged_step=self.soak.logged_step())
        if not reached:
            self.problems.append(f"run {self.soak.runs}: ended before step {target}: {codes}")
        self.check_log(procs)
        return procs, codes, target

    def sigkill(self, record, done) -> None:
        _, codes, _ = self._signal_at_random_step(record, done, signal.SIGKILL)
        for i, code in enumerate(codes):
            if code is None or code == 0:  # killed, or stopped by its peer's death
                self.problems.append(f"run {self.soak.runs}: process {i} exit {code}")

    def sigterm(self, record, done) -> None:
        _, codes, _ = self._signal_at_random_step(record, done, signal.SIGTERM)
        if any(code != 0 for code in codes):
            self.problems.append(f"run {self.soak.runs}: SIGTERM exit statuses {codes}")
        elif self.soak.checkpoints()[-1:] != [record["logged_step"]]:
            self.problems.append(f"run {self.soak.runs}: SIGTERM at step "
                                 f"{record['logged_step']} saved {self.soak.checkpoints()}")

    def _save_fault(self, record, fault: str) -> tuple[list, list, int]:
        doomed = self.next_save()
        self.expect_resume()
        procs = self.soak.start(fault=f"{fault}@{doomed}")
        codes = self.soak.wait(procs)
        record.update(save_step=doomed, exit=codes, logged_step=self.soak.logged_step())
        self.check_log(procs)
        return procs, codes, doomed

    def kill_in_save(self, record, done) -> None:
        _, codes, doomed = self._save_fault(record, "kill")
        if -signal.SIGKILL not in codes or doomed in self.soak.checkpoints():
            self.problems.append(f"run {self.soak.runs}: kill@{doomed}: exit {codes}, "
                                 f"checkpoints {self.soak.checkpoints()}")

    def kill_after_save(self, record, done) -> None:
        _, codes, doomed = self._save_fault(record, "killafter")
        if -signal.SIGKILL not in codes or doomed not in self.soak.checkpoints():
            self.problems.append(f"run {self.soak.runs}: killafter@{doomed}: exit {codes}, "
                                 f"checkpoints {self.soak.checkpoints()}")

    def disk_full(self, record, done) -> None:
        procs, codes, doomed = self._save_fault(record, "enospc")
        intact = max(self.soak.checkpoints(), default=None)
        want = (f"error: disk full while saving checkpoint {doomed} in "
                f"{self.soak.workdir / 'checkpoints'}; free space (or use another --workdir) "
                f"and rerun to resume: "
                + (f"checkpoint {intact} is intact" if intact else "no checkpoint was saved"))
        if set(codes) != {1} or want not in procs[0].log.read_text():
            self.problems.append(f"run {self.soak.runs}: enospc@{doomed}: exit {codes}, "
                                 f"no line {want!r}")

    def damaged(self, record, done) -> None:
        steps = self.soak.checkpoints()
        latest = self.soak.workdir / "checkpoints" / str(steps[-1])
        manifest = latest / "state" / "manifest.ocdbt"
        manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
        record["damaged_step"] = self.damaged_step = steps[-1]
        self.expect_next += [f"checkpoint {steps[-1]} does not restore (",
                             f"resuming from {self.soak.workdir / 'checkpoints'}/{steps[-2]}\n"]


def spike_steps(spikes: int, total: int, rng: random.Random) -> tuple[int, ...]:
    """`spikes` distinct updates to spike, after the window fills and before the last 3."""
    first, last = SPIKE_WINDOW + 2, total - 3
    if spikes > last - first + 1:
        raise app.UsageError(f"--spikes={spikes}: at most {max(0, last - first + 1)} fit in "
                             f"{total} steps (from step {first} to {last}); raise --steps")
    return tuple(sorted(rng.sample(range(first, last + 1), spikes)))


def skipped_spikes(lines: list[dict], spiked: tuple[int, ...]) -> dict:
    """Whether every spiked update's last train line says it was skipped, and the steps
    skipped that were not spiked (judged spikes of the run's own)."""
    skipped = {r["step"]: bool(r.get("spike_skipped")) for r in lines if r["split"] == "train"}
    return {"spikes_skipped": all(skipped.get(s) for s in spiked),
            "spikes_not_skipped": [s for s in spiked if not skipped.get(s)],
            "other_steps_skipped": sorted(s for s, x in skipped.items()
                                          if x and s not in spiked)}


def compare(reference: list[dict], faulted: list[dict]) -> dict:
    """Every train loss of `faulted` (steps redone included) against the reference's, the
    sets of (step, split), and the last line per (step, split) field by field (timings
    aside)."""
    want = {(r["step"], r["split"]): r for r in reference}
    last = {(r["step"], r["split"]): r for r in faulted}
    timing = ("tokens_per_sec", "steps_per_sec", "data_wait_fraction", "mfu")
    differing = sorted(key for key, r in last.items() if key in want and any(
        r[k] != want[key].get(k) for k in r if k not in timing and not k.startswith("goodput")))
    losses = [(r["step"], r["loss"]) for r in faulted if r["split"] == "train"]
    wrong = sorted({s for s, loss in losses if loss != want.get((s, "train"), {}).get("loss")})
    counts = collections.Counter(s for s, _ in losses)
    return {"metric_steps_equal": set(last) == set(want),
            "missing_lines": sorted(set(want) - set(last))[:20],
            "extra_lines": sorted(set(last) - set(want))[:20],
            "every_train_loss_equal": not wrong and not differing,
            "differing_steps": (wrong or [k[0] for k in differing])[:20],
            "train_lines": len(losses), "steps_recomputed": sum(c - 1 for c in counts.values())}


def params_identical(a: pathlib.Path, b: pathlib.Path) -> bool:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no probing for accelerators (libtpu's logs)
    import jax
    import numpy as np

    from transformer.checkpoint import averaging

    got = averaging.load_params(str(a))
    want = averaging.load_params(str(b))
    return jax.tree.structure(got) == jax.tree.structure(want) and all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                                             strict=True))


def progress(faults: Faults, total: int, started: float) -> None:
    """One line per fault delivered: what, where, elapsed time and ETA, problems so far."""
    done = len(faults.delivered)
    last = faults.delivered[-1]
    step = last.get("logged_step", last["logged_step_before"])
    elapsed = time.monotonic() - started
    print(f"[{done}/{total}] {last['kind']} (run {last['run']}, step {step}/"
          f"{faults.total}): {elapsed / 60:.1f} min, ETA {elapsed / done * (total - done) / 60:.0f}"
          f" min, {len(faults.problems)} problems", file=sys.stderr, flush=True)


def _known_kinds(kinds: list[str] | None) -> bool:
    if unknown := sorted(set(kinds or ()) - set(KINDS)):
        raise flags.ValidationError(f"unknown {', '.join(unknown)}; --kinds is a subset of "
                                    f"{','.join(KINDS)}")
    return True


def define_flags() -> None:
    """The command line's flags: defined only when run as a script."""
    flags.DEFINE_integer("faults", 100, "Faults to inject.", lower_bound=0)
    flags.DEFINE_integer("seed", 0, "Seed of the faults' kinds and moments.")
    flags.DEFINE_list("kinds", None, f"A subset of {', '.join(KINDS)} (default: all).")
    flags.register_validator("kinds", _known_kinds)
    flags.DEFINE_integer("spikes", 0, "Loss spikes (spike@N) besides the faults, at seeded "
                         "steps, in every run (the reference's too) with optimizer.skip_spikes "
                         "on.", lower_bound=0)
    flags.DEFINE_integer("steps", None, "Train steps (default: 5 per fault + 20).")
    flags.DEFINE_integer("checkpoint_every", 5, "checkpoint_every_steps of the runs.",
                         lower_bound=1)
    flags.DEFINE_integer("log_every", 2, "Steps between log flushes (2: lines are buffered at "
                         "saves).", lower_bound=1)
    flags.DEFINE_integer("eval_every", 10, "eval_every_steps of the runs.", lower_bound=1)
    flags.DEFINE_integer("processes", 1, "Training processes (1 or 2).", lower_bound=1,
                         upper_bound=2)
    flags.DEFINE_integer("heartbeat", 5, "distributed.heartbeat_timeout_seconds with 2 "
                         "processes.")
    flags.DEFINE_multi_string("config", [], "KEY=VALUE: another --config.KEY=VALUE for every "
                              "train.py run, after the soak's own (repeatable; the tests shrink "
                              "the model with it).")
    flags.DEFINE_string("workdir", None, "Default: a new temporary directory.")
    flags.DEFINE_string("out", "soak.json", "Where the summary (JSON) goes.")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    args = flags.FLAGS
    kinds = args.kinds or list(KINDS)
    total = args.steps or 5 * args.faults + 20
    base = pathlib.Path(args.workdir or f"/tmp/soak-{os.getpid()}")
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    common = dict(steps=total, checkpoint_every=args.checkpoint_every, log_every=args.log_every,
                  eval_every=args.eval_every, processes=args.processes,
                  devices=4 if args.processes > 1 else 2, heartbeat=args.heartbeat,
                  config=tuple(args.config),
                  spiked=spike_steps(args.spikes, total, random.Random(f"spikes {args.seed}")))

    reference = Soak(base / "reference", **common)
    codes = reference.wait(reference.start())
    if codes != [0] * args.processes:
        sys.exit(f"the uninterrupted run failed ({codes}): see {base}/reference.run1.p0.log")

    soak = Soak(base / "faulted", **common)
    started = time.monotonic()
    rng = random.Random(args.seed)
    faults = Faults(soak, rng, total)
    queue = collections.deque(
        [k for k in schedule(args.faults * len(KINDS), rng) if k in kinds][:args.faults])
    while queue:
        kind = queue.popleft()
        if not faults.ready(kind):  # later (a plain fault first, if there is one)
            if all(k == kind for k in queue):
                queue.appendleft("sigkill")
            queue.insert(1, kind)
            continue
        if not faults.deliver(kind):
            faults.problems.append(f"ran out of steps after {len(faults.delivered)} faults: "
                                   f"raise --steps")
            break
        progress(faults, args.faults, started)
    faults.expect_resume()
    procs = soak.start()
    final = soak.wait(procs)
    faults.check_log(procs)
    if final != [0] * args.processes:
        faults.problems.append(f"the final run exited {final}")

    figures = compare(reference.lines(), soak.lines())
    identical = params_identical(base / "faulted", base / "reference")
    delivered = collections.Counter(f["kind"] for f in faults.delivered)
    spikes = {}
    if common["spiked"]:
        delivered["spike"] = len(common["spiked"])
        spikes = {"spiked_steps": list(common["spiked"]),
                  "reference": skipped_spikes(reference.lines(), common["spiked"]),
                  "faulted": skipped_spikes(soak.lines(), common["spiked"])}
        for run in ("reference", "faulted"):
            if not spikes[run]["spikes_skipped"]:
                faults.problems.append(f"{run}: spiked steps {spikes[run]['spikes_not_skipped']}"
                                       f" were not skipped")
    summary = {
        "faults": sum(delivered.values()), "faults_by_kind": dict(sorted(delivered.items())),
        "processes": args.processes, "devices_per_process": common["devices"],
        "steps": total, "seed": args.seed, "config": args.config, "restarts": soak.runs - 1,
        "steps_recomputed": figures.pop("steps_recomputed"),
        "reference_seconds": round(reference.seconds, 1),
        "faulted_seconds": round(soak.seconds, 1),
        "seconds_lost_per_fault": round((soak.seconds - reference.seconds)
                                        / max(1, sum(delivered.values())), 1),
        "final_params_bit_identical": identical, **figures, **spikes,
        "problems": faults.problems, "fault_log": faults.delivered, "workdir": str(base),
    }
    summary["ok"] = bool(identical and figures["metric_steps_equal"]
                         and figures["every_train_loss_equal"] and not faults.problems)
    pathlib.Path(args.out).write_text(json.dumps(summary, indent=1))
    print(f"soak: {summary['faults']} faults "
          f"({', '.join(f'{k} {n}' for k, n in summary['faults_by_kind'].items())}), "
          f"{summary['restarts']} restarts, {summary['steps_recomputed']} steps recomputed, "
          f"{summary['seconds_lost_per_fault']} s lost per fault, final params "
          f"{'bit-identical' if identical else 'DIFFERENT'}, metric lines "
          f"{'all there' if figures['metric_steps_equal'] else 'MISSING'}, train losses "
          f"{'equal' if figures['every_train_loss_equal'] else 'DIFFERENT'}, "
          f"{len(faults.problems)} problems; {args.out}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    define_flags()
    app.run(main)
