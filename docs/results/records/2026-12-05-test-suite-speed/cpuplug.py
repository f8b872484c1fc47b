"""Per-test CPU seconds (this process + waited-for children), written at the end."""
import os
import resource
import time

import pytest

_rows = []


def _cpu():
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    c0, t0 = _cpu(), time.monotonic()
    yield
    _rows.append((_cpu() - c0, time.monotonic() - t0, item.nodeid))


def pytest_sessionfinish(session):
    out = os.environ.get("CPUPLUG_OUT")
    lines = [f"{c:8.1f} cpu {w:8.1f} wall  {n}" for c, w, n in sorted(_rows, reverse=True)]
    total = sum(r[0] for r in _rows)
    lines.append(f"{total:8.1f} cpu total, {os.getloadavg()[0]:.1f} load")
    text = "\n".join(lines) + "\n"
    if out:
        with open(out, "w") as f:
            f.write(text)
    print("\n" + text)
