"""A request to the translation endpoint, checked: every client mistake is a 4xx naming it, never a 500.

The body must be ``{"text": [sentence, ...]}``, nothing else. Refused, each with a ``detail``
that says what and where:

- a body over ``max_request_bytes``: from ``Content-Length`` before reading, or while streaming
  (a chunked body) once it passes the limit, so it is never held whole in memory (413);
- not UTF-8, not JSON, NaN / Infinity or a number out of float or int range (json would hand back
  ``inf``, or fail with a ValueError of its own), JSON nested deeper than ``MAX_JSON_DEPTH``
  levels, and duplicate keys (400). Duplicate keys are refused, not resolved: parsers disagree on
  which one wins, so a client and this server could read different requests;
- not an object with a list of strings under ``"text"``, unknown keys (``{"text": [...],
  "beam": 100}``: the decoding settings are the server's, and a client expecting one to apply
  must learn that it does not), an empty list, a non-string, a string with a lone surrogate
  (``"\\ud800"``: no Unicode text, SentencePiece cannot encode it) (422);
- more sentences than ``max_sentences`` or a sentence over ``max_chars`` characters (413).
"""

from __future__ import annotations

import json
import math
from typing import Any, AsyncIterator

from fastapi import HTTPException

MAX_JSON_DEPTH = 4  # {"text": [...]} is 2 levels deep; anything deeper than this is not a request


async def read_body(headers: Any, chunks: AsyncIterator[bytes], max_bytes: int) -> bytes:
    """The body, refused (413) from its ``Content-Length`` or as soon as the stream passes ``max_bytes``."""
    length = headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise HTTPException(400, f"Content-Length {length!r} is not a number of bytes")
        if int(length) > max_bytes:
            raise HTTPException(413, f"request body is {int(length)} bytes (Content-Length); at most {max_bytes}")
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > max_bytes:
            raise HTTPException(413, f"request body is over {max_bytes} bytes (stopped reading at {len(body)})")
    return bytes(body)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r} in a JSON object")
        out[k] = v
    return out


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse_json(body: bytes) -> Any:
    """The body as JSON, or a 400 naming why it is not (see the module doc)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HTTPException(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        payload = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                             object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise HTTPException(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise HTTPException(400, f"request body is JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # our hooks, and int() over 4300 digits (Python's int_max_str_digits)
        raise HTTPException(400, f"request body is not acceptable JSON: {e}") from None
    depth = _depth(payload)
    if depth > MAX_JSON_DEPTH:
        raise HTTPException(400, f"request body is JSON nested {depth} levels deep; at most {MAX_JSON_DEPTH}")
    return payload


def parse_request(body: bytes, max_sentences: int, max_chars: int) -> list[str]:
    """The sentences of a request body, or an HTTPException naming what is wrong with it."""
    payload = parse_json(body)
    if not isinstance(payload, dict) or "text" not in payload:
        raise HTTPException(422, 'request body must be a JSON object {"text": [sentence, ...]}')
    unknown = sorted(set(payload) - {"text"})
    if unknown:
        raise HTTPException(422, f"unknown key(s) in the request body: {', '.join(map(repr, unknown))}; a request "
                                 'takes only "text" (decoding settings are the server\'s, see GET /health)')
    sentences = payload["text"]
    if not isinstance(sentences, list):
        raise HTTPException(422, f'"text" must be a list of strings, got {type(sentences).__name__}')
    if not sentences:
        raise HTTPException(422, '"text" is an empty list: nothing to translate')
    if len(sentences) > max_sentences:
        raise HTTPException(413, f'"text" has {len(sentences)} sentences; at most {max_sentences} per request')
    for i, s in enumerate(sentences):
        if not isinstance(s, str):
            raise HTTPException(422, f'"text"[{i}] is a {type(s).__name__}, not a string')
        if len(s) > max_chars:
            raise HTTPException(413, f'"text"[{i}] has {len(s)} characters; the limit is {max_chars}')
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise HTTPException(422, f'"text"[{i}] holds a lone surrogate (U+{ord(s[e.start]):04X} at character '
                                     f"{e.start}): not Unicode text") from None
    return sentences
