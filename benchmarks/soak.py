"""Soak: `train.py` on a small config for many steps while N faults (default 100) land at seeded
random moments, each followed by a restart of the same command. Then every train loss, the set
of metric lines (step, split) and the final parameters are compared with an uninterrupted run.

    python benchmarks/soak.py --faults=100 --spikes=10 --out=soak.json   # 1 process x 2 devices
    python benchmarks/soak.py --faults=16 --processes=2 --out=soak2.json  # 2 x 4 devices

The runs train `configs/tiny.py` unless `--config_file` names another, which `--config`
settings shrink (`make train`'s default: docs/reliability.md, "Soak").

Faults, in a seeded mix (each kind once, in a shuffled order, before any kind twice):
  sigkill          SIGKILL at a random step (with 2 processes: process 0, 1 or both)
  sigterm          SIGTERM at a random step (preemption: the run saves that step and exits 0)
  kill_in_save     SIGKILL inside an async save, before the rename (TRANSFORMER_FAULT_INJECT=kill@N)
  kill_after_save  SIGKILL just after a checkpoint completes (killafter@N): the moment when metric
                   lines still buffered for a later log step used to be lost for good
  disk_full        the next save fails with ENOSPC (enospc@N): exit status 1, one `error:` line
                   (with 2 processes: process 0's save fails, and both exit 1 at its next save)
  damaged          the newest checkpoint of either tier has its state manifest truncated between
                   two runs: the next run moves it aside and resumes from the one before
  local_tier_lost  the runs keep a local tier (checkpoint_local_dir=<workdir>.local, a step every
                   --local_every=2, persistent every 5): SIGKILL once it holds a step newer than
                   the persistent tier's, then the local tier is deleted (a host replaced, a RAM
                   disk gone): the restart resumes from the persistent tier's newest step
  process_lost     (--processes=2 only) SIGKILL to one process (its peer stops within the
                   heartbeat timeout) and a restart on the process left, with its 4 devices
                   (elastic=True: mesh.data 8 -> 4, 2 microbatches for the same global batch);
                   the run after that is on 2 processes again. The runs then have no dropout
                   (its masks are drawn per microbatch). A 1-process soak has no process to
                   lose: the kind is left out of its default mix and refused in its --kinds.
Every run resumes from the newest step of either tier, and the soak checks which (its
`resuming from <tier>/<step>` line). With --spikes=K, K loss spikes besides (spike@N: update
N's loss and gradient x1e3) at seeded steps, injected in every run, the uninterrupted
reference's too, with optimizer.skip_spikes on: each spiked update must be skipped in both,
and a run resumed before one spikes it again.
Each fault's outcome is checked (exit status, the checkpoint it leaves, the log line it must
print). Anything unexpected is listed under "problems". One summary line is printed and the
whole summary written as JSON (`--out`, also after each fault with "finished": false). The
exit status is 0 when every check passed.

Equality: without process_lost every train loss (each step redone included), every metric
figure and the final parameters are the uninterrupted run's bit for bit. A run on fewer devices
sums the same examples in another order, so the lines of steps after the lowest step such a run
resumed from are compared within ELASTIC_LOSS_RTOL (relative) and ELASTIC_ABS, those before it
exactly, and the final parameters within 2 x the sum of the learning rates of those steps (the
derivations are beside the constants).
"""

from __future__ import annotations

import collections
import json
import math
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

from absl import app, flags, logging

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
KINDS = ("sigkill", "sigterm", "kill_in_save", "kill_after_save", "disk_full", "damaged",
         "local_tier_lost", "process_lost")
MULTIPROCESS_KINDS = ("process_lost",)  # a 1-process soak has no process to lose
# How the survivor of a killed peer stops (tests/training/test_multihost.py, DEAD_PEER_MESSAGE).
DEAD_PEER = "Terminating process because the JAX distributed service detected fatal errors"
LOCAL_EVERY = 2  # checkpoint_local_every_steps with local_tier_lost (persistent: every 5)
# Losses of steps computed after a restart on fewer devices, against the uninterrupted run's: the
# same examples summed in another order. Float32 rounding (unit u = 2**-24 = 6e-8) of a sum of n
# terms moves it by at most ~(n-1)*u relative, ~2.4e-5 for the ~400 target tokens of a batch of
# 16, and typically sqrt(n)*u ~ 1e-6; once the first update differs in its last bits, Adam (eps
# 1e-9) can turn a rounding difference on a parameter whose gradient is ~0 into a step of up to
# +-lr there, so the parameters, and the losses after them, drift apart slowly with the steps
# (measured < 1e-4 over 20 steps: tests/training/test_multihost.py, test_elastic.py).
ELASTIC_LOSS_RTOL = 1e-4
ELASTIC_ABS = 1e-6  # figures near 0 (a norm of a few parameters): absolute slack as well
# Figures that follow single parameters rather than sums over them: a layer's update norm (Adam's
# +-lr steps above, on the update itself) and the attention logits' largest value (a maximum
# over entries that the drifting parameters move): measured up to 3.1e-4 and 2.4e-3 relative
# in a 2-process soak (docs/results/2026-12-05-soak-mixed.md), against < 1e-6 for the losses,
# gradient, parameter norms and activation RMS; they get 1e-2.
ELASTIC_FIGURE_RTOL = 1e-2
PARAMETER_FIGURES = ("update_norm/", "attention_logit_max/")
# The final parameters after such steps: Adam's update of a parameter is at most ~lr in size
# (|m_hat| <= sqrt(v_hat) for consistent gradients), so two runs whose gradients differ only in
# rounding differ by at most 2 * lr_t per step computed in another order, summed over those
# steps (the learning rates logged): a bound, not a typical figure (the RMS difference is
# reported beside it).
FAULT_ENV = "TRANSFORMER_FAULT_INJECT"  # transformer/checkpoint/faults.py (not imported: no jax)
SPIKE_WINDOW = 10  # optimizer.spike_window with --spikes: spikes come after it fills
TINY = "configs/tiny.py"  # the soak's config unless --config_file names another
# The runs' config with --spikes: the config file's with the spike-skipping keys, which tiny.py
# does not declare (so --config.optimizer.skip_spikes=True cannot set them).
SPIKE_CONFIG = f"""from configs.{{module}} import get_config as base


def get_config():
    cfg = base()
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
                 heartbeat: int, config: tuple[str, ...] = (), spiked: tuple[int, ...] = (),
                 local_every: int = 0, elastic: bool = False, config_file: str = TINY):
        self.workdir, self.processes, self.devices = workdir, processes, devices
        self.local = pathlib.Path(f"{workdir}.local")  # the local tier (one host: shared)
        self.checkpoint_every, self.runs, self.seconds = checkpoint_every, 0, 0.0
        self.spikes = f"spike@{','.join(map(str, spiked))}" if spiked else ""
        tiny = config_file == TINY
        if spiked:
            module = pathlib.Path(config_file).stem
            config_file = workdir.parent / "spike_config.py"
            config_file.write_text(SPIKE_CONFIG.format(module=module))
        self.flags = [f"--config={config_file}", f"--config.num_train_steps={steps}",
                      f"--config.log_every_steps={log_every}",
                      f"--config.eval_every_steps={eval_every}",
                      f"--config.checkpoint_every_steps={checkpoint_every}",
                      "--config.keep_checkpoints=3",
                      f"--config.distributed.heartbeat_timeout_seconds={heartbeat}"]
        if tiny:  # another config is shrunk by --config settings
            self.flags += ["--config.data.batch_size=16", "--config.data.eval_examples=32"]
        if local_every:
            self.flags += [f"--config.checkpoint_local_dir={self.local}",
                           f"--config.checkpoint_local_every_steps={local_every}",
                           "--config.keep_local_checkpoints=2"]
        if elastic:  # a restart on fewer processes keeps the global batch by accumulation;
            # no dropout: its masks are drawn per microbatch, so other ones once they change
            self.flags += ["--config.elastic=True", "--config.model.dropout_rate=0.0"]
        self.flags += [f"--config.{setting}" for setting in config]

    def start(self, fault: str | None = None,
              processes: int | None = None) -> list[subprocess.Popen]:
        """The command, once per process (output to `<workdir>.run<n>.p<i>.log`); `processes`
        fewer than the soak's: a restart on fewer processes (each with as many devices)."""
        processes = processes or self.processes
        kept = [f for f in os.environ.get("XLA_FLAGS", "").split()  # the tests' fast compile
                if not f.startswith("--xla_force_host_platform_device_count")]
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(
            [*kept, f"--xla_force_host_platform_device_count={self.devices}"]))
        env.pop(FAULT_ENV, None)
        if fault or self.spikes:  # the spikes in every run, with the process fault if any
            env[FAULT_ENV] = ";".join(f for f in (self.spikes, fault) if f)
        command = [sys.executable, "train.py", f"--workdir={self.workdir}", *self.flags]
        if processes > 1:
            # No persistent compilation cache with several processes
            # (tests/training/test_multihost.py).
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
            command += [f"--coordinator_address=127.0.0.1:{free_port()}",
                        f"--num_processes={processes}"]
        else:
            env.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".cache" / "jax"))
            env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
        self.runs += 1
        procs = []
        for i in range(processes):
            log = open(f"{self.workdir}.run{self.runs}.p{i}.log", "w")
            extra = [f"--process_id={i}"] if processes > 1 else []
            procs.append(subprocess.Popen(command + extra, cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
            procs[-1].log = pathlib.Path(log.name)
            procs[-1].started = time.monotonic()
        return procs

    def wait(self, procs, timeout: float = 3600) -> list[int]:
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

    def checkpoints(self, directory: pathlib.Path | None = None) -> list[int]:
        """The persistent tier's steps (or those of `directory`: the local tier's)."""
        directory = directory or self.workdir / "checkpoints"
        return sorted(int(p.name) for p in directory.iterdir()
                      if p.name.isdigit()) if directory.is_dir() else []

    def local_checkpoints(self) -> list[int]:
        return self.checkpoints(self.local)

    def wait_for_step(self, procs, step: int, timeout: float = 3600) -> bool:
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


def schedule(faults: int, rng: random.Random, kinds=KINDS) -> list[str]:
    """`faults` of `kinds`: shuffled rounds of them, so every kind comes once before any twice."""
    scheduled = []
    while len(scheduled) < faults:
        round_ = list(kinds)
        rng.shuffle(round_)
        scheduled += round_
    return scheduled[:faults]


class Faults:
    """Delivers faults to a Soak and checks each outcome."""

    def __init__(self, soak: Soak, rng: random.Random, total: int):
        self.soak, self.rng, self.total = soak, rng, total
        self.problems: list[str] = []
        self.expect_next: list[str] = []  # log lines the next run must print
        self.delivered: list[dict] = []
        self.damaged_step: int | None = None  # damaged, not yet met by a run
        self.processes_next = soak.processes  # the next run's (one fewer after process_lost)
        self.fewer_from: int | None = None  # the lowest step a run on fewer processes resumed
        self.resumed = 0  # the step the latest run resumed from

    def start(self, fault: str | None = None) -> list[subprocess.Popen]:
        """The next run, on the processes it has, with the lines it must print."""
        processes, self.processes_next = self.processes_next, self.soak.processes
        self.expect_resume()
        self.resumed = self.resume_step()
        if processes < self.soak.processes:
            step = self.resume_step()
            self.fewer_from = step if self.fewer_from is None else min(self.fewer_from, step)
            self.expect_next.append(f"elastic: {processes * self.soak.devices} devices "
                                    f"(recorded: {self.soak.processes * self.soak.devices}): ")
        return self.soak.start(fault, processes)

    def check_log(self, procs, record: dict | None = None, victims=()) -> None:
        """The lines the run had to print, and no traceback: but where process 0 outlived a
        killed peer, its collective's error as a traceback before the coordination service's
        abort (DEAD_PEER) is how it stops (train.py prints other errors than ValueError so);
        recorded as `survivor_error`, not a problem."""
        text = procs[0].log.read_text()
        for line in self.expect_next:
            if line not in text:
                self.problems.append(f"run {self.soak.runs}: expected {line!r} in {procs[0].log}")
        self.expect_next, self.damaged_step = [], None
        if "Traceback" not in text:
            return
        if victims and 0 not in victims and DEAD_PEER in text and record is not None:
            errors = [line for line in text.splitlines() if line.startswith("jax.errors.")]
            record["survivor_error"] = (errors or ["(none)"])[0][:300]
        else:
            self.problems.append(f"run {self.soak.runs}: a traceback in {procs[0].log}")

    def tier_steps(self) -> dict[int, pathlib.Path]:
        """{step: its tier's directory} over both tiers (a step in both: the persistent one),
        the damaged step not yet met left out."""
        steps = {s: self.soak.local for s in self.soak.local_checkpoints()}
        steps |= {s: self.soak.workdir / "checkpoints" for s in self.soak.checkpoints()}
        steps.pop(self.damaged_step, None)
        return steps

    def resume_step(self) -> int:
        """The checkpoint the next run resumes from (0: none): the newest of both tiers."""
        return max(self.tier_steps(), default=0)

    def expect_resume(self) -> None:
        steps = self.tier_steps()
        if steps and self.damaged_step is None:
            step = max(steps)
            self.expect_next.append(f"resuming from {steps[step]}/{step}\n")

    def next_save(self) -> int:
        every = self.soak.checkpoint_every
        return min((self.resume_step() // every + 1) * every, self.total)

    def ready(self, kind: str) -> bool:
        """Whether `kind` can be delivered now (a damaged checkpoint needs one to fall back
        on, and no other damage pending; a process is lost from a run on all of them)."""
        if kind == "damaged":
            return len(self.tier_steps()) >= 2 and self.damaged_step is None
        if kind == "process_lost":
            return self.processes_next == self.soak.processes > 1
        return True

    def deliver(self, kind: str) -> bool:
        """One fault and its restart (or, for `damaged`, the damage the next run meets).
        False when too few steps are left for it."""
        done = self.soak.logged_step()
        if done >= self.total - 3:
            return False
        record = {"kind": kind, "run": self.soak.runs + 1, "logged_step_before": done,
                  "processes": self.processes_next}
        getattr(self, kind)(record, done)
        self.delivered.append(record)
        return True

    def _victims(self, procs) -> list[int]:
        return self.rng.choice([[0], [1], [0, 1]]) if len(procs) > 1 else [0]

    def _signal_at_random_step(self, record, done, sig, victims=None) -> tuple[list, list, int]:
        target = min(self.rng.randint(done + 1, done + self.soak.checkpoint_every + 2),
                     self.total - 3)
        procs = self.start()
        reached = self.soak.wait_for_step(procs, target)
        victims = victims or self._victims(procs)
        for i in victims:
            procs[i].send_signal(sig)
        codes = self.soak.wait(procs)
        record.update(target=target, victims=victims, exit=codes,
                      logged_step=self.soak.logged_step())
        if not reached:
            self.problems.append(f"run {self.soak.runs}: ended before step {target}: {codes}")
        self.check_log(procs, record, victims if len(procs) > 1 else ())
        return procs, codes, target

    def _all_stopped(self, codes) -> None:
        for i, code in enumerate(codes):
            if code is None or code == 0:  # killed, or stopped by its peer's death
                self.problems.append(f"run {self.soak.runs}: process {i} exit {code}")

    def sigkill(self, record, done) -> None:
        _, codes, _ = self._signal_at_random_step(record, done, signal.SIGKILL)
        self._all_stopped(codes)

    def sigterm(self, record, done) -> None:
        _, codes, _ = self._signal_at_random_step(record, done, signal.SIGTERM)
        if any(code != 0 for code in codes):
            self.problems.append(f"run {self.soak.runs}: SIGTERM exit statuses {codes}")
        elif self.soak.checkpoints()[-1:] != [record["logged_step"]]:
            self.problems.append(f"run {self.soak.runs}: SIGTERM at step "
                                 f"{record['logged_step']} saved {self.soak.checkpoints()}")

    def _save_fault(self, record, fault: str) -> tuple[list, list, int]:
        doomed = self.next_save()
        procs = self.start(fault=f"{fault}@{doomed}")
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
        """The newest step of either tier (the one the next run meets first) damaged."""
        steps = self.tier_steps()
        newest, before = sorted(steps)[-1], sorted(steps)[-2]
        manifest = steps[newest] / str(newest) / "state" / "manifest.ocdbt"
        manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
        record.update(damaged_step=newest, tier="local" if steps[newest] == self.soak.local
                      else "persistent")
        self.damaged_step = newest
        self.expect_next += [f"checkpoint {newest} does not restore (",
                             f"resuming from {steps[before]}/{before}\n"]

    def local_tier_lost(self, record, done) -> None:
        """SIGKILL once the local tier holds a step newer than the persistent tier's and than
        the run's resume step (and a damaged step it meets), then the local tier wiped (a
        host replaced, a RAM disk gone): the restart resumes from the persistent tier's
        newest step."""
        procs = self.start()
        resumed, deadline = self.resumed, time.monotonic() + 3600

        def newer() -> list[int]:  # (beyond a damaged step too: the run must meet it first)
            floor = max([resumed, self.damaged_step or 0, *self.soak.checkpoints()])
            return [s for s in self.soak.local_checkpoints() if s > floor]

        while not newer() and all(p.poll() is None for p in procs) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        victims = self._victims(procs)
        for i in victims:
            procs[i].send_signal(signal.SIGKILL)
        codes = self.soak.wait(procs)
        lost = newer()
        shutil.rmtree(self.soak.local, ignore_errors=True)
        record.update(victims=victims, exit=codes, logged_step=self.soak.logged_step(),
                      local_steps_lost=lost, persistent_newest=max(self.soak.checkpoints(),
                                                                   default=0))
        if not lost:
            self.problems.append(f"run {self.soak.runs}: no local step newer than the "
                                 f"persistent tier's before the kill: exit {codes}")
        self.check_log(procs, record, victims if len(procs) > 1 else ())
        self._all_stopped(codes)

    def process_lost(self, record, done) -> None:
        """SIGKILL to one process of two (its peer stops within the heartbeat timeout); the
        restart runs on the process left, with its devices (half the run's), and elastic keeps
        the global batch by accumulating twice the microbatches; the run after that is on two
        processes again (the host replaced)."""
        _, codes, _ = self._signal_at_random_step(record, done, signal.SIGKILL,
                                                  victims=[self.rng.choice([0, 1])])
        self._all_stopped(codes)
        self.processes_next = self.soak.processes - 1


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


TIMING = ("tokens_per_sec", "steps_per_sec", "data_wait_fraction", "mfu")


def _timing(key: str) -> bool:
    return key in TIMING or key.startswith("goodput") or key.endswith("_seconds")


def _same(got, want, inexact: bool, key: str = "loss") -> bool:
    """Equal; or, for figure `key` of a step computed after a restart on fewer devices, within
    the reduction-order tolerance (ELASTIC_LOSS_RTOL or ELASTIC_FIGURE_RTOL, ELASTIC_ABS)."""
    if got == want:
        return True
    numbers = (int, float)
    rtol = ELASTIC_FIGURE_RTOL if key.startswith(PARAMETER_FIGURES) else ELASTIC_LOSS_RTOL
    return (inexact and isinstance(got, numbers) and isinstance(want, numbers)
            and not isinstance(got, bool) and not isinstance(want, bool)
            and math.isclose(got, want, rel_tol=rtol, abs_tol=ELASTIC_ABS))


def compare(reference: list[dict], faulted: list[dict], inexact_after: int | None = None) -> dict:
    """Every train loss of `faulted` (steps redone included) against the reference's, the
    sets of (step, split), and the last line per (step, split) field by field (timings
    aside). Lines of steps after `inexact_after` (the lowest step a run on fewer processes
    resumed from) are compared within the reduction-order tolerances, the others exactly; the
    largest relative difference of each figure after it is reported."""
    want = {(r["step"], r["split"]): r for r in reference}
    last = {(r["step"], r["split"]): r for r in faulted}

    def inexact(step: int) -> bool:
        return inexact_after is not None and step > inexact_after

    differing = sorted(key for key, r in last.items() if key in want and any(
        not _same(r[k], want[key].get(k), inexact(key[0]), k) for k in r if not _timing(k)))
    losses = [(r["step"], r["loss"]) for r in faulted if r["split"] == "train"]
    wrong = sorted({s for s, loss in losses
                    if not _same(loss, want.get((s, "train"), {}).get("loss"), inexact(s))})
    counts = collections.Counter(s for s, _ in losses)
    relative = [abs(loss / want[(s, "train")]["loss"] - 1) for s, loss in losses
                if inexact(s) and (s, "train") in want]
    worst: dict[str, float] = {}  # "<split> <figure>" (per-layer ones by kind): largest
    for key, r in last.items():
        for k, got in r.items():
            was = want.get(key, {}).get(k)
            if (inexact(key[0]) and not _timing(k) and isinstance(got, float)
                    and isinstance(was, float) and was):
                name = f"{key[1]} {k.split('/')[0]}"
                worst[name] = max(worst.get(name, 0.0), abs(got / was - 1))
    found = {"metric_steps_equal": set(last) == set(want),
             "missing_lines": sorted(set(want) - set(last))[:20],
             "extra_lines": sorted(set(last) - set(want))[:20],
             "every_train_loss_equal": not wrong and not differing,
             "differing_steps": (wrong or [k[0] for k in differing])[:20],
             "train_lines": len(losses), "steps_recomputed": sum(c - 1 for c in counts.values())}
    if inexact_after is not None:
        found |= {"exact_through_step": inexact_after, "loss_rtol_after_it": ELASTIC_LOSS_RTOL,
                  "parameter_figures_rtol_after_it": ELASTIC_FIGURE_RTOL,
                  "train_losses_after_it": len(relative),
                  "largest_relative_loss_difference": max(relative, default=0.0),
                  "train_losses_bit_equal_after_it": sum(r == 0 for r in relative),
                  "largest_relative_difference_after_it": dict(sorted(worst.items()))}
    return found


def params_compared(a: pathlib.Path, b: pathlib.Path, bound: float | None = None) -> dict:
    """The final parameters of two runs: bit-identical? With `bound` (runs that computed steps on
    fewer devices), whether every parameter is within it, and the largest and RMS differences."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no probing for accelerators (libtpu's logs)
    import jax
    import numpy as np

    from transformer.checkpoint import averaging

    got = averaging.load_params(str(a))
    want = averaging.load_params(str(b))
    if jax.tree.structure(got) != jax.tree.structure(want):
        return {"final_params_bit_identical": False, "final_params_same_structure": False}
    pairs = [(np.asarray(x, np.float64), np.asarray(y, np.float64))
             for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]
    largest = max((float(np.max(np.abs(x - y))) for x, y in pairs if x.size), default=0.0)
    found = {"final_params_bit_identical": all(np.array_equal(x, y) for x, y in pairs)}
    if bound is not None:
        squares = sum(float(np.sum((x - y) ** 2)) for x, y in pairs)
        found |= {"final_params_bound": bound, "final_params_within_bound": largest <= bound,
                  "final_params_largest_difference": largest,
                  "final_params_rms_difference": math.sqrt(
                      squares / max(1, sum(x.size for x, _ in pairs)))}
    return found


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
    flags.DEFINE_list("kinds", None, f"A subset of {', '.join(KINDS)} (default: all; "
                      f"{', '.join(MULTIPROCESS_KINDS)} only with --processes=2).")
    flags.register_validator("kinds", _known_kinds)
    flags.DEFINE_integer("spikes", 0, "Loss spikes (spike@N) besides the faults, at seeded "
                         "steps, in every run (the reference's too) with optimizer.skip_spikes "
                         "on.", lower_bound=0)
    flags.DEFINE_integer("steps", None, "Train steps (default: 5 per fault + 20).")
    flags.DEFINE_integer("checkpoint_every", 5, "checkpoint_every_steps of the runs.",
                         lower_bound=1)
    flags.DEFINE_integer("local_every", LOCAL_EVERY, "checkpoint_local_every_steps of the runs "
                         "when local_tier_lost is among the kinds (0: no local tier).",
                         lower_bound=0)
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
    flags.DEFINE_string("config_file", TINY, "The runs' config, e.g. configs/default.py "
                        "(shrink it with --config: the soak runs 5 steps a fault).")
    flags.DEFINE_string("workdir", None, "Default: a new temporary directory.")
    flags.DEFINE_string("out", "soak.json", "Where the summary (JSON) goes.")


def chosen_kinds(kinds: list[str] | None, processes: int, local_every: int) -> list[str]:
    """--kinds, or every kind this soak can deliver; UsageError for one it cannot."""
    possible = [k for k in KINDS if (processes > 1 or k not in MULTIPROCESS_KINDS)
                and (local_every or k != "local_tier_lost")]
    if kinds and (impossible := [k for k in kinds if k not in possible]):
        raise app.UsageError(
            f"--kinds={','.join(impossible)}: " + ("a soak of one process has no process to "
                                                   "lose: use --processes=2"
                                                   if "process_lost" in impossible else
                                                   "--local_every=0 turns the local tier off"))
    return list(kinds or possible)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not flags.FLAGS["verbosity"].present:  # orbax's INFO lines when the final params load
        logging.set_verbosity(logging.WARNING)
    args = flags.FLAGS
    kinds = chosen_kinds(args.kinds, args.processes, args.local_every)
    if args.local_every and "local_tier_lost" in kinds \
            and args.local_every >= args.checkpoint_every:
        raise app.UsageError(f"--local_every={args.local_every} must be smaller than "
                             f"--checkpoint_every={args.checkpoint_every}")
    total = args.steps or 5 * args.faults + 20
    base = pathlib.Path(args.workdir or f"/tmp/soak-{os.getpid()}")
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    common = dict(steps=total, checkpoint_every=args.checkpoint_every, log_every=args.log_every,
                  eval_every=args.eval_every, processes=args.processes,
                  devices=4 if args.processes > 1 else 2, heartbeat=args.heartbeat,
                  config=tuple(args.config),
                  spiked=spike_steps(args.spikes, total, random.Random(f"spikes {args.seed}")),
                  local_every=args.local_every if "local_tier_lost" in kinds else 0,
                  elastic="process_lost" in kinds, config_file=args.config_file)

    reference = Soak(base / "reference", **common)
    codes = reference.wait(reference.start())
    if codes != [0] * args.processes:
        sys.exit(f"the uninterrupted run failed ({codes}): see {base}/reference.run1.p0.log")

    soak = Soak(base / "faulted", **common)
    started = time.monotonic()
    rng = random.Random(args.seed)
    faults = Faults(soak, rng, total)
    queue = collections.deque(schedule(args.faults, rng, kinds))
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
        pathlib.Path(args.out).write_text(json.dumps({  # so far, should the soak not finish
            "finished": False, "faults_delivered": len(faults.delivered),
            "minutes": round((time.monotonic() - started) / 60, 1),
            "problems": faults.problems, "fault_log": faults.delivered}, indent=1))
    procs = faults.start()
    final = soak.wait(procs)
    faults.check_log(procs)
    if any(code != 0 for code in final):
        faults.problems.append(f"the final run exited {final}")

    exact = faults.fewer_from is None
    figures = compare(reference.lines(), soak.lines(), faults.fewer_from)
    bound = None if exact else 2 * sum(
        r.get("learning_rate", 0.0) for r in reference.lines()
        if r["split"] == "train" and r["step"] > faults.fewer_from)
    params = params_compared(base / "faulted", base / "reference", bound)
    identical = params["final_params_bit_identical"]
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
        "local_every": common["local_every"], "steps": total, "seed": args.seed,
        "config": args.config, "restarts": soak.runs - 1,
        "restarts_on_fewer_processes": sum(f["kind"] == "process_lost"
                                           for f in faults.delivered),
        "steps_recomputed": figures.pop("steps_recomputed"),
        "reference_seconds": round(reference.seconds, 1),
        "faulted_seconds": round(soak.seconds, 1),
        "seconds_lost_per_fault": round((soak.seconds - reference.seconds)
                                        / max(1, sum(delivered.values())), 1),
        **params, **figures, **spikes,
        "problems": faults.problems, "fault_log": faults.delivered, "workdir": str(base),
        "finished": True,
    }
    close = identical if exact else params["final_params_within_bound"]
    summary["ok"] = bool(close and figures["metric_steps_equal"]
                         and figures["every_train_loss_equal"] and not faults.problems)
    pathlib.Path(args.out).write_text(json.dumps(summary, indent=1))
    if exact:
        params_words = "bit-identical" if identical else "DIFFERENT"
        losses_words = "equal" if figures["every_train_loss_equal"] else "DIFFERENT"
    else:
        params_words = (f"within {params['final_params_largest_difference']:.2g} (bound "
                        f"{bound:.2g}{'' if close else ': OUTSIDE'})")
        losses_words = (f"{'equal' if figures['every_train_loss_equal'] else 'DIFFERENT'} "
                        f"(exact through step {faults.fewer_from}, then within rtol "
                        f"{ELASTIC_LOSS_RTOL:g}: largest "
                        f"{figures['largest_relative_loss_difference']:.2g})")
    print(f"soak: {summary['faults']} faults "
          f"({', '.join(f'{k} {n}' for k, n in summary['faults_by_kind'].items())}), "
          f"{summary['restarts']} restarts, {summary['steps_recomputed']} steps recomputed, "
          f"{summary['seconds_lost_per_fault']} s lost per fault, final params {params_words}, "
          f"metric lines {'all there' if figures['metric_steps_equal'] else 'MISSING'}, train "
          f"losses {losses_words}, {len(faults.problems)} problems; {args.out}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    define_flags()
    app.run(main)
