"""The endpoint's request checks (pipeline/serve/request.py) without a server: every client mistake
is an HTTPException with a 4xx naming it. The served app is tested with the same bodies in
tests/integration/test_serve.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import HTTPException

from pipeline.serve.request import (MAX_JSON_DEPTH, ExplainRequest, TranslateRequest, parse_request, parse_translate,
                                   read_body)


def _refused(body: bytes) -> HTTPException:
    with pytest.raises(HTTPException) as e:
        parse_request(body, max_sentences=4, max_chars=50)
    return e.value


@pytest.mark.parametrize("body, status, words", [
    (b"[" * 100_000 + b"]" * 100_000, 400, f"nested deeper than {MAX_JSON_DEPTH} levels"),  # RecursionError in json
    (b'{"text": [[[[["a"]]]]]}', 400, f"nested 6 levels deep; at most {MAX_JSON_DEPTH}"),
    (b'{"text": ["\\ud800"]}', 422, '"text"[0] holds a lone surrogate (U+D800 at character 0)'),
    (b'{"text": ["ok", "a\\udfffb"]}', 422, '"text"[1] holds a lone surrogate (U+DFFF at character 1)'),
    (b'{"text": [NaN]}', 400, "NaN is not JSON"),
    (b'{"text": ["a"], "x": -Infinity}', 400, "-Infinity is not JSON"),
    (b'{"text": ["a"], "x": 1e999}', 400, "the number 1e999 is out of range"),
    (b'{"text": ["a"], "x": ' + b"7" * 5000 + b"}", 400, "not acceptable JSON"),  # int over 4300 digits
    (b'{"text": ["a"], "text": ["b"]}', 400, "duplicate key 'text'"),
    (b'{"text": ["a"], "beam": 100, "alpha": 1}', 422, "unknown key(s) in the request body: 'alpha', 'beam'"),
    (b'{"text": ["a", 1]}', 422, '"text"[1] is a int'),
    (b'{"text": []}', 422, "empty list"),
    (json.dumps({"text": ["a"] * 5}).encode(), 413, "at most 4 per request"),
    (json.dumps({"text": ["x" * 51]}).encode(), 413, '"text"[0] has 51 characters; the limit is 50'),
    (b'{"text": ["caf\xe9"]}', 400, "not valid UTF-8 (byte 14)"),
])
def test_each_bad_body_is_refused_by_name(body, status, words):
    e = _refused(body)
    assert e.status_code == status and words in e.detail, e.detail


def test_good_bodies_pass_through_unchanged():
    assert parse_request('{"text": ["Grüße", "", "\\u00e9"]}'.encode(), 4, 50) == ["Grüße", "", "é"]
    assert parse_request(b'{"text": ["a", "b", "c", "d"]}', 4, 50) == ["a", "b", "c", "d"]


async def _chunks(parts):
    for p in parts:
        yield p


def _read(headers: dict, parts: list[bytes], limit: int) -> bytes:
    return asyncio.run(read_body(headers, _chunks(parts), limit))


def test_body_size_is_checked_from_content_length_before_reading():
    consumed = []

    async def watched():
        consumed.append(True)
        yield b"x"

    with pytest.raises(HTTPException) as e:
        asyncio.run(read_body({"content-length": "101"}, watched(), 100))
    assert e.value.status_code == 413 and "101 bytes (Content-Length); at most 100" in e.value.detail
    assert consumed == []  # not a byte read
    with pytest.raises(HTTPException) as e:
        _read({"content-length": "ten"}, [b""], 100)
    assert e.value.status_code == 400 and "'ten' is not a number" in e.value.detail


def test_body_size_is_checked_while_streaming():
    given = []

    async def endless():
        while True:
            given.append(1)
            yield b"x" * 40

    with pytest.raises(HTTPException) as e:
        asyncio.run(read_body({}, endless(), 100))  # chunked: no Content-Length
    assert e.value.status_code == 413 and "over 100 bytes (stopped reading at 120)" in e.value.detail
    assert len(given) == 3  # stopped at the first chunk past the limit
    assert _read({}, [b"ab", b"cd"], 4) == b"abcd"


def _translate(body: bytes):
    return parse_translate(body, max_sentences=4, max_chars=50, max_beam_size=8)


@pytest.mark.parametrize("body, status, words", [
    (b'{"text": ["a", "b"], "attention": true}', 422, "one sentence per request; this one has 2 (limit: 1 sentence)"),
    (b'{"text": ["a"], "attention": 1}', 422, '"attention" must be true or false'),
    (b'{"text": ["a"], "beam_size": 9}', 422, '"beam_size" must be an integer from 1 to 8'),
    (b'{"text": ["a"], "beam_size": 0}', 422, '"beam_size" must be an integer from 1 to 8'),
    (b'{"text": ["a"], "beam_size": 2.0}', 422, '"beam_size" must be an integer'),
    (b'{"text": ["a"], "beam_size": true}', 422, '"beam_size" must be an integer'),
    (b'{"text": ["a"], "alpha": -0.1}', 422, '"alpha" must be a number from 0 to 5.0'),
    (b'{"text": ["a"], "alpha": "1"}', 422, '"alpha" must be a number'),
    (b'{"text": ["a"], "beam": 4}', 422, "unknown key(s) in the request body: 'beam'; a request takes \"text\" and "
                                         'optionally "attention", "beam_size", "alpha"'),
    (b'{"text": ["two\\nlines"]}', 422, '"text"[0] holds a control character (U+000A at character 3)'),
    (b'{"text": ["ok", "bell\\u0007"]}', 422, '"text"[1] holds a control character (U+0007 at character 4)'),
])
def test_each_bad_translate_request_is_refused_by_name(body, status, words):
    with pytest.raises(HTTPException) as e:
        _translate(body)
    assert e.value.status_code == status and words in e.value.detail, e.value.detail


EXPLAIN = {"kind": "cross", "layer": 0, "head": 1, "query": 2}


def _with_explain(explain, text=("a",)) -> bytes:
    return json.dumps({"text": list(text), "explain": explain}).encode()


@pytest.mark.parametrize("body, words", [
    (_with_explain(EXPLAIN, ["a", "b"]), '"explain" is given for one sentence per request; this one has 2'),
    (_with_explain([0, 0, 0, 0]), '"explain" must be an object {"kind": ..., "layer": i, "head": j, "query": t}, '
                                  "got list"),
    (_with_explain(None), '"explain" must be an object'),
    (_with_explain({"kind": "cross", "layer": 0, "head": 1}), "missing 'query'"),
    (_with_explain({**EXPLAIN, "row": 1}), "unknown 'row'"),
    (_with_explain({**EXPLAIN, "kind": "self"}), '"explain"."kind" must be one of \'encoder_self\', '
                                                 "'decoder_self', 'cross', got 'self'"),
    (_with_explain({**EXPLAIN, "kind": 1}), '"explain"."kind" must be one of'),
    (_with_explain({**EXPLAIN, "layer": 1.0}), '"explain"."layer" must be an integer from 0, got 1.0'),
    (_with_explain({**EXPLAIN, "head": "1"}), '"explain"."head" must be an integer from 0, got \'1\''),
    (_with_explain({**EXPLAIN, "query": -1}), '"explain"."query" must be an integer from 0, got -1'),
    (_with_explain({**EXPLAIN, "query": True}), '"explain"."query" must be an integer from 0, got True'),
])
def test_each_bad_explain_request_is_refused_by_name(body, words):
    """What needs no model: one sentence, the object's fields, a known kind, integer indices from 0
    (the ranges depend on the model and the sentence: the app's, tests/integration/test_serve.py)."""
    with pytest.raises(HTTPException) as e:
        _translate(body)
    assert e.value.status_code == 422 and words in e.value.detail, e.value.detail


def test_a_translate_request_with_its_options():
    assert _translate(b'{"text": ["a\\tb"]}') == TranslateRequest(sentences=["a\tb"])  # a tab is text
    got = _translate(b'{"text": ["Hallo"], "attention": true, "beam_size": 8, "alpha": 1}')
    assert got == TranslateRequest(sentences=["Hallo"], attention=True, beam_size=8,
                                   alpha=1.0) and isinstance(got.alpha, float)
    got = _translate(_with_explain({"query": 3, "head": 0, "layer": 5, "kind": "decoder_self"}))
    assert got == TranslateRequest(sentences=["a"], explain=ExplainRequest("decoder_self", 5, 0, 3))
