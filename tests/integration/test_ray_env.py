"""The project's local Ray, with another Ray on the same machine.

Ray Train V2's `PlacementGroupCleaner` (a detached actor) asks Ray's State API whether the train
controller actor is alive, passing no address. This checks that very call
(`ray.train.v2._internal.state.util.is_actor_alive`) from an actor of the project's Ray while a
second Ray runs beside it: it must find the live actor, not raise "Found multiple active Ray
instances" (no address to go by) nor answer "not alive" (no State API: include_dashboard=False).
"""

from __future__ import annotations

import pytest

from tests.support.procs import RayHead

# The bound on each test (pytest-timeout): a second Ray on the machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_state_api_finds_our_actor_with_another_ray_on_the_machine(ray_local, tmp_path):
    ray = ray_local
    other = RayHead(tmp_path, num_cpus=1)  # another Ray, as a user's `ray start` would be
    try:
        @ray.remote(num_cpus=0)
        class Probe:
            def alive(self) -> tuple[bool, str]:
                import os

                from ray.train.v2._internal.state.util import is_actor_alive

                me = ray.get_runtime_context().get_actor_id()
                return bool(is_actor_alive(me, timeout=30)), os.environ.get("RAY_ADDRESS", "")

        probe = Probe.remote()  # a fresh worker process: Ray caches the GCS processes it finds
        alive, address = ray.get(probe.alive.remote(), timeout=120)
        assert alive
        assert address.rsplit(":", 1)[1] == ray.get_runtime_context().gcs_address.rsplit(":", 1)[1]
        assert other.address.rsplit(":", 1)[1] != address.rsplit(":", 1)[1]
    finally:
        other.stop()
    # The stopped head leaves nothing in /tmp; its logs are in the test's folder.
    assert not other.temp_dir.exists() and (other.logs / "gcs_server.out").is_file()
