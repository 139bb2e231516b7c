"""read_json: the request body as strict JSON, or a 4xx that says what is wrong with it.

The body is refused with a 413 as soon as it is known to pass MAX_BODY_BYTES: from Content-Length
before a byte is read, else while it streams in, so it is never buffered past the limit. Parsing
runs in a worker thread, off the event loop. Only strict JSON gets through: no NaN or Infinity
tokens, no number a double cannot hold, no lone UTF-16 surrogate ("\\ud800" is legal JSON but not
Unicode, and would break the tokenizer and every response that echoes it), nothing nested deeper
than MAX_JSON_DEPTH (which the template, its tojson and the output would have to recurse through).
`loads_strict` and `check_json_value` apply the same rules to JSON text found inside a body (tool-call
arguments). A client that hangs up mid-body raises starlette's ClientDisconnect (app.py answers 499).
"""

from __future__ import annotations

import json
import math

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from northcode.server.errors import RequestError

# A 262,144-token conversation is about 1 MB of text; as JSON, with \u escapes and tool schemas, 2-3 MB.
# 8 MB leaves room for that and bounds what one request can make the server parse, render and tokenize.
MAX_BODY_BYTES = 8 << 20
MAX_JSON_DEPTH = 64  # levels of nested arrays and objects; real tool schemas use a dozen or so
_FREE_FORM = frozenset({"parameters", "arguments", "schema", "content"})  # fields a client fills with any JSON


async def read_json(request: Request):
    body = await read_body(request)
    if not body.strip():
        raise RequestError("the request body is empty; send a JSON object")
    return await run_in_threadpool(parse_body, body)


async def read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large(f"{int(declared)} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():  # ClientDisconnect if the client hangs up
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large(f"more than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str) -> RequestError:
    return RequestError(f"the request body is {size}; the limit is {MAX_BODY_BYTES} bytes ({MAX_BODY_BYTES >> 20} MB)",
                        status=413)


def parse_body(body: bytes):
    """The parsed body (a worker thread calls this); RequestError for anything but strict JSON."""
    try:
        value = loads_strict(body)
    except RecursionError:
        raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels of arrays and objects") from None
    except _NotStrict as err:
        raise RequestError(f"the request body is not strict JSON: {err}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON: {err}") from None
    check_json_value(value)
    return value


class _NotStrict(ValueError):
    """JSON that Python's parser accepts and the JSON standard does not."""


def _refuse_constant(name: str):
    raise _NotStrict(f"{name} is not a JSON value (send a number, or null)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotStrict(f"the number {_short(text)} is out of range for a double")
    return value


def loads_strict(text: str | bytes):
    """json.loads without NaN/Infinity and without numbers that overflow a double (ValueError)."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)


def check_json_value(value, param: str | None = None) -> None:
    """RequestError at the first place in parsed JSON that nests deeper than MAX_JSON_DEPTH or holds a
    string that is not valid Unicode. `param` names where `value` sits in the request, when it is not
    the whole body; the error then names it, else the path to the place."""
    stack = [(value, 0, ())]  # (node, containers above it, path as nested (parent, key) pairs)
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            if not node.isascii():
                _check_unicode(node, path, param)
        elif isinstance(node, dict | list):
            if depth == MAX_JSON_DEPTH:
                where = param or _param_of(path)
                raise RequestError(f"{where or 'the request body'} nests deeper than {MAX_JSON_DEPTH} levels "
                                   "of arrays and objects", where)
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in items:
                if isinstance(key, str) and not key.isascii():
                    _check_unicode(key, path, param)  # an object's key: the object is the place
                stack.append((child, depth + 1, (path, key)))


def _check_unicode(text: str, path: tuple, param: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        where = param or _param_of(path)
        code = ord(text[err.start])
        raise RequestError(f"{where or 'the request body'} holds a lone UTF-16 surrogate (U+{code:04X}) at character "
                           f"{err.start}, which is not Unicode text", where) from None


def _param_of(path: tuple) -> str | None:
    """The request field a path lies in: its first parts, up to a field whose inside is free-form JSON
    or an array inside an array (no request field is one: that is a value nested where it does not belong)."""
    keys = []
    while path:
        path, key = path
        keys.append(key)
    keys.reverse()
    parts = []
    for i, key in enumerate(keys[:6]):
        if isinstance(key, int) and i + 1 < len(keys) and isinstance(keys[i + 1], int):
            break
        parts.append(f"[{key}]" if isinstance(key, int) else (f".{_printable(key)}" if parts else _printable(key)))
        if key in _FREE_FORM or (i == 1 and keys[0] == "chat_template_kwargs"):
            break
    return "".join(parts) or None


def _printable(key: str) -> str:
    return key.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate becomes the text \ud800


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else f"{text[:limit - 3]}..."
