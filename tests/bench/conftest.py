"""The bench commands' CPU smoke runs time each device measurement once.

``bench tbo`` and ``bench serve`` time a program enqueued back to back ``DEVICE_ITERS`` times
(and ``bench serve`` its decode step as often): repetitions that steady a GPU's numbers. A
smoke run on the CPU checks that the measurements run and what the reports print of them
(the tests pass ``--iters 1`` for the same reason), not how steady they are.
"""

import pytest

from jtbo.bench import serve, tbo


@pytest.fixture(autouse=True)
def one_timed_device_run(monkeypatch):
    """``DEVICE_ITERS`` of ``bench tbo`` and ``bench serve`` set to 1 for the test."""
    monkeypatch.setattr(tbo, "DEVICE_ITERS", 1)
    monkeypatch.setattr(serve, "DEVICE_ITERS", 1)
