"""torch.set_num_threads is called only where the thread count differs (it slows CPU attention)."""

from __future__ import annotations

from unittest import mock

import torch

from pipeline.cpu_threads import use_threads


def test_the_count_torch_already_has_is_not_set_again_and_another_is():
    n = torch.get_num_threads()
    with mock.patch.object(torch, "set_num_threads") as set_threads:
        use_threads(n)
        use_threads(0)
        assert set_threads.call_count == 0
        use_threads(n + 1)
        set_threads.assert_called_once_with(n + 1)

