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
  "beam": 100}``: a client expecting a setting to apply must learn that it does not), an empty
  list, a non-string, a string with a lone surrogate (``"\\ud800"``: no Unicode text,
  SentencePiece cannot encode it) or a control character other than tab (422);
- more sentences than ``max_sentences`` or a sentence over ``max_chars`` characters (413).

Optional keys (``parse_translate``): ``"attention": true`` (the attention of the translation of
one sentence: more than one is a 422 naming the limit), ``"explain": {"kind", "layer", "head",
"query"}`` (how one head computed one query's row, for one sentence: a 422 names a batch, a
missing or unknown field, an unknown kind or a non-integer or negative index; the server checks
the ranges, which depend on its model and the sentence), ``"beam_size"`` (an integer, 1 to the
server's ``max_beam_size``) and ``"alpha"`` (a number, 0 to ``MAX_ALPHA``); out of range is a 422
naming the range.
"""

from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import HTTPException

from model.attention_weights import KINDS

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


MAX_ALPHA = 5.0  # the length penalty's exponent a client may ask for (GNMT's alpha; §6.1 uses 0.6)
OPTIONAL = ("attention", "beam_size", "alpha", "explain")
EXPLAIN_FIELDS = ("kind", "layer", "head", "query")  # one head's row: model.attention_weights.KINDS, indices from 0


@dataclass(frozen=True)
class ExplainRequest:
    """Which row to open: attention kind ("encoder_self", "decoder_self", "cross"), layer, head and
    query position, each index counted from 0."""

    kind: str
    layer: int
    head: int
    query: int


@dataclass(frozen=True, kw_only=True)
class TranslateRequest:
    """A checked request: its sentences and what it asked for beyond them (None: the server's)."""

    sentences: list[str]
    attention: bool = False
    beam_size: int | None = None
    alpha: float | None = None
    explain: ExplainRequest | None = None


def parse_translate(body: bytes, max_sentences: int, max_chars: int, max_beam_size: int) -> TranslateRequest:
    """A request body checked (the module doc), or an HTTPException naming what is wrong with it."""
    payload = parse_json(body)
    sentences = _sentences(payload, max_sentences, max_chars, OPTIONAL)
    attention = payload.get("attention", False)
    if not isinstance(attention, bool):
        raise HTTPException(422, f'"attention" must be true or false, got {attention!r}')
    if attention and len(sentences) != 1:
        raise HTTPException(422, f'"attention": true is given for one sentence per request; this one has '
                                 f"{len(sentences)} (limit: 1 sentence)")
    explain = _explain(payload["explain"], len(sentences)) if "explain" in payload else None
    beam = payload.get("beam_size")
    if beam is not None and (isinstance(beam, bool) or not isinstance(beam, int) or not 1 <= beam <= max_beam_size):
        raise HTTPException(422, f'"beam_size" must be an integer from 1 to {max_beam_size} (this server\'s '
                                 f"max_beam_size), got {beam!r}")
    alpha = payload.get("alpha")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                              or not 0.0 <= alpha <= MAX_ALPHA):
        raise HTTPException(422, f'"alpha" must be a number from 0 to {MAX_ALPHA}, got {alpha!r}')
    return TranslateRequest(sentences=sentences, attention=attention, beam_size=beam,
                            alpha=None if alpha is None else float(alpha), explain=explain)


def _explain(value: Any, n_sentences: int) -> ExplainRequest:
    """The "explain" field checked for what needs no model: its shape, kind and index types."""
    shape = '{"kind": ..., "layer": i, "head": j, "query": t}'
    if not isinstance(value, dict):
        raise HTTPException(422, f'"explain" must be an object {shape}, got {type(value).__name__}')
    missing, unknown = [k for k in EXPLAIN_FIELDS if k not in value], sorted(set(value) - set(EXPLAIN_FIELDS))
    if missing or unknown:
        raise HTTPException(422, f'"explain" must be {shape}: ' + "; ".join(
            part for part in (missing and f"missing {', '.join(map(repr, missing))}",
                              unknown and f"unknown {', '.join(map(repr, unknown))}") if part))
    if n_sentences != 1:
        raise HTTPException(422, f'"explain" is given for one sentence per request; this one has {n_sentences} '
                                 f"(limit: 1 sentence)")
    if value["kind"] not in KINDS:
        raise HTTPException(422, f'"explain"."kind" must be one of {", ".join(map(repr, KINDS))}, '
                                 f'got {value["kind"]!r}')
    for name in EXPLAIN_FIELDS[1:]:
        index = value[name]
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise HTTPException(422, f'"explain"."{name}" must be an integer from 0, got {index!r}')
    return ExplainRequest(**value)


def parse_request(body: bytes, max_sentences: int, max_chars: int) -> list[str]:
    """The sentences of a request body that may hold only "text", or an HTTPException naming what is wrong."""
    return _sentences(parse_json(body), max_sentences, max_chars, ())


def _sentences(payload: Any, max_sentences: int, max_chars: int, optional: tuple[str, ...]) -> list[str]:
    if not isinstance(payload, dict) or "text" not in payload:
        raise HTTPException(422, 'request body must be a JSON object {"text": [sentence, ...]}')
    unknown = sorted(set(payload) - {"text", *optional})
    if unknown:
        takes = " and optionally " + ", ".join(f'"{k}"' for k in optional) if optional else " only"
        raise HTTPException(422, f"unknown key(s) in the request body: {', '.join(map(repr, unknown))}; a request "
                                 f'takes "text"{takes} (the other decoding settings are the server\'s, see GET /health)')
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
        bad = next((j for j, c in enumerate(s) if c != "\t" and unicodedata.category(c) == "Cc"), None)
        if bad is not None:
            raise HTTPException(422, f'"text"[{i}] holds a control character (U+{ord(s[bad]):04X} at character '
                                     f"{bad}): one sentence of text per entry, no line breaks or control codes")
    return sentences
