"""The comparison of a finished soak's runs again, with benchmarks/soak.py as committed (its
tolerances for steps computed on fewer devices), from the soak's --workdir:

    python docs/results/records/2026-12-05-soak-mixed/recompare.py /tmp/soak2p out.json

Also for a soak cut short: the faulted run's lines so far against the reference's up to the
step it reached (then "metric_steps_equal" speaks of those steps only)."""

import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[4]
spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
soak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak)


def lines(path: pathlib.Path) -> list[dict]:
    found = []
    for line in (path / "metrics.jsonl").read_text().splitlines():
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:  # a last line still being written
            pass
    return found


def main(workdir: str, out: str, summary: str | None = None) -> None:
    base = pathlib.Path(workdir)
    reference, faulted = lines(base / "reference"), lines(base / "faulted")
    reached = max(r["step"] for r in faulted)
    before = json.loads(pathlib.Path(summary).read_text()) if summary else {}
    fewer = [f for f in before.get("fault_log", []) if f["kind"] == "process_lost"]
    inexact = before.get("exact_through_step") if fewer else None
    found = {"faulted_run_reached_step": reached,
             **soak.compare([r for r in reference if r["step"] <= reached], faulted, inexact)}
    pathlib.Path(out).write_text(json.dumps(found, indent=1))
    print(json.dumps({k: v for k, v in found.items() if not isinstance(v, list)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
