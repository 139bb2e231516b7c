"""The webfetch tool's fetch: one http(s) URL to Markdown, plain text or HTML, with its limits.

Every hop (the URL, then each redirect's target) is checked before it is requested: http or https only, and
every address its host resolves to must be global (no loopback, private, link-local, shared or reserved
address) unless `allow_private` (NORTHCODE_ALLOW_PRIVATE_FETCH=1, config.py). The check resolves the name
itself, and httpx resolves it again to connect: a name that changes its answer in between (DNS rebinding) is
not caught. The body is read up to MAX_BODY_BYTES and cut there; binary types are refused before it is read.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket

import httpx

MAX_BODY_BYTES = 5 * 1024 * 1024  # read from the wire, as OpenCode's 5 MB; the rest is not read
MAX_RESULT_CHARS = 100_000  # returned to the model
MAX_REDIRECTS = 5
DEFAULT_TIMEOUT_S = 30  # as OpenCode
MAX_TIMEOUT_S = 120
FORMATS = ("markdown", "text", "html")
TEXT_TYPES = re.compile(r"text/.*|application/(json|xml|xhtml\+xml|javascript|ecmascript|x-sh|.*\+(xml|json))")


class FetchError(ValueError):
    """A URL the tool will not fetch or a response it cannot return, said for the model."""


def check_url(url: httpx.URL) -> None:
    """Refuse a URL whose scheme is not http(s) or that has no host (the address check is `check_addresses`)."""
    if url.scheme not in ("http", "https"):
        raise FetchError(f"{url}: only http:// and https:// URLs can be fetched")
    if not url.host:
        raise FetchError(f"{url}: no host")


def is_global_address(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 scope (fe80::1%eth0) is not part of the address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is loopback
    return ip.is_global and not ip.is_multicast


async def check_addresses(url: httpx.URL) -> None:
    """Resolve the URL's host and refuse it if any of its addresses is not global."""
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(url.host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise FetchError(f"{url.host}: cannot resolve the host ({err.strerror})") from None
    for address in sorted({info[4][0] for info in infos}):
        if not is_global_address(address):
            raise FetchError(f"{url}: refused, {url.host} resolves to {address}, a loopback, private, link-local or "
                             "otherwise non-public address (NORTHCODE_ALLOW_PRIVATE_FETCH=1 allows these)")


async def fetch(url_text: str, output_format: str, timeout_s: float, allow_private: bool) -> str:
    """The page at `url_text` in `output_format`, cut to MAX_RESULT_CHARS, or a FetchError."""
    assert output_format in FORMATS, output_format
    try:
        url = httpx.URL(url_text)
    except httpx.InvalidURL as err:
        raise FetchError(f"{url_text!r}: not a valid URL ({err})") from None
    try:
        async with asyncio.timeout(timeout_s), httpx.AsyncClient(
                follow_redirects=False, trust_env=False, timeout=timeout_s) as client:
            final_url, content_type, text, cut = await _follow(client, url, allow_private)
    except TimeoutError:
        raise FetchError(f"{url}: no complete answer within the {timeout_s:g} s timeout") from None
    except httpx.HTTPError as err:
        raise FetchError(f"{url}: the request failed ({type(err).__name__}: {err})") from None
    # a thread: converting megabytes of HTML takes seconds, and the app's event loop must not wait on it
    return await asyncio.to_thread(_present, final_url, content_type, text, cut, output_format)


async def _follow(client: httpx.AsyncClient, url: httpx.URL, allow_private: bool) -> tuple[str, str, str, bool]:
    for _ in range(MAX_REDIRECTS + 1):
        check_url(url)
        if not allow_private:
            await check_addresses(url)
        headers = {"Accept": "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.8", "User-Agent": "northcode"}
        async with client.stream("GET", url, headers=headers) as response:
            if response.is_redirect and "location" in response.headers:
                url = url.join(response.headers["location"])
                continue
            if not response.is_success:
                raise FetchError(f"{url}: HTTP {response.status_code} {response.reason_phrase}")
            content_type = response.headers.get("content-type", "text/plain").split(";")[0].strip().lower()
            if not TEXT_TYPES.fullmatch(content_type):
                raise FetchError(f"{url}: the content type is {content_type}, not text or HTML; webfetch returns "
                                 "text only")
            body, cut = await _read_capped(response)
            return str(url), content_type, body.decode(response.encoding or "utf-8", errors="replace"), cut
    raise FetchError(f"more than {MAX_REDIRECTS} redirects, last to {url}")


async def _read_capped(response: httpx.Response) -> tuple[bytes, bool]:
    chunks: list[bytes] = []
    num_bytes = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        num_bytes += len(chunk)
        if num_bytes >= MAX_BODY_BYTES:
            return b"".join(chunks)[:MAX_BODY_BYTES], True
    return b"".join(chunks), False


def _present(url: str, content_type: str, text: str, body_cut: bool, output_format: str) -> str:
    is_html = content_type in ("text/html", "application/xhtml+xml")
    if is_html and output_format != "html":
        text = html_to_markdown(text) if output_format == "markdown" else html_to_text(text)
    notes = [f"(the body was cut at {MAX_BODY_BYTES // (1024 * 1024)} MB)"] if body_cut else []
    if len(text) > MAX_RESULT_CHARS:
        notes.append(f"(cut at {MAX_RESULT_CHARS:,} of {len(text):,} characters)")
        text = text[:MAX_RESULT_CHARS]
    return "\n".join([f"{url} ({content_type})", "", text.strip(), *notes])


def _soup(html: str):  # -> bs4.BeautifulSoup: imported here, so the agent starts without it
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html, "html.parser")
    for tag in soup(["script", "style", "noscript", "template", "svg"]):
        tag.decompose()
    return soup


def html_to_markdown(html: str) -> str:
    from markdownify import MarkdownConverter

    markdown = MarkdownConverter(heading_style="ATX", bullets="-").convert_soup(_soup(html))
    return re.sub(r"\n{3,}", "\n\n", markdown)


def html_to_text(html: str) -> str:
    lines = (line.strip() for line in _soup(html).get_text("\n").splitlines())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))
