"""A stand-in for tests/test_cuda.py in gpu_check's tests phase (tests/test_gpu_check.py): one test that passes,
after sleeping GPU_CHECK_PHASE_SLEEP seconds (0 unless set), so a test can make the phase outlive its timeout."""

import os
import time


def test_stand_in_for_the_cuda_tests():
    time.sleep(float(os.environ.get("GPU_CHECK_PHASE_SLEEP", "0")))
