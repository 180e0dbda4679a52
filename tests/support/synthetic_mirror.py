"""A statmt.org-shaped mirror of generated text, for the tests whose point is not the real text.

Crash recovery, the job on a cluster, Table 3's scheduling: what they prove is the plumbing (kills,
resumes, caches, placement), which any parallel text exercises. They read this mirror, written in
seconds from a seed, so they run on a clone without ``../shared`` and never skip. The tests whose
point is the real text (cleaning, the SGML test set, BLEU against published numbers) keep reading
the offline mirror of real WMT data (tests/conftest.py: ``mirror_dir``).

The layout is the one pipeline/data/sources.py names for EN-DE (its archives and members, with a
``SHA256SUMS``; tests/unit/data/test_sources.py holds the registry to the real mirror's layout).
The text is a toy language pair: English sentences from a small grammar with invented names, and
their "German", word by word through a fixed dictionary (names unchanged), so a tiny model learns it
within the tests' few dozen steps.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import random
import tarfile
from pathlib import Path

# (English, "German") word pairs; names are made of SYLLABLES and kept as they are.
WORDS = {
    "det": [("the", "die"), ("a", "eine"), ("every", "jede"), ("this", "diese")],
    "adj": [("big", "grosse"), ("small", "kleine"), ("red", "rote"), ("old", "alte"), ("new", "neue"),
            ("quiet", "ruhige"), ("green", "gruene"), ("dark", "dunkle")],
    "noun": [("house", "Haus"), ("city", "Stadt"), ("river", "Fluss"), ("road", "Strasse"), ("book", "Buch"),
             ("garden", "Garten"), ("train", "Zug"), ("bridge", "Bruecke"), ("market", "Markt"),
             ("school", "Schule")],
    "verb": [("sees", "sieht"), ("finds", "findet"), ("builds", "baut"), ("sells", "verkauft"),
             ("visits", "besucht"), ("paints", "malt")],
    "prep": [("near", "nahe"), ("behind", "hinter"), ("in", "in"), ("under", "unter")],
}
SYLLABLES = ["ka", "lo", "mi", "ten", "ru", "sa", "vel", "dor", "an", "pi", "zu", "mer"]
def sentence_pair(rng: random.Random) -> tuple[str, str]:
    """One English sentence of the grammar and its word-by-word "German"."""
    name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()

    def phrase() -> list[tuple[str, str]]:
        words = [rng.choice(WORDS["det"])]
        if rng.random() < 0.6:
            words.append(rng.choice(WORDS["adj"]))
        return words + [rng.choice(WORDS["noun"])]

    words = [(name, name)] if rng.random() < 0.4 else phrase()
    words += [rng.choice(WORDS["verb"]), *phrase()]
    if rng.random() < 0.5:
        words += [rng.choice(WORDS["prep"]), *phrase()]
    en, de = (" ".join(w[i] for w in words) for i in (0, 1))
    return en[0].upper() + en[1:] + " .", de[0].upper() + de[1:] + " ."


def _tgz(path: Path, members: dict[str, bytes]) -> None:
    """A .tgz of ``members``, byte for byte the same every time (fixed mtimes, tar's and gzip's)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_388_534_400  # 2014-01-01
            tar.addfile(info, io.BytesIO(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(buf.getvalue(), mtime=0))


def _lines(pairs: list[tuple[str, str]], side: int) -> bytes:
    return "".join(p[side] + "\n" for p in pairs).encode()


def _sgml(pairs: list[tuple[str, str]], side: int, lang: str) -> bytes:
    """WMT's "fake SGML": one <seg> per line inside a <doc> (source side: srcset, reference: refset)."""
    tag = "srcset" if side == 0 else "refset"
    segs = "".join(f'<seg id="{i}">{p[side]}</seg>\n' for i, p in enumerate(pairs, 1))
    return (f'<{tag} setid="newstest2014" srclang="any" trglang="{lang}">\n<doc docid="synthetic" '
            f'genre="news" origlang="en">\n{segs}</doc>\n</{tag}>\n').encode()


def write_mirror(root: Path, pairs_per_corpus: int = 2000, dev_pairs: int = 300, test_pairs: int = 300,
                 seed: int = 0) -> Path:
    """Write the EN-DE archives the registry names (pipeline/data/sources.py) under ``root``, with
    its SHA256SUMS: the same bytes for the same arguments. Returns ``root``."""
    from pipeline.data import sources

    rng = random.Random(seed)
    archives: dict[str, dict[str, bytes]] = {}
    for corpus in sources.wmt14_en_de():
        n = {"train": pairs_per_corpus, "dev": dev_pairs, "test": test_pairs}[corpus.split]
        pairs = [sentence_pair(rng) for _ in range(n)]
        members = archives.setdefault(corpus.archive.relpath, {})
        for lang, member in corpus.members.items():
            side = 0 if lang == "en" else 1
            text = _sgml(pairs, side, lang) if member.endswith(".sgm") else _lines(pairs, side)
            members["./" + member] = text
    for rel, members in archives.items():
        _tgz(root / rel, members)
    sums = [f"{hashlib.sha256((root / rel).read_bytes()).hexdigest()}  ./{rel}" for rel in sorted(archives)]
    (root / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    return root
