"""The Ray Serve app on 127.0.0.1 (the test session's local Ray): good and bad requests, all answered.

The tiny trained model (tests/integration/conftest.py) behind ``POST /translate``: translations
equal the ``Translator``'s for the same sentences; concurrent clients each get their own
sentences translated (no cross-talk between requests batched together); each kind
of bad input gets a 4xx naming the problem, and the replica keeps serving afterwards. The same
model served from a config's DAG plan on an ``s3://`` work dir (the suite's moto server) and from
a Model Registry version answers the same; an overloaded replica answers 503 with Retry-After.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.procs import free_port
from tests.support.s3 import s3, s3_module  # noqa: F401 - fixtures

# The bound on each test (pytest-timeout): a Ray Serve application starts here first.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_SENTENCES, MAX_CHARS, MAX_LEN_B, MAX_BYTES = 4, 4000, 20, 16384


def _post(url: str, body, headers: dict | None = None, with_headers: bool = False):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, answer, got = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        status, answer, got = e.code, e.read(), e.headers
    try:
        answer = json.loads(answer)
    except json.JSONDecodeError:
        answer = {"detail": answer.decode(errors="replace")}
    return (status, answer, got) if with_headers else (status, answer)


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
                     "max_sentence_chars": str(MAX_CHARS), "max_batch_size": "8",
                     "max_request_bytes": str(MAX_BYTES)})
    serve.run(app, name="translation", route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def test_good_requests_are_translated_like_the_translator_does(server, tiny_model, wmt14_dir):
    from pipeline.decoding.translator import Translator

    en = (wmt14_dir / "newstest2014.en").read_text(encoding="utf-8").splitlines()[:3]
    status, out = _post(f"{server}/translate", _json({"text": [en[0], "", en[1], en[2]]}))
    assert status == 200, out
    tr = Translator(tiny_model["model"], tiny_model["model_config"], tiny_model["spm"],
                    {"beam_size": 2, "alpha": 0.6, "max_len_a": 1.0, "max_len_b": MAX_LEN_B})
    expected = tr.translate_ids([tr.sp.encode(s) + [3] for s in en])
    assert out["translations"] == [expected[0], "", expected[1], expected[2]]
    with urllib.request.urlopen(f"{server}/health", timeout=30) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"


def test_concurrent_clients_each_get_their_own_sentences_translated(server, tiny_model, wmt14_dir):
    """Cross-talk: 16 clients at once, different sentences and counts (1-4), batched together by
    ``@serve.batch`` (max 8 sentences a batch); each answer must be its own sentences, in its order,
    translated as the Translator translates each sentence alone."""
    from pipeline.decoding.translator import Translator

    en = (wmt14_dir / "newstest2014.en").read_text(encoding="utf-8").splitlines()[100:140]
    requests, i = [], 0
    for n in [1, 2, 3, 4] * 4:
        requests.append(en[i: i + n])
        i = (i + n) % (len(en) - 4)
    tr = Translator(tiny_model["model"], tiny_model["model_config"], tiny_model["spm"],
                    {"beam_size": 2, "alpha": 0.6, "max_len_a": 1.0, "max_len_b": MAX_LEN_B})
    alone = {s: tr.translate_ids([tr.sp.encode(s) + [3]])[0] for s in {s for r in requests for s in r}}
    assert len(set(alone.values())) > len(alone) // 2, "the tiny model's outputs should differ by input"
    def client(sentences: list[str]) -> tuple[int, dict]:
        """A well-behaved client: on 503 (the replica's backpressure) it waits Retry-After and retries."""
        for _ in range(10):
            status, answer, headers = _post(f"{server}/translate", _json({"text": sentences}), with_headers=True)
            if status != 503:
                break
            time.sleep(float(headers.get("Retry-After", "1")))
        return status, answer

    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(client, requests))
    assert [s for s, _ in answers] == [200] * len(requests), answers
    for sentences, (_, answer) in zip(requests, answers):
        assert answer["translations"] == [alone[s] for s in sentences], sentences


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
    # The kinds that used to be 500s, and the rest of pipeline/serve/request.py's list:
    (b"[" * 5000 + b"]" * 5000, 400, "nested deeper than 4 levels"),
    (b'{"text": [[[[["a"]]]]]}', 400, "nested 6 levels deep"),
    (b'{"text": ["ok", "\\ud800"]}', 422, '"text"[1] holds a lone surrogate (U+D800'),
    (b'{"text": [NaN]}', 400, "NaN is not JSON"),
    (b'{"text": ["a"], "x": Infinity}', 400, "Infinity is not JSON"),
    (b'{"text": ["a"], "x": 1e400}', 400, "out of range"),
    (b'{"text": ["a"], "x": ' + b"9" * 5000 + b"}", 400, "not acceptable JSON"),
    (b'{"text": ["a"], "text": ["b"]}', 400, "duplicate key 'text'"),
    (_json({"text": ["a"], "beam": 100}), 422, "unknown key(s) in the request body: 'beam'"),
    (_json({"text": ["a" * 10] * 3, "pad": "x" * MAX_BYTES}), 413, f"(Content-Length); at most {MAX_BYTES}"),
])
def test_bad_input_gets_a_4xx_naming_it_and_the_replica_keeps_serving(server, body, status, words):
    got, out = _post(f"{server}/translate", body)
    assert got == status and words in out["detail"], out
    good, answer = _post(f"{server}/translate", _json({"text": ["Hello."]}))
    assert good == 200 and len(answer["translations"]) == 1


def _chunks(n: int):
    yield b'{"text": ["'
    for _ in range(n):
        yield b"x" * 1024
    yield b'"]}'


def test_a_body_without_content_length_is_refused_while_streaming(server):
    got, out = _post(f"{server}/translate", _chunks(4 * MAX_BYTES // 1024))  # urllib sends it chunked
    assert got == 413 and f"over {MAX_BYTES} bytes (stopped reading at" in out["detail"], out
    good, answer = _post(f"{server}/translate", iter([b'{"text": ', b'["Hello."]}']))  # a small chunked body is fine
    assert good == 200 and len(answer["translations"]) == 1


def _deploy(name: str, args: dict) -> str:
    """Another app on the running Serve instance, under /<name>; 0.5 CPU (the session's Ray has 2)."""
    from ray import serve

    from pipeline.serve.app import build_app

    serve.run(build_app({"num_cpus_per_replica": "0.5", **args}), name=name, route_prefix=f"/{name}")
    return name


def _same_answers(server: str, name: str, wmt14_dir) -> None:
    en = (wmt14_dir / "newstest2014.en").read_text(encoding="utf-8").splitlines()[:3]
    want = _post(f"{server}/translate", _json({"text": en}))
    got = _post(f"{server}/{name}/translate", _json({"text": en}))
    assert got == want and want[0] == 200


def test_serve_a_config_from_an_s3_work_dir(server, s3, tiny_model, wmt14_dir):  # noqa: F811
    from ray import serve

    from pipeline import storage
    from pipeline.config import load_config
    from tests.support.fake_run import fake_run

    work_dir = s3.uri("serve-wd")
    for name in ("model.pt", "model_config.json"):
        storage.upload(f"{tiny_model['model_dir']}/{name}", s3.uri("serve-wd", "avg", name))
    storage.upload(tiny_model["spm"], s3.uri("serve-wd", "spm.model"))
    cfg = load_config("configs/local.toml", [f"--run.work_dir={work_dir}"])
    fake_run(cfg, {"vocab": {"model": s3.uri("serve-wd", "spm.model")},
                   "average": {"model": s3.uri("serve-wd", "avg", "model.pt"),
                               "model_config": tiny_model["model_config"]}}, to="average")
    args = {"config": "configs/local.toml", "work_dir": work_dir, "beam_size": "2", "max_len_b": str(MAX_LEN_B)}
    try:
        _same_answers(server, _deploy("s3", args), wmt14_dir)
        with urllib.request.urlopen(f"{server}/s3/health", timeout=30) as r:
            assert "config configs/local.toml (average " in json.loads(r.read())["origin"]
    finally:
        serve.delete("s3")
    from pipeline.serve.app import build_app
    from pipeline.models import ModelNotFound

    with pytest.raises(ModelNotFound, match="stage 'train' has not finished"):  # another model size: not trained
        build_app({**args, "overrides": "--model.d_ff=96"})


def test_serve_a_registry_version(server, tiny_model, tiny_export, tmp_path, wmt14_dir):
    from ray import serve

    from tests.support.registered import NAME, register_tiny

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    version = register_tiny(uri, tiny_model, tiny_export, tmp_path)["version"]
    from mlflow import MlflowClient

    MlflowClient(uri, registry_uri=uri).set_registered_model_alias(NAME, "champion", version)
    args = {"model": f"models:/{NAME}@champion", "tracking_uri": uri, "beam_size": "2", "max_len_b": str(MAX_LEN_B)}
    try:
        _same_answers(server, _deploy("registry", args), wmt14_dir)
    finally:
        serve.delete("registry")


def test_an_overloaded_replica_answers_503_with_retry_after(server, tiny_model, wmt14_dir):
    from ray import serve

    en = (wmt14_dir / "newstest2014.en").read_text(encoding="utf-8").splitlines()[:4]
    args = {"model_dir": tiny_model["model_dir"], "spm": tiny_model["spm"], "max_batch_size": "1",
            "max_ongoing_requests": "1", "max_queued_requests": "1", "retry_after_s": "2"}
    name = _deploy("tight", args)
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: _post(f"{server}/{name}/translate", _json({"text": en}),
                                                    with_headers=True), range(8)))
        statuses = sorted(a[0] for a in answers)
        assert set(statuses) <= {200, 503} and statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
        assert all(h["Retry-After"] == "2" for st, _, h in answers if st == 503)
        assert _post(f"{server}/{name}/translate", _json({"text": en[:1]}))[0] == 200  # and it serves on
    finally:
        serve.delete(name)
