"""The training step and beam search give the recorded results to the bit (tests/support/reference_trace.py).

A change of the code's shape must change no figure: each step's loss and nll of the Multi30k tiny
recipe through the real loop, its dev loss, its final weights, and the beam-5 token ids of a
deterministically trained model on test_2016_flickr all equal the fixture recorded before the change.
The bits depend on ATen's CPU kernels, so each machine checks its own capability's record and the
nearest recorded one below it (under ATEN_CPU_CAPABILITY); it never falls back to closeness.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import reference_trace


def assert_same_trace(got: dict, want: dict, key: str) -> None:
    hint = (f" ({key}: recorded on {want.get('machine', 'an unrecorded CPU')} with torch {want.get('torch')}; "
            f"this machine: {reference_trace.machine()} with torch {got.get('torch', torch.__version__)})")
    assert got["precision"] == want["precision"], "the trace's precision changed" + hint
    assert got["losses"] == want["losses"], "the step's losses changed (hex bits per step: loss, nll)" + hint
    assert got["val"] == want["val"], "the dev loss changed" + hint
    assert got["weights_sha256"] == want["weights_sha256"], "the trained weights changed" + hint
    assert got["tiny_weights_sha256"] == want["tiny_weights_sha256"], "the beam model's weights changed" + hint
    changed = [i for i, (a, b) in enumerate(zip(got["beams"], want["beams"])) if a != b]
    assert not changed and len(got["beams"]) == len(want["beams"]), f"beams changed at sentences {changed}" + hint


def differences(got: dict, want: dict, key: str) -> list[str]:
    """assert_same_trace's message as a list (empty when the trace is the record)."""
    try:
        assert_same_trace(got, want, key)
    except AssertionError as e:
        return [str(e)]
    return []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_training_and_beams_equal_the_recorded_traces(tmp_path, multi30k_dir, wmt14_dir):
    # multi30k_dir, wmt14_dir: the text both traces read (a clone without it skips, naming `make test-data`)
    records = reference_trace.load()
    own = reference_trace.capability()
    keys = reference_trace.records_to_check(own, list(records))
    if not keys:
        pytest.fail(f"no reference trace for {own!r} nor for a capability below it (recorded: {sorted(records)}). "
                    "Record this machine's at a commit whose results are the reference: "
                    ".venv/bin/python -m tests.support.reference_trace --write")
    # The capability below runs in a subprocess on one core while this process's trace (one thread)
    # runs on the other.
    below = {key: reference_trace.start_trace(key, tmp_path / key.replace(" ", "-")) for key in keys if key != own}
    # Every record is compared before the test fails, so a change shows on each path it reaches.
    failed = []
    try:
        if own in keys:
            failed += differences(reference_trace.trace(tmp_path / "own"), records[own], own)
        for key, (proc, out) in below.items():
            failed += differences(reference_trace.finish_trace(proc, out, key), records[key], key)
    finally:
        for proc, _ in below.values():
            proc.kill()
            proc.wait()
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("own, recorded, want", [
    ("x86_64 AVX2", ["x86_64 AVX2"], ["x86_64 AVX2"]),
    ("x86_64 AVX512", ["x86_64 AVX2"], ["x86_64 AVX2"]),
    ("x86_64 AVX512", ["x86_64 AVX2", "x86_64 AVX512"], ["x86_64 AVX512", "x86_64 AVX2"]),
    ("x86_64 AVX512", ["x86_64 DEFAULT", "x86_64 AVX2", "x86_64 AVX512"], ["x86_64 AVX512", "x86_64 AVX2"]),
    ("x86_64 AVX2", ["x86_64 DEFAULT", "x86_64 AVX2", "x86_64 AVX512"], ["x86_64 AVX2", "x86_64 DEFAULT"]),
    ("x86_64 DEFAULT", ["x86_64 AVX2"], []),
    ("aarch64 SVE256", ["x86_64 DEFAULT", "x86_64 AVX2"], []),
    ("aarch64 SVE256", ["aarch64 DEFAULT"], ["aarch64 DEFAULT"]),
    ("riscv64 DEFAULT", ["x86_64 DEFAULT"], []),
])
def test_records_to_check_are_own_and_the_nearest_below(own, recorded, want):
    assert reference_trace.records_to_check(own, recorded) == want
