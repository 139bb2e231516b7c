"""read_json: the request body as JSON, or a 400 that says what is wrong with it."""

from __future__ import annotations

import json

from starlette.requests import Request

from northcode.server.errors import RequestError

MAX_BODY_BYTES = 64 << 20  # a long agent conversation is a few MB; anything past this is a mistake


async def read_json(request: Request):
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise RequestError(f"the request body is {len(body)} bytes; the limit is {MAX_BODY_BYTES}", status=413)
    if not body.strip():
        raise RequestError("the request body is empty; send a JSON object")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON: {err}") from err
