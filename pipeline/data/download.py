"""Stage ``download``: fetch the raw parallel text and extract only the files we need.

``data.source = "wmt14"``: the archives of ``pipeline.data.sources`` (those of the training corpora
``data.corpora`` names, and dev and test) from statmt.org or ``data.mirror``, each verified (the
mirror's ``SHA256SUMS`` when it has one, else the registry's checksum where one is published), then
streamed once to copy out the wanted members.
``data.source = "multi30k"``: Multi30k task 1's six gzipped text files from the ``multi30k/dataset``
repository at a pinned commit (or ``data.mirror``), each checked against its sha256 (resumable
download as for WMT14), stored decompressed.
``data.source = "custom"``: the user's plain-text files (paths, ``s3://`` or URLs; ``.gz`` ok),
copied decompressed into the output folder.
"""

from __future__ import annotations

import logging
from typing import Any

from pipeline import storage
from pipeline.data import sources
from pipeline.data.fetch import DataError, copy_text_file, extract_members, fetch, is_http, read_small
from pipeline.stage import StageContext, StageResult

log = logging.getLogger(__name__)


def run(ctx: StageContext) -> StageResult:
    d = ctx.cfg.data
    if d.source == "custom":
        outputs, num_bytes = _custom(ctx)
    elif d.source == "multi30k":
        outputs, num_bytes = _multi30k(ctx)
    else:
        outputs, num_bytes = _wmt14(ctx)
    num_files = 2 * (len(outputs["train"]) + 2)
    log.info("download: %d files, %.1f MB read", num_files, num_bytes / 1e6)
    return StageResult(outputs=outputs, metrics={"download/bytes": float(num_bytes),
                                                 "download/files": float(num_files)})


def _mirror_sums(mirror: str, timeout_s: float) -> dict[str, str]:
    if not mirror:
        return {}
    text = read_small(mirror.rstrip("/") + "/SHA256SUMS", timeout_s)
    if text is None:
        log.warning("mirror %s has no SHA256SUMS: checking only the checksums the registry knows", mirror)
        return {}
    return sources.parse_sha256sums(text.decode("utf-8", errors="replace"))


def _wmt14(ctx: StageContext) -> tuple[dict[str, Any], int]:
    d = ctx.cfg.data
    corpora = sources.chosen(sources.wmt14(d.src_lang, d.tgt_lang), d.corpora)
    sums = _mirror_sums(d.mirror, d.download_timeout_s)
    out_dir = storage.absolute(ctx.out_dir)
    outputs: dict[str, Any] = {"train": [], "dev": None, "test": None, "archives": []}
    num_bytes = 0
    for archive in sources.archives(corpora):
        uri = sources.location(archive, d.mirror)
        sha = sums.get(archive.relpath)
        # A mirror's own SHA256SUMS wins; the registry's md5 is for the real statmt.org bytes.
        md5 = None if sha else archive.md5
        if not (sha or md5):
            log.warning("%s: no known checksum; recording its sha256 only", archive.relpath)
        local, got_sha, size = fetch(uri, ctx.cfg.run.work_dir, d.download_timeout_s, sha256=sha, md5=md5)
        num_bytes += size
        users = [c for c in corpora if c.archive.url == archive.url]
        # Gzip members (Giga) are stored decompressed: plain text can be cut into parallel segments.
        wanted = {c.members[lang]: storage.join(out_dir, c.split, c.name, c.members[lang].rsplit("/", 1)[-1]
                                                .removesuffix(".gz"))
                  for c in users for lang in (d.src_lang, d.tgt_lang)}
        extract_members(local, archive.relpath, wanted)
        outputs["archives"].append({"url": uri, "sha256": got_sha, "bytes": size})
        for c in users:
            entry = {"corpus": c.name, "src": wanted[c.members[d.src_lang]], "tgt": wanted[c.members[d.tgt_lang]]}
            if c.split == "train":
                outputs["train"].append(entry)
            else:
                outputs[c.split] = entry
    return outputs, num_bytes


def _multi30k(ctx: StageContext) -> tuple[dict[str, Any], int]:
    d = ctx.cfg.data
    out_dir = storage.absolute(ctx.out_dir)
    outputs: dict[str, Any] = {"train": [], "dev": None, "test": None, "files": []}
    num_bytes = 0
    for pair in sources.multi30k(d.src_lang, d.tgt_lang):
        entry = {"corpus": pair.name}
        for side, lang in (("src", d.src_lang), ("tgt", d.tgt_lang)):
            f = pair.files[lang]
            uri = sources.location(f, d.mirror)
            local, got_sha, size = fetch(uri, ctx.cfg.run.work_dir, d.download_timeout_s, sha256=f.sha256)
            dest = storage.join(out_dir, pair.split, pair.name, f.relpath.rsplit("/", 1)[-1].removesuffix(".gz"))
            copy_text_file(local, dest)
            num_bytes += size
            outputs["files"].append({"url": uri, "sha256": got_sha, "bytes": size})
            entry[side] = dest
        if pair.split == "train":
            outputs["train"].append(entry)
        else:
            outputs[pair.split] = entry
    return outputs, num_bytes


def _custom_file(src: str, dest_stem: str, ctx: StageContext) -> tuple[str, int]:
    """Copy one user file (decompressing ``.gz``); an ``.sgm`` keeps its suffix (format by suffix)."""
    d = ctx.cfg.data
    name = src.rstrip("/").rsplit("/", 1)[-1]
    plain = name[:-3] if name.endswith(".gz") else name
    dest = dest_stem + (".sgm" if plain.endswith(".sgm") else "")
    readable = src if is_http(src) else storage.absolute(src)
    readable, _, size = fetch(readable, ctx.cfg.run.work_dir, d.download_timeout_s)
    copy_text_file(readable, dest)
    return dest, size


def _custom(ctx: StageContext) -> tuple[dict[str, Any], int]:
    d = ctx.cfg.data
    base = storage.join(storage.absolute(ctx.out_dir), "custom")
    outputs: dict[str, Any] = {"train": [], "dev": None, "test": None}
    num_bytes = 0

    def pair(corpus: str, src: str, tgt: str) -> dict[str, str]:
        nonlocal num_bytes
        s, n1 = _custom_file(src, storage.join(base, f"{corpus}.src"), ctx)
        t, n2 = _custom_file(tgt, storage.join(base, f"{corpus}.tgt"), ctx)
        num_bytes += n1 + n2
        return {"corpus": corpus, "src": s, "tgt": t, "from": [src, tgt]}

    if len(d.train_src) != len(d.train_tgt):
        raise DataError("data.train_src and data.train_tgt must list the same number of files")
    for i, (s, t) in enumerate(zip(d.train_src, d.train_tgt)):
        outputs["train"].append(pair(f"train{i}", s, t))
    outputs["dev"] = pair("dev", d.dev_src, d.dev_tgt)
    outputs["test"] = pair("test", d.test_src, d.test_tgt)
    return outputs, num_bytes
