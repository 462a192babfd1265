import math

import pytest

from pagedkv.runtime import machine_load


def test_other_processes_are_the_machines_ticks_less_this_processs(monkeypatch):
    """Over a window of 0.1 s at 100 ticks a second, 30 ticks of the
    machine's of which 10 are this process's are 2 other cores; this
    process's own ticks never make the figure negative."""
    machine = iter([1000, 1030, 5000, 5004])
    own = iter([500, 510, 900, 910])
    monkeypatch.setattr(machine_load, "_machine_busy_ticks", lambda: next(machine))
    monkeypatch.setattr(machine_load, "_own_ticks", lambda: next(own))
    monkeypatch.setattr(machine_load, "_wait", lambda s: None)
    monkeypatch.setattr(machine_load.os, "sysconf", lambda name: 100)
    assert machine_load.other_processes_cores(0.1) == pytest.approx(2.0)
    assert machine_load.other_processes_cores(0.1) == 0.0


def test_the_machine_is_read_from_proc():
    cores = machine_load.other_processes_cores(0.02)
    assert math.isfinite(cores) and cores >= 0


@pytest.mark.parametrize("window", [0, -1, float("nan")])
def test_a_window_must_be_positive(window):
    with pytest.raises(ValueError, match="window_s"):
        machine_load.other_processes_cores(window)
