"""Where ``make test``'s time goes: per test, its wall span, CPU time and jax compile work.

As a pytest plugin (each xdist worker appends a JSON line per test to
``$TIMELINE_DIR/<worker>.jsonl``)::

    TIMELINE_DIR=/tmp/tl PYTHONPATH=tools JAX_PLATFORMS=cpu .venv/bin/python -m pytest \\
        -q -n 2 --dist loadgroup -p test_cpu_timeline

then ``python tools/test_cpu_timeline.py /tmp/tl`` prints each worker's files in order (start,
end, span: the critical path and the idle tail), and per folder and per file the wall and CPU
seconds and the jax compile counts. On a machine of as many cores as workers, the run's wall
time is about its CPU time over the cores, so CPU seconds (the test process's and the
children's it waited for) are what a cut must lower; wall spans mislead when other work
shares the machine.
"""

import collections
import glob
import json
import os
import resource
import sys
import time

_EVENTS: collections.Counter = collections.Counter()
_PROGRAMS: list = []  # (program, seconds) of the test's slow backend compiles (misses)
_OUT = []
# Backend compiles shorter than this are small helpers or persistent-cache hits.
_SLOW_COMPILE_S = 0.5


def _cpu_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _listen() -> None:
    """Sums jax's compile events (tracing, lowering, backend compiles, cache hits/misses)."""
    import jax.monitoring as monitoring  # noqa: PLC0415 - after conftest set jax up

    def duration(event, seconds, fun_name=None, **_):
        _EVENTS[event.rsplit("/", 1)[-1]] += seconds
        _EVENTS["compiles"] += event.endswith("backend_compile_duration")
        if event.endswith("backend_compile_duration") and seconds >= _SLOW_COMPILE_S:
            _PROGRAMS.append((fun_name, round(seconds, 2)))

    monitoring.register_event_duration_secs_listener(duration)
    monitoring.register_event_listener(lambda event, **_: _EVENTS.update([event.rsplit("/")[-1]]))


def _open() -> None:
    """Opens this worker's file and starts listening, once (before its first test)."""
    if not _OUT:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        path = os.path.join(os.environ["TIMELINE_DIR"], f"{worker}.jsonl")
        _OUT.append(open(path, "a"))  # noqa: SIM115 - open for the worker's whole run
        _listen()


try:
    import pytest
except ImportError:  # the summary needs no pytest
    pytest = None
else:

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """Times one test (set-up, call and tear-down) and records its compile events."""
        _open()
        _EVENTS.clear()
        _PROGRAMS.clear()
        start, cpu = time.time(), _cpu_seconds()
        try:
            return (yield)
        finally:
            record = dict(id=item.nodeid, t0=start, t1=time.time(), cpu=_cpu_seconds() - cpu)
            _OUT[0].write(json.dumps(dict(record, ev=dict(_EVENTS), programs=_PROGRAMS)) + "\n")
            _OUT[0].flush()


def _load(folder: str) -> list[dict]:
    rows = []
    for path in glob.glob(os.path.join(folder, "*.jsonl")):
        worker = os.path.basename(path)[: -len(".jsonl")]
        with open(path) as f:
            rows += [dict(json.loads(line), worker=worker) for line in f]
    return rows


def _timeline(rows: list[dict], start: float) -> None:
    for worker in sorted({row["worker"] for row in rows}):
        mine = sorted((row for row in rows if row["worker"] == worker), key=lambda r: r["t0"])
        print(f"{worker}: {len(mine)} tests, ends at {mine[-1]['t1'] - start:.1f} s")
        spans = []
        for row in mine:
            name = row["id"].split("::")[0]
            if spans and spans[-1][0] == name:
                spans[-1][2] = row["t1"]
            else:
                spans.append([name, row["t0"], row["t1"]])
        for name, t0, t1 in spans:
            if t1 - t0 >= 3:
                print(f"  {t0 - start:7.1f} {t1 - start:7.1f} {t1 - t0:6.1f}  {name}")


def summarize(folder: str, top: int = 30) -> None:
    """Prints the workers' timelines and the wall / CPU / compile totals of ``folder``."""
    rows = _load(folder)
    start = min(row["t0"] for row in rows)
    print(f"span {max(row['t1'] for row in rows) - start:.1f} s")
    _timeline(rows, start)
    keys = ("wall", "cpu", "backend_compile_duration", "compiles", "cache_hits")
    per_file, per_folder = (collections.defaultdict(collections.Counter) for _ in range(2))
    for row in rows:
        name = row["id"].split("::")[0]
        counts = collections.Counter(row["ev"], wall=row["t1"] - row["t0"], cpu=row["cpu"])
        per_file[name].update(counts)
        per_folder["/".join(name.split("/")[:2])].update(counts)
    for title, table in (("folder", per_folder), ("file", per_file)):
        print(f"\n{' '.join(f'{key[:9]:>9}' for key in keys)}  {title}")
        for name, counts in sorted(table.items(), key=lambda kv: -kv[1]["cpu"])[:top]:
            print(" ".join(f"{counts[key]:9.1f}" for key in keys), "", name)


if __name__ == "__main__":
    summarize(sys.argv[1])
