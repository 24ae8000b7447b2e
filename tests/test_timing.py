"""The one timing loop (pipelines/timing.py): a step count and a time floor, whichever is more."""
import time

from pipelines.timing import step_times


def test_a_fast_step_is_timed_until_the_time_floor():
    calls = []
    times = step_times(lambda: (calls.append(1), time.sleep(0.002)), warmup=2, steps=3,
                       min_seconds=0.05)
    assert len(calls) == 2 + len(times)
    assert len(times) > 3 and sum(times) >= 50


def test_a_slow_step_is_timed_the_steps_asked():
    assert len(step_times(lambda: time.sleep(0.002), warmup=0, steps=4, min_seconds=0.001)) == 4
