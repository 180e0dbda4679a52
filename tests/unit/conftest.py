"""Unit tests are tiny: extra OpenMP threads only spin on a busy 2-core machine."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread per unit-test module, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
