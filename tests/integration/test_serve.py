"""The Ray Serve app on 127.0.0.1 (the test session's local Ray): good and bad requests, all answered.

The tiny model trained on the toy language (tests/conftest.py) behind ``POST /translate``: translations
equal the ``Translator``'s for the same sentences; concurrent clients each get their own
sentences translated (no cross-talk between requests batched together); each kind
of bad input gets a 4xx naming the problem, and the replica keeps serving afterwards. The same
model served from a config's DAG plan on an ``s3://`` work dir (the suite's moto server) and from
a Model Registry version answers the same; an overloaded replica answers 503 with Retry-After.
The page, in a headless Chromium: the translation and heatmaps are the API's, and a clicked row's
step view (q, keys, scores, softmax with and without sqrt(d_k)) shows the API's numbers.
"""

from __future__ import annotations

import json
import math
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
# 150 pieces of the tiny model's vocabulary ("▁house" is one): over the 128 the attention view
# takes (max_attention_pieces), within the 235 the model takes.
LONG_FOR_ATTENTION = "house " * 150


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


def _explain(**change) -> bytes:
    """An "explain" request for the first row of cross-attention's layer 0, head 0 (every sentence has
    it), with `change` to its fields."""
    return _json({"text": ["a dog ."], "explain": {"kind": "cross", "layer": 0, "head": 0, "query": 0, **change}})


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


def test_good_requests_are_translated_like_the_translator_does(server, tiny_model):
    from pipeline.decoding.translator import Translator

    en = tiny_model["test_en"][:3]
    status, out = _post(f"{server}/translate", _json({"text": [en[0], "", en[1], en[2]]}))
    assert status == 200, out
    tr = Translator(tiny_model["model"], tiny_model["model_config"], tiny_model["spm"],
                    {"beam_size": 2, "alpha": 0.6, "max_len_a": 1.0, "max_len_b": MAX_LEN_B})
    expected = tr.translate_ids([tr.sp.encode(s) + [3] for s in en])
    assert out["translations"] == [expected[0], "", expected[1], expected[2]]
    with urllib.request.urlopen(f"{server}/health", timeout=30) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"


def test_concurrent_clients_each_get_their_own_sentences_translated(server, tiny_model):
    """Cross-talk: 16 clients at once, different sentences and counts (1-4), batched together by
    ``@serve.batch`` (max 8 sentences a batch); each answer must be its own sentences, in its order,
    translated as the Translator translates each sentence alone."""
    from pipeline.decoding.translator import Translator

    en = tiny_model["test_en"][100:140]
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
    # The page's options: attention for one sentence of a bounded length, the limits named.
    (_json({"text": ["a", "b"], "attention": True}), 422, "one sentence per request; this one has 2"),
    (_json({"text": [LONG_FOR_ATTENTION], "attention": True}), 413, "at most 128 pieces (eos included; max_attention_pieces)"),
    (_json({"text": ["   "], "attention": True}), 422, "needs a sentence with some text"),
    (_json({"text": [""], "attention": True}), 422, "needs a sentence with some text"),
    (_json({"text": ["a\u0000b"]}), 422, '"text"[0] holds a control character (U+0000'),
    (_json({"text": ["x" * 10_000]}), 413, '"text"[0] has 10000 characters'),
    (_json({"text": ["a"], "beam_size": 99}), 422, "from 1 to 8 (this server's max_beam_size)"),
    # "explain"'s index types beyond test_bad_explain_requests_are_refused_by_name's: negative, a bool, a string.
    (_explain(head=-1), 422, '"explain"."head" must be an integer from 0, got -1'),
    (_explain(query=True), 422, '"explain"."query" must be an integer from 0, got True'),
    (_explain(layer="0"), 422, '"explain"."layer" must be an integer from 0, got \'0\''),
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


def _same_answers(server: str, name: str, en: list[str]) -> None:
    want = _post(f"{server}/translate", _json({"text": en}))
    got = _post(f"{server}/{name}/translate", _json({"text": en}))
    assert got == want and want[0] == 200


def test_serve_a_config_from_an_s3_work_dir(server, s3, tiny_model):  # noqa: F811
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
        _same_answers(server, _deploy("s3", args), tiny_model["test_en"][:3])
        with urllib.request.urlopen(f"{server}/s3/health", timeout=30) as r:
            assert "config configs/local.toml (average " in json.loads(r.read())["origin"]
    finally:
        serve.delete("s3")
    from pipeline.serve.app import build_app
    from pipeline.models import ModelNotFound

    with pytest.raises(ModelNotFound, match="stage 'train' has not finished"):  # another model size: not trained
        build_app({**args, "overrides": "--model.d_ff=96"})


def test_serve_a_registry_version(server, tiny_model, tiny_export, tmp_path):
    from ray import serve

    from tests.support.registered import NAME, register_tiny

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    version = register_tiny(uri, tiny_model, tiny_export, tmp_path)["version"]
    from mlflow import MlflowClient

    MlflowClient(uri, registry_uri=uri).set_registered_model_alias(NAME, "champion", version)
    args = {"model": f"models:/{NAME}@champion", "tracking_uri": uri, "beam_size": "2", "max_len_b": str(MAX_LEN_B)}
    try:
        _same_answers(server, _deploy("registry", args), tiny_model["test_en"][:3])
        with urllib.request.urlopen(f"{server}/registry/health", timeout=30) as r:  # what the page states
            info = json.loads(r.read())
        assert info["origin"] == f"models:/{NAME}@champion"
        assert info["scores"] == {"test": {"bleu_sacre": 1.5, "chrf": 20.25}}  # the register stage's tags
    finally:
        serve.delete("registry")


def test_an_overloaded_replica_answers_503_with_retry_after(server, tiny_model):
    from ray import serve

    en = tiny_model["test_en"][:4]
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


def test_attention_is_the_score_stages_function_and_rows_sum_to_one(server, tiny_model):
    """`"attention": true` returns what `pipeline.decoding.attention_maps.translation_attention` (the
    score report's heatmaps) gives for the same model, sentence and translation, exactly."""
    import sentencepiece as spm
    import torch

    from pipeline.decoding.attention_maps import translation_attention
    from pipeline.decoding.translator import load_model

    sentence = tiny_model["test_en"][5]
    status, out = _post(f"{server}/translate", _json({"text": [sentence], "attention": True}))
    assert status == 200, out
    plain = _post(f"{server}/translate", _json({"text": [sentence]}))[1]
    assert out["translations"] == plain["translations"] and "attention" not in plain  # the same translation
    sp = spm.SentencePieceProcessor(model_file=tiny_model["spm"])
    model = load_model(tiny_model["model"], tiny_model["model_config"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the replica's (num_cpus_per_replica): a product's last bits depend on the count
    try:
        want = translation_attention(model, sp, sp.encode(sentence), out["translations"][0]).to_json()
    finally:
        torch.set_num_threads(threads)
    assert out["attention"] == want
    att = out["attention"]
    S, T, L = len(att["src_pieces"]), len(att["tgt_pieces"]), model.cfg.n_decoder_layers
    shapes = {"encoder_self": (S, S), "decoder_self": (T, T), "cross": (T, S)}
    for kind, (rows, cols) in shapes.items():
        maps = att[kind]
        assert (len(maps), len(maps[0]), len(maps[0][0]), len(maps[0][0][0])) == (L, model.cfg.n_heads, rows, cols)
        assert all(abs(sum(r) - 1.0) < 1e-5 for layer in maps for head in layer for r in head)


def test_explain_opens_a_row_of_the_served_attention(server, tiny_model):
    """`"explain"` returns the row of `"attention"`'s map it names, exactly, from the same translation;
    on this trained model leaving out 1/sqrt(d_k) makes every row with two or more keys more peaked."""
    import math

    import sentencepiece as spm

    from pipeline.decoding.attention_explain import explain_attention
    from pipeline.decoding.translator import load_model

    sentence = tiny_model["test_en"][5]
    for kind, layer, head, query in (("cross", 1, 2, 1), ("decoder_self", 0, 3, 2), ("encoder_self", 1, 0, 4)):
        ask = {"kind": kind, "layer": layer, "head": head, "query": query}
        status, out = _post(f"{server}/translate", _json({"text": [sentence], "attention": True, "explain": ask}))
        assert status == 200, out
        e = out["explanation"]
        assert {k: e[k] for k in ask} == ask
        assert e["weights"] == out["attention"][kind][layer][head][query]
        keys = out["attention"]["tgt_pieces" if kind == "decoder_self" else "src_pieces"]
        assert e["key_pieces"] == keys and len(e["keys"]) == len(e["values"]) == len(keys)
        assert e["entropy"]["unscaled"] < e["entropy"]["scaled"]
        label = out["attention"]["heads"][kind][layer][head]["label"]
        assert label.split(":")[0] in ("mostly attends to the same piece", "mostly attends to the previous piece",
                                       "mostly attends to the next piece", "mostly attends to the first piece",
                                       "mostly attends to the last piece", "follows the source in order") \
            or label.startswith(("mostly attends to the piece", "spreads its weight")), label
    sp = spm.SentencePieceProcessor(model_file=tiny_model["spm"])
    model = load_model(tiny_model["model"], tiny_model["model_config"])
    hypothesis = out["translations"][0]
    for kind in ("encoder_self", "decoder_self", "cross"):
        n_rows = len(out["attention"]["src_pieces" if kind == "encoder_self" else "tgt_pieces"])
        for query in range(n_rows):
            e = explain_attention(model, sp, sp.encode(sentence), hypothesis, kind, 1, 1, query)
            if sum(e["mask"]) > 1:
                assert e["entropy"]["unscaled"] < e["entropy"]["scaled"], (kind, query)
            assert math.isclose(sum(e["weights"]), 1.0, rel_tol=1e-5)


def test_bad_explain_requests_are_refused_by_name(server, tiny_model):
    sentence = tiny_model["test_en"][5]
    good = {"kind": "cross", "layer": 0, "head": 0, "query": 0}
    cases = [
        ({**good, "layer": 2}, 422, '"layer" 2 is out of range: there are 2 the model\'s cross layers'),
        ({**good, "head": 4}, 422, '"head" 4 is out of range: there are 4 heads'),
        ({**good, "kind": "encoder_self", "query": 500}, 422, '"query" 500 is out of range'),
        ({**good, "query": 500}, 422, '"query" 500 is out of range'),  # found once the translation is known
        ({**good, "head": 0.5}, 422, '"explain"."head" must be an integer'),
        ({**good, "kind": "self"}, 422, '"explain"."kind" must be one of'),
    ]
    for ask, status, words in cases:
        got = _post(f"{server}/translate", _json({"text": [sentence], "explain": ask}))
        assert got[0] == status and words in got[1]["detail"], (ask, got)
    got = _post(f"{server}/translate", _json({"text": [sentence, sentence], "explain": good}))
    assert got[0] == 422 and "one sentence per request" in got[1]["detail"], got
    got = _post(f"{server}/translate", _json({"text": [LONG_FOR_ATTENTION], "explain": good}))
    assert got[0] == 413 and '"explain" is given for sentences of at most 128 pieces' in got[1]["detail"], got
    assert _post(f"{server}/translate", _json({"text": [sentence], "explain": good}))[0] == 200  # and it serves on


def test_a_request_may_set_its_beam_and_alpha_within_the_limits(server, tiny_model):
    from pipeline.decoding.translator import Translator

    en = tiny_model["test_en"][6:8]
    status, out = _post(f"{server}/translate", _json({"text": en, "beam_size": 1, "alpha": 1.0}))
    assert status == 200, out
    greedy = Translator(tiny_model["model"], tiny_model["model_config"], tiny_model["spm"],
                        {"beam_size": 1, "alpha": 1.0, "max_len_a": 1.0, "max_len_b": MAX_LEN_B})
    assert out["translations"] == greedy.translate_ids([greedy.sp.encode(s) + [3] for s in en])


def test_the_page_is_served_self_contained(server):
    with urllib.request.urlopen(f"{server}/", timeout=30) as r:
        page = r.read().decode()
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
    assert 'id="translate"' in page and 'fetch("translate"' in page
    assert "http://" not in page and "https://" not in page and "<link" not in page  # nothing from elsewhere
    with urllib.request.urlopen(f"{server}/health", timeout=30) as r:
        info = json.loads(r.read())
    assert info["max_beam_size"] == 8 and info["max_attention_pieces"] == 128 and info["model_config"]["n_heads"] == 4


def _browser():
    """Headless Chromium driven by Selenium, or a skip saying why there is none (.ci/run installs it)."""
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip(f"NO BROWSER HERE: chromium={chromium}, chromedriver={driver}; .ci/run installs Debian's chromium "
                    "and chromium-driver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1000"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=opts)


@pytest.fixture(scope="module")
def browser():
    b = _browser()
    try:
        yield b
    finally:
        b.quit()


def _wait(browser, predicate, timeout_s: float = 60.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout_s).until(lambda d: predicate(d))


def test_the_page_translates_and_draws_the_apis_attention(server, browser, tiny_model, tmp_path):
    """A real browser: type, click Translate; the translation shown is the API's, and the heatmap's
    cells for one head are the API's weights."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    sentence = tiny_model["test_en"][9]
    api = _post(f"{server}/translate", _json({"text": [sentence], "attention": True}))[1]
    browser.get(f"{server}/")
    _wait(browser, lambda d: "Model:" in d.find_element(By.ID, "model").text)
    assert "d_model 64, 4 heads" in browser.find_element(By.ID, "model").text
    browser.find_element(By.ID, "source").send_keys(sentence)
    browser.find_element(By.ID, "translate").click()
    _wait(browser, lambda d: d.find_element(By.ID, "translation").text.strip() != "")
    assert browser.find_element(By.ID, "translation").text == api["translations"][0].strip()
    Select(browser.find_element(By.ID, "kind")).select_by_value("cross")
    Select(browser.find_element(By.ID, "layer")).select_by_value("1")
    Select(browser.find_element(By.ID, "head")).select_by_value("2")
    cells = browser.execute_script(
        "return [...document.querySelectorAll('#heatmap td.cell')]"
        ".map(c => [+c.dataset.row, +c.dataset.col, c.dataset.w])")
    want = api["attention"]["cross"][1][2]
    assert len(cells) == len(want) * len(want[0])
    assert all(float(w) == want[r][c] for r, c, w in cells)  # the double the API sent, as JS printed it
    labels = browser.execute_script("return [...document.querySelectorAll('#heatmap th.col')].map(t => t.textContent)")
    assert labels == api["attention"]["src_pieces"]
    Select(browser.find_element(By.ID, "head")).select_by_value("all")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#grid .mini canvas")) == 4
    browser.save_screenshot(str(tmp_path / "page.png"))


def test_the_page_names_the_limit_a_sentence_breaks(server, browser):
    from selenium.webdriver.common.by import By

    browser.get(f"{server}/")
    _wait(browser, lambda d: "Model:" in d.find_element(By.ID, "model").text)
    browser.find_element(By.ID, "source").send_keys(LONG_FOR_ATTENTION)
    browser.find_element(By.ID, "translate").click()
    _wait(browser, lambda d: d.find_element(By.ID, "error").text != "")
    assert browser.find_element(By.ID, "error").text.startswith("413: ")
    assert "at most 128 pieces" in browser.find_element(By.ID, "error").text


def test_make_serve_opens_the_page_on_the_last_runs_model(server, browser, tiny_model, tmp_path):
    """`make serve` after a run: the Makefile's own command line, given nothing but the record the
    run's driver wrote (`reproduce_base.py --record`), serves the run's model; no override is
    repeated, though the run's --data.mirror is in its keys (the config alone names no model). The
    page at the address Ray Serve prints opens on that model and translates. With no record,
    `make serve` names what to run first. (On the test session's Ray and Serve: RAY_ADDRESS, and
    `serve run`'s own --non-blocking, --name and --route-prefix through SERVE_ARGS.)"""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    import ray
    from ray import serve
    from selenium.webdriver.common.by import By

    from pipeline import run_record
    from pipeline.config import load_config
    from pipeline.models import ModelNotFound, find_model
    from tests.support.fake_run import fake_run

    repo, record = Path(__file__).resolve().parents[2], tmp_path / "last-run.json"
    overrides = [f"--run.work_dir={tmp_path / 'work'}", f"--data.mirror={tmp_path / 'mirror'}"]
    cfg = load_config("configs/local.toml", overrides)
    fake_run(cfg, {"vocab": {"model": tiny_model["spm"]},
                   "average": {"model": tiny_model["model"], "model_config": tiny_model["model_config"]}}, to="average")
    with pytest.raises(ModelNotFound, match="stage 'download' has not finished"):
        find_model(config=["configs/local.toml"], work_dir=str(tmp_path / "work"))
    run_record.write(str(record), cfg, ["configs/local.toml"], overrides)  # what the driver's --record writes

    make = ["make", "-o", "install", "serve", f"VENV={sys.prefix}"]  # this venv, installed already
    none = subprocess.run([*make, f"RUN_RECORD={tmp_path / 'none.json'}"], cwd=repo, capture_output=True, text=True)
    assert none.returncode == 2 and "run make run (minutes) or make multi30k first" in none.stderr, none.stderr
    args = "num_cpus_per_replica=0.5 max_len_b=20 --non-blocking --name=make-serve --route-prefix=/make-serve"
    done = subprocess.run([*make, f"RUN_RECORD={record}", f"SERVE_ARGS={args}"], cwd=repo, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address})
    out = done.stdout + done.stderr
    try:
        assert done.returncode == 0, out[-4000:]
        page = re.search(r"Application 'make-serve' is ready at (http://\S+)\.$", out, re.M)[1] + "/"
        with urllib.request.urlopen(f"{page}health", timeout=30) as r:
            origin = json.loads(r.read())["origin"]
        assert origin.startswith(f"the run of configs/local.toml {' '.join(overrides)} (recorded in {record})")
        sentence = "The house is small."
        api = _post(f"{page}translate", _json({"text": [sentence]}))
        browser.get(page)
        _wait(browser, lambda d: "Model:" in d.find_element(By.ID, "model").text)
        assert str(record) in browser.find_element(By.ID, "model").text  # the page states which run's model
        browser.find_element(By.ID, "source").send_keys(sentence)
        browser.find_element(By.ID, "translate").click()
        _wait(browser, lambda d: d.find_element(By.ID, "translation").text.strip() != "")
        assert api[0] == 200 and browser.find_element(By.ID, "translation").text == api[1]["translations"][0].strip()
    finally:
        serve.delete("make-serve")


def _entropy(weights: list[float]) -> float:
    return -sum(w * math.log(w) for w in weights if w > 0)


def test_the_page_steps_through_how_a_cross_attention_row_was_computed(server, browser, tiny_model, tmp_path):
    """A real browser: click a cross-attention cell; the step view shows the API's numbers for that
    row: its weights are the "attention" map's row exactly, the query is the explanation's, and
    "without sqrt(d_k)" shows softmax(q.k) of the explanation's scores, more peaked (lower entropy)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    sentence = tiny_model["test_en"][9]
    layer, head, row = 1, 2, 1
    api = _post(f"{server}/translate", _json({"text": [sentence], "attention": True}))[1]
    browser.get(f"{server}/")
    _wait(browser, lambda d: "Model:" in d.find_element(By.ID, "model").text)
    browser.find_element(By.ID, "source").send_keys(sentence)
    browser.find_element(By.ID, "translate").click()
    _wait(browser, lambda d: d.find_element(By.ID, "translation").text.strip() != "")
    Select(browser.find_element(By.ID, "kind")).select_by_value("cross")
    Select(browser.find_element(By.ID, "layer")).select_by_value(str(layer))
    Select(browser.find_element(By.ID, "head")).select_by_value(str(head))
    label = api["attention"]["heads"]["cross"][layer][head]["label"]
    assert label and browser.find_element(By.ID, "headlabel").text == f"head {head + 1}: {label}"
    browser.find_element(By.CSS_SELECTOR, f'#heatmap td.cell[data-row="{row}"][data-col="0"]').click()
    _wait(browser, lambda d: d.find_element(By.ID, "steps").get_attribute("data-state") in ("ready", "error"))
    assert browser.find_element(By.ID, "steps").get_attribute("data-state") == "ready", \
        browser.find_element(By.ID, "steperror").text
    read = "return [...document.querySelectorAll('#keys td.w')].map(c => c.dataset.w)"
    shown = [float(w) for w in browser.execute_script(read)]
    assert shown == api["attention"]["cross"][layer][head][row]  # the doubles the API sent, as JS printed them
    explained = _post(f"{server}/translate", _json({"text": [sentence], "explain": {
        "kind": "cross", "layer": layer, "head": head, "query": row}}))[1]["explanation"]
    q = json.loads(browser.execute_script("return document.querySelector('#q canvas').dataset.values"))
    assert q == explained["q"] and len(q) == explained["d_k"] == 16  # d_model 64 / 4 heads
    browser.find_element(By.ID, "unscaled").click()
    unscaled = [float(w) for w in browser.execute_script(read)]
    assert unscaled == explained["weights_unscaled"]
    top = max(explained["scores"])  # q.k of the model's own q and k, softmaxed here without the scale
    e = [math.exp(x - top) for x in explained["scores"]]
    assert all(abs(u - x / sum(e)) < 1e-6 for u, x in zip(unscaled, e))
    assert _entropy(unscaled) < _entropy(shown), (unscaled, shown)
    assert browser.execute_script("return document.getElementById('pedots').width") > 1  # the positional section
    browser.save_screenshot(str(tmp_path / "steps.png"))
