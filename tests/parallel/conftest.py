"""The single-device recordings that the tensor/expert-parallel tests compare with."""
import pytest

import _workload as wl


@pytest.fixture(scope="session")
def single_device():
    """Single-device recordings by prompt lengths, built on first use and shared by every test
    of the session (of one xdist worker: the tests that take it are in the xdist group
    ``_workload.SINGLE_DEVICE_GROUP``, so each recording is made once per test run)."""
    cache = {}

    def get(lens):
        if lens not in cache:
            rec = wl.serve_recording(wl.runner(lens=lens), lens=lens)
            assert sorted(rec["outputs"]) == list(range(len(lens)))
            assert wl.min_margin(rec) > wl.MIN_MARGIN  # the workload is stable under LOGIT_TOL
            cache[lens] = rec
        return cache[lens]

    return get
