"""The Ray Serve app on 127.0.0.1 (the test session's local Ray): good and bad requests, all answered.

The tiny trained model (tests/integration/conftest.py) behind ``POST /translate``: translations
equal the ``Translator``'s for the same sentences; concurrent clients are all answered; each kind
of bad input gets a 4xx naming the problem, and the replica keeps serving afterwards.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.procs import free_port

pytestmark = pytest.mark.slow

MAX_SENTENCES, MAX_CHARS, MAX_LEN_B = 4, 4000, 20


def _post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


@pytest.fixture(scope="module")
def server(tiny_model, ray_local):
    from ray import serve

    from pipeline.serve.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app({"model_dir": tiny_model["model_dir"], "spm": tiny_model["spm"], "beam_size": "2",
                     "max_len_b": str(MAX_LEN_B), "max_sentences_per_request": str(MAX_SENTENCES),
                     "max_sentence_chars": str(MAX_CHARS), "max_batch_size": "8"})
    serve.run(app, name="translation", route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def test_good_requests_are_translated_like_the_translator_does(server, tiny_model, wmt14_dir):
    from pipeline.evaluate.translate import Translator

    en = (wmt14_dir / "newstest2014.en").read_text(encoding="utf-8").splitlines()[:3]
    status, out = _post(f"{server}/translate", _json({"text": [en[0], "", en[1], en[2]]}))
    assert status == 200, out
    tr = Translator(tiny_model["model"], tiny_model["model_config"], tiny_model["spm"],
                    {"beam_size": 2, "alpha": 0.6, "max_len_a": 1.0, "max_len_b": MAX_LEN_B})
    expected = tr.translate_ids([tr.sp.encode(s) + [3] for s in en])
    assert out["translations"] == [expected[0], "", expected[1], expected[2]]
    with urllib.request.urlopen(f"{server}/health", timeout=30) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"


def test_concurrent_clients_are_all_answered(server, wmt14_dir):
    en = (wmt14_dir / "newstest2014.en").read_text(encoding="utf-8").splitlines()[:24]
    bodies = [_json({"text": en[i: i + 3]}) for i in range(0, 24, 3)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: _post(f"{server}/translate", b), bodies))
    assert [s for s, _ in answers] == [200] * len(bodies)
    assert all(len(a["translations"]) == 3 for _, a in answers)


@pytest.mark.parametrize("body, status, words", [
    (b'{"text": ["a", ', 400, "not valid JSON"),
    (b'{"text": ["caf\xe9"]}', 400, "not valid UTF-8"),
    (_json(["just", "a", "list"]), 422, '{"text"'),
    (_json({"sentences": ["a"]}), 422, '{"text"'),
    (_json({"text": "one string"}), 422, "must be a list of strings, got str"),
    (_json({"text": ["ok", 7]}), 422, '"text"[1] is a int'),
    (_json({"text": []}), 422, "empty list"),
    (_json({"text": ["a"] * (MAX_SENTENCES + 1)}), 413, f"at most {MAX_SENTENCES} per request"),
    (_json({"text": ["ok", "x" * (MAX_CHARS + 1)]}), 413, f'"text"[1] has {MAX_CHARS + 1} characters'),
    (_json({"text": ["ok", "word " * 700]}), 413, '"text"[1] is'),  # within the chars, over the pieces
])
def test_bad_input_gets_a_4xx_naming_it_and_the_replica_keeps_serving(server, body, status, words):
    got, out = _post(f"{server}/translate", body)
    assert got == status and words in out["detail"], out
    good, answer = _post(f"{server}/translate", _json({"text": ["Hello."]}))
    assert good == 200 and len(answer["translations"]) == 1
