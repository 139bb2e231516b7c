"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over the chat engine path.

request.py translates a Messages body into the chat body /v1/chat/completions takes, so one
conversation renders the same prompt ids (and prefix-cache hits) on either API; content.py turns the
output parser's deltas into content blocks and SSE events; routes.py holds the handlers and the
Anthropic error shape app.py uses on these paths.
"""

from northcode.server.anthropic.routes import anthropic_error, count_tokens, is_anthropic_path, messages, retry_header

__all__ = ["anthropic_error", "count_tokens", "is_anthropic_path", "messages", "retry_header"]
