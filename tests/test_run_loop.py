"""The one run loop (`fedjax_sim.loop`) keeps what the three drivers did: the histories of
`run_loop_cases.py` (simulate stopped and resumed, streamed with device and host state rows,
a sweep) equal `run_loop_pins.npz`, recorded with the drivers before they shared the loop,
bit for bit (float32; recorded on this machine, see `run_loop_cases.py`)."""

import numpy as np
import pytest
import run_loop_cases


@pytest.mark.parametrize("name", list(run_loop_cases.CASES))
def test_driver_equals_its_pin(name):
    got = run_loop_cases.record(name)
    with np.load(run_loop_cases.PINS) as z:
        want = {k: z[k] for k in z.files if k.startswith(f"{name}/")}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
