"""The one run loop (`fedjax_sim.run.loop`) keeps what the three drivers did: the histories of
`run_loop_cases.py` (simulate stopped and resumed, streamed with device and host state rows,
a sweep) equal `run_loop_pins.npz`, recorded with the drivers before they shared the loop,
bit for bit on the machine that recorded them (`run_loop_pins.json`). On another machine
the float32 histories differ in the last bits (another vector instruction set; over rounds by
more), so there the refactor's equivalence rests on the float64 golden pins, which carry the
measured cross-machine budget (`tests/algorithms/golden/README.md`)."""

import machine
import numpy as np
import pytest
import run_loop_cases

pytestmark = pytest.mark.skipif(
    not machine.same_machine(run_loop_cases.PINS_RECORD),
    reason="float32 run-loop pins are bit-exact only on the machine that recorded them",
)


@pytest.mark.parametrize("name", list(run_loop_cases.CASES))
def test_driver_equals_its_pin(name):
    got = run_loop_cases.record(name)
    with np.load(run_loop_cases.PINS) as z:
        want = {k: z[k] for k in z.files if k.startswith(f"{name}/")}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
