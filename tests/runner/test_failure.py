"""FailureMonitor with a fake key-value store: published errors, stopped beats, the exits."""

import pytest

from jtbo.runner import failure


class _Store:
    """The coordination service's key-value calls the monitor uses."""

    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        if key in self.values and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def _monitors(store, now):
    exits = []
    make = lambda p: failure.FailureMonitor(  # noqa: E731
        store, p, 2, timeout_s=5.0, poll_s=1.0, exit_process=exits.append, clock=lambda: now[0]
    )
    return make(0), make(1), exits


def test_a_published_error_ends_a_peer_in_a_collective_and_stops_one_outside():
    store, now = _Store(), [0.0]
    survivor, failing, exits = _monitors(store, now)
    with pytest.raises(RuntimeError), failing.phase(4, "assemble", collective=False):
        raise RuntimeError("bad plan")
    assert (
        store.values["jtbo/failure/1"]
        == "process 1 failed in assemble of step 4: RuntimeError: bad plan"
    )
    with survivor.phase(4, "device step", collective=True):
        survivor.poll_once()
    assert exits == [failure.PEER_FAILED_EXIT_CODE]
    with (
        pytest.raises(failure.PeerFailedError, match="process 1 failed in assemble of step 4"),
        survivor.phase(5, "exchange", collective=True),
    ):
        pass


def test_agreed_errors_are_not_failures():
    store, now = _Store(), [0.0]
    monitor, _, _ = _monitors(store, now)
    with (
        pytest.raises(ValueError),
        monitor.phase(1, "exchange", collective=True, agreed=(ValueError,)),
    ):
        raise ValueError("refused everywhere")
    assert monitor.failure is None and not store.values


def test_a_stopped_beat_is_a_failure_after_the_timeout():
    store, now = _Store(), [0.0]
    survivor, dead, exits = _monitors(store, now)
    dead.poll_once()  # one beat, then it dies
    with survivor.phase(2, "device step", collective=True):
        for t in (0.0, 3.0, 5.0):
            now[0] = t
            survivor.poll_once()
        assert exits == []  # 5 s is not past the timeout
        now[0] = 5.5
        survivor.poll_once()
    assert exits == [failure.PEER_FAILED_EXIT_CODE]
    assert "process 1 stopped responding during device step of step 2" in survivor.failure
