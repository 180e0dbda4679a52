"""Checkpoint uploads retried with backoff (pipeline.train.upload), without Ray or a store."""

from __future__ import annotations

import logging
import shutil

import pyarrow.fs as pafs
import pytest

from pipeline.train.upload import CheckpointUploadError, copy_verified, with_retries


class Clock:
    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def failing(n: int):
    calls = []

    def copy() -> None:
        calls.append(1)
        if len(calls) <= n:
            raise OSError(f"Connection reset by peer ({len(calls)})")
    return copy, calls


def test_an_outage_delays_the_upload_with_exponential_backoff(caplog):
    clock = Clock()
    copy, calls = failing(3)
    with caplog.at_level(logging.WARNING, logger="pipeline.train.upload"):
        assert with_retries(copy, "checkpoint_0000020", 600, sleep=clock.sleep, clock=lambda: clock.now) == 4
    assert clock.sleeps == [1.0, 2.0, 4.0] and len(calls) == 4
    assert "checkpoint_0000020 failed (attempt 1: Connection reset by peer (1)); retrying in 1 s" in caplog.text
    assert "complete after 4 attempts" in caplog.text


def test_the_waits_are_capped_and_the_retry_time_bounds_them():
    clock = Clock()
    copy, calls = failing(10**6)
    with pytest.raises(CheckpointUploadError, match=r"checkpoint_0000020: the object store took no complete copy "
                                                    r"in 9 attempt\(s\) over 121 s \(checkpoint.upload_retry_s="
                                                    r"150\); last error: Connection reset by peer \(9\)"):
        with_retries(copy, "checkpoint_0000020", 150, sleep=clock.sleep, clock=lambda: clock.now)
    # Failed at 0, 1, 3, 7, 15, 31, 61, 91, 121 s; one more 30 s wait would end past 150 s.
    assert clock.sleeps == [1, 2, 4, 8, 16, 30, 30, 30] and len(calls) == 9


def test_other_errors_are_not_retried():
    def copy() -> None:
        raise ValueError("a bug, not an outage")

    with pytest.raises(ValueError):
        with_retries(copy, "x", 600, sleep=lambda s: pytest.fail("slept"))


def test_a_copy_that_lost_a_file_is_an_error_and_a_later_copy_completes_it(tmp_path, monkeypatch):
    src, dest = tmp_path / "ckpt", tmp_path / "store" / "checkpoint_0000010"
    src.mkdir()
    for name, size in (("model.pt", 5000), ("train_state.pt", 9000), ("meta.json", 20)):
        (src / name).write_bytes(b"x" * size)
    real_copy = pafs.copy_files

    def dropped(source, destination, **kwargs):  # the connection drops after the first file
        shutil.copyfile(src / "meta.json", dest / "meta.json")
        (dest / "model.pt").write_bytes(b"x" * 100)  # and a truncated one (a store never keeps one; still checked)

    monkeypatch.setattr(pafs, "copy_files", dropped)
    fs = pafs.LocalFileSystem()
    with pytest.raises(OSError, match=r"incomplete copy in .*checkpoint_0000010: model.pt, train_state.pt missing "
                                      r"or of the wrong size"):
        copy_verified(str(src), fs, str(dest))
    monkeypatch.setattr(pafs, "copy_files", real_copy)
    copy_verified(str(src), fs, str(dest))
    assert {p.name: p.stat().st_size for p in dest.iterdir()} == {"model.pt": 5000, "train_state.pt": 9000,
                                                                  "meta.json": 20}
