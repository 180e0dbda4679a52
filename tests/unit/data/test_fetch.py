"""Downloads and archives: resume, checksums, bad archives; the ``download`` stage on a local mirror."""

from __future__ import annotations

import hashlib
import http.server
import re
import shutil
from pathlib import Path

import pytest

from tests.support.http import serve
from pipeline.data import fetch as data_fetch
from pipeline.data import download, sources
from pipeline.config import Config
from pipeline.data.fetch import ChecksumError, DataError, extract_members, fetch, http_download
from pipeline.stage import StageContext

DATA = bytes(range(256)) * 4096  # 1 MiB


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves DATA with Range support; the first ``cuts`` responses stop half-way."""

    cuts = 0
    seen_ranges: list[str | None] = []

    def log_message(self, *args):  # keep test output quiet
        pass

    def do_GET(self):
        if self.path != "/file.bin":
            self.send_error(404)
            return
        rng = self.headers.get("Range")
        type(self).seen_ranges.append(rng)
        start = int(re.match(r"bytes=(\d+)-", rng).group(1)) if rng else 0
        body = DATA[start:]
        self.send_response(206 if rng else 200)
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{len(DATA) - 1}/{len(DATA)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if type(self).cuts > 0:
            type(self).cuts -= 1
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
            return
        self.wfile.write(body)


@pytest.fixture
def server():
    _RangeHandler.cuts, _RangeHandler.seen_ranges = 0, []
    with serve(_RangeHandler) as url:
        yield url


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch):
    monkeypatch.setattr(data_fetch, "RETRY_BASE_S", 0.0)


def test_interrupted_download_resumes_with_range(server, tmp_path):
    _RangeHandler.cuts = 1
    dest = http_download(f"{server}/file.bin", tmp_path / "file.bin", timeout_s=10)
    assert dest.read_bytes() == DATA
    assert not (tmp_path / "file.bin.part").exists()
    assert _RangeHandler.seen_ranges == [None, f"bytes={len(DATA) // 2}-"]


def test_a_partial_download_never_counts_as_done(server, tmp_path):
    _RangeHandler.cuts = 100
    with pytest.raises(DataError, match="after 2 attempts"):
        http_download(f"{server}/file.bin", tmp_path / "file.bin", timeout_s=10, attempts=2)
    assert not (tmp_path / "file.bin").exists()
    assert (tmp_path / "file.bin.part").exists()  # kept, to resume next time


def test_missing_url_is_a_clear_error(server, tmp_path):
    with pytest.raises(DataError, match="HTTP 404"):
        http_download(f"{server}/nope.tgz", tmp_path / "nope.tgz", timeout_s=10)


def test_checksum_mismatch_names_the_file_and_both_hashes(server, tmp_path):
    good = hashlib.sha256(DATA).hexdigest()
    wrong = "0" * 64
    with pytest.raises(ChecksumError) as e:
        fetch(f"{server}/file.bin", str(tmp_path / "work"), 10, sha256=wrong)
    assert "file.bin" in str(e.value) and wrong in str(e.value) and good in str(e.value)
    cached = list((tmp_path / "work").rglob("file.bin*"))
    assert cached == []  # a file that failed its check is not kept
    uri, sha, size = fetch(f"{server}/file.bin", str(tmp_path / "work"), 10, sha256=good)
    assert sha == good and size == len(DATA) and Path(uri).read_bytes() == DATA
    md5 = hashlib.md5(DATA).hexdigest()
    local = tmp_path / "local.bin"
    local.write_bytes(DATA)
    with pytest.raises(ChecksumError, match=f"expected md5 {'f' * 32}, got {md5}"):
        fetch(str(local), str(tmp_path / "work"), 10, md5="f" * 32)


def test_not_an_archive_is_a_clear_error(tmp_path):
    fake = tmp_path / "training-parallel-nc-v9.tgz"
    fake.write_bytes(b"<html>404 Not Found</html>\n" * 100)
    with pytest.raises(DataError, match=r"training-parallel-nc-v9\.tgz .* is not a valid tar archive"):
        extract_members(str(fake), fake.name, {"a": str(tmp_path / "a")})


def test_missing_member_is_named(synthetic_mirror, tmp_path):
    archive = synthetic_mirror / "wmt14" / "dev.tgz"
    with pytest.raises(DataError, match=r"dev\.tgz .*lacks \['dev/newstest2099\.en'\]"):
        extract_members(str(archive), "dev.tgz", {"dev/newstest2099.en": str(tmp_path / "x")})


def test_gzip_members_are_decompressed_or_copied_as_asked(mirror_dir, tmp_path):
    """Giga's members are .gz files in a plain tar: wanted as plain text they are decompressed; wanted
    under their .gz name they are copied byte for byte (no second gzip layer)."""
    import gzip
    import tarfile

    archive = mirror_dir / "wmt10" / "training-giga-fren.tar"
    member = "giga-fren.release2.fixed.fr.gz"
    extract_members(str(archive), archive.name, {member: str(tmp_path / "plain.fr")})
    extract_members(str(archive), archive.name, {member: str(tmp_path / member)})
    with tarfile.open(archive) as tar:
        raw = tar.extractfile(member).read()
    assert (tmp_path / member).read_bytes() == raw
    assert (tmp_path / "plain.fr").read_bytes() == gzip.decompress(raw)
    assert len(gzip.decompress(raw).splitlines()) == 1000


def _ctx(cfg: Config, out: Path) -> StageContext:
    return StageContext(name="download", key="k", cfg=cfg, out_dir=str(out), inputs={})


def test_download_stage_from_a_local_mirror(synthetic_mirror, tmp_path):
    cfg = Config()
    cfg.data.mirror = str(synthetic_mirror)
    cfg.data.src_lang, cfg.data.tgt_lang = "de", "en"
    cfg.run.work_dir = str(tmp_path)
    res = download.run(_ctx(cfg, tmp_path / "out"))
    out = res.outputs
    assert [c["corpus"] for c in out["train"]] == ["europarl_v7", "commoncrawl", "news_commentary_v9"]
    assert out["train"][0]["src"].endswith("europarl-v7.de-en.de")  # de -> en picks sides
    assert out["test"]["src"].endswith("newstest2014-deen-ref.de.sgm")
    assert out["test"]["tgt"].endswith("newstest2014-deen-src.en.sgm")
    assert res.metrics["download/files"] == 10
    for f in [*out["train"], out["dev"], out["test"]]:
        assert Path(f["src"]).is_file() and Path(f["tgt"]).is_file()


def test_download_stage_rejects_a_mirror_with_a_bad_checksum(synthetic_mirror, tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(synthetic_mirror, mirror)
    (mirror / "wmt14" / "dev.tgz").write_bytes(b"tampered")
    cfg = Config()
    cfg.data.mirror = str(mirror)
    cfg.run.work_dir = str(tmp_path)
    expected = sources.parse_sha256sums((synthetic_mirror / "SHA256SUMS").read_text())["wmt14/dev.tgz"]
    msg = rf"checksum mismatch for dev\.tgz \(.*wmt14/dev\.tgz\): expected sha256 {expected}, got "
    with pytest.raises(ChecksumError, match=msg):
        download.run(_ctx(cfg, tmp_path / "out"))


def test_download_stage_custom_files(tmp_path):
    import gzip

    (tmp_path / "a.en.gz").write_bytes(gzip.compress(b"hello\nworld\n"))
    (tmp_path / "a.de").write_bytes(b"hallo\nwelt\n")
    cfg = Config()
    cfg.data.source = "custom"
    cfg.data.train_src, cfg.data.train_tgt = [str(tmp_path / "a.en.gz")], [str(tmp_path / "a.de")]
    cfg.data.dev_src = cfg.data.test_src = str(tmp_path / "a.en.gz")
    cfg.data.dev_tgt = cfg.data.test_tgt = str(tmp_path / "a.de")
    cfg.run.work_dir = str(tmp_path)
    out = download.run(_ctx(cfg, tmp_path / "out")).outputs
    assert Path(out["train"][0]["src"]).read_bytes() == b"hello\nworld\n"
    assert Path(out["test"]["tgt"]).read_bytes() == b"hallo\nwelt\n"
