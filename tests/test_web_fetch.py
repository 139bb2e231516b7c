"""webfetch against a local HTTP server: formats, redirects, the size caps, refused types and addresses, approvals."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from agent_scripted_endpoint import RecordingAsker, ScriptedEndpoint, text_reply, tool_reply

from northcode.agent import web_fetch
from northcode.agent.approvals import Approvals, Decision, Mode
from northcode.agent.client import ChatClient
from northcode.agent.loop import Agent
from northcode.agent.sandbox import Workspace
from northcode.agent.tools import ToolBox, ToolError

PAGE = ("<html><head><title>T</title><style>p {color: red}</style><script>alert('x')</script></head>"
        "<body><h1>Install</h1><p>Run <code>pip install northcode</code>, then <a href='/docs'>read the docs</a>.</p>"
        "<ul><li>one</li><li>two</li></ul></body></html>")
LARGE_BYTES = 6 * 1024 * 1024


class Handler(BaseHTTPRequestHandler):
    routes = {"/page.html": ("text/html; charset=utf-8", PAGE.encode()),
              "/notes.txt": ("text/plain", "plain notes\nline two\n".encode()),
              "/image.png": ("image/png", b"\x89PNG\r\n\x1a\n" + bytes(100))}
    redirects = {"/old": "/page.html", "/loop": "/loop", "/to-loopback": "http://127.0.0.2:{port}/page.html",
                 "/to-private": "http://10.1.2.3/page.html", "/to-file": "file:///etc/passwd"}

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        if self.path in self.redirects:
            self.send_response(302)
            self.send_header("Location", self.redirects[self.path].format(port=port))
            self.end_headers()
        elif self.path == "/large.txt":  # more than the 5 MB the tool reads; it stops reading
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(LARGE_BYTES))
            self.end_headers()
            try:
                for _ in range(LARGE_BYTES // 65536):
                    self.wfile.write(b"x" * 65535 + b"\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
        elif self.path == "/slow":
            time.sleep(2)
            self.send_response(200)
            self.end_headers()
        elif self.path in self.routes:
            content_type, body = self.routes[self.path]
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def tools(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    toolbox = ToolBox(Workspace(root), tmp_path / "spill")
    toolbox.allow_private_fetch = True  # the test server is on loopback
    return toolbox


async def fetch(tools, **args) -> str:
    return await tools.prepare("webfetch", args).execute()


async def test_html_becomes_markdown_and_text_and_stays_html(tools, server):
    markdown = await fetch(tools, url=f"{server}/page.html")
    assert markdown.startswith(f"{server}/page.html (text/html)\n\nT\n\n# Install")
    assert "Run `pip install northcode`, then [read the docs](/docs)." in markdown and "- one\n- two" in markdown
    assert "alert" not in markdown and "color: red" not in markdown
    text = await fetch(tools, url=f"{server}/page.html", format="text")
    assert "Install" in text and "<h1>" not in text and "[read the docs]" not in text and "alert" not in text
    assert PAGE in await fetch(tools, url=f"{server}/page.html", format="html")


async def test_text_comes_back_as_it_is_and_redirects_are_followed(tools, server):
    assert await fetch(tools, url=f"{server}/notes.txt") == f"{server}/notes.txt (text/plain)\n\nplain notes\nline two"
    assert (await fetch(tools, url=f"{server}/old")).startswith(f"{server}/page.html (text/html)\n\nT\n\n# Install")
    with pytest.raises(ToolError, match="more than 5 redirects"):
        await fetch(tools, url=f"{server}/loop")
    with pytest.raises(ToolError, match="only http:// and https://"):
        await fetch(tools, url=f"{server}/to-file")


async def test_large_bodies_are_cut_and_binary_types_refused(tools, server):
    large = await fetch(tools, url=f"{server}/large.txt")
    assert large.endswith("(the body was cut at 5 MB)\n(cut at 100,000 of 5,242,880 characters)")
    assert len(large) < web_fetch.MAX_RESULT_CHARS + 200
    with pytest.raises(ToolError, match="content type is image/png, not text or HTML"):
        await fetch(tools, url=f"{server}/image.png")
    with pytest.raises(ToolError, match="HTTP 404"):
        await fetch(tools, url=f"{server}/missing")
    with pytest.raises(ToolError, match="within the 1 s timeout"):
        await fetch(tools, url=f"{server}/slow", timeout=1)


async def test_bad_arguments_are_refused_before_anything_runs(tools):
    for args, message in [({"url": "ftp://example.com/x"}, "only http:// and https://"),
                          ({"url": "https://example.com", "format": "pdf"}, "expected one of markdown, text, html"),
                          ({"url": "https://example.com", "timeout": 0}, "integer >= 1"), ({}, "missing argument")]:
        with pytest.raises(ToolError, match=message):
            tools.prepare("webfetch", args)


@pytest.mark.parametrize("url", ["http://127.0.0.1/", "http://localhost:9/", "http://10.0.0.8/", "http://192.168.1.1/",
                                 "http://169.254.169.254/latest/meta-data/", "http://[::1]/", "http://[fe80::1]/",
                                 "http://[::ffff:127.0.0.1]/", "http://0.0.0.0/"])
async def test_non_public_addresses_are_refused_by_default(tmp_path, monkeypatch, url):
    monkeypatch.delenv("NORTHCODE_ALLOW_PRIVATE_FETCH", raising=False)
    tools = ToolBox(Workspace(tmp_path), tmp_path / "spill")
    assert tools.allow_private_fetch is False
    with pytest.raises(ToolError, match="non-public address .*NORTHCODE_ALLOW_PRIVATE_FETCH=1"):
        await fetch(tools, url=url)


async def test_each_redirect_is_checked_again(tmp_path, server, monkeypatch):
    """The test server (127.0.0.1) passes as public here, so that the refusal comes from the redirect's target."""
    real = web_fetch.is_global_address
    monkeypatch.setattr(web_fetch, "is_global_address", lambda address: address == "127.0.0.1" or real(address))
    tools = ToolBox(Workspace(tmp_path), tmp_path / "spill")
    assert (await fetch(tools, url=f"{server}/notes.txt")).endswith("line two")
    with pytest.raises(ToolError, match="127.0.0.2, a loopback"):
        await fetch(tools, url=f"{server}/to-loopback")
    with pytest.raises(ToolError, match="10.1.2.3, a loopback, private"):
        await fetch(tools, url=f"{server}/to-private")


def test_the_setting_is_read_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NORTHCODE_ALLOW_PRIVATE_FETCH", "1")
    assert ToolBox(Workspace(tmp_path), tmp_path / "spill").allow_private_fetch is True
    monkeypatch.setenv("NORTHCODE_ALLOW_PRIVATE_FETCH", "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        ToolBox(Workspace(tmp_path), tmp_path / "spill")


@pytest.mark.parametrize("mode, num_asked", [(Mode.PLAN, 1), (Mode.ASK, 1), (Mode.AUTO_EDIT, 1), (Mode.FULL_AUTO, 0)])
async def test_webfetch_asks_before_it_runs_except_in_full_auto(tools, server, tmp_path, mode, num_asked):
    page = ("webfetch", {"url": f"{server}/notes.txt"})
    asker = RecordingAsker(Decision.ALLOW_SESSION)
    with ScriptedEndpoint([tool_reply(page), tool_reply(("webfetch", {"url": f"{server}/page.html"})),
                           text_reply("Read both.")]) as endpoint:
        agent = Agent(ChatClient(endpoint.url), tools, Approvals(mode, asker))
        result = await agent.run_turn("read the notes")
        await agent.client.aclose()
    assert result.answer == "Read both." and len(asker.asked) == num_asked  # the session approval covers the host
    if num_asked:
        assert asker.asked[0].kind == "fetch" and asker.asked[0].preview == f"{server}/notes.txt"
    outputs = [m["content"] for m in endpoint.requests[2]["messages"] if m["role"] == "tool"]
    assert outputs[0].endswith("line two") and "# Install" in outputs[1]


async def test_a_denied_or_headless_fetch_does_not_run(tools, server):
    calls = [tool_reply(("webfetch", {"url": f"{server}/notes.txt"})), text_reply("OK.")]
    for approvals, reason in [(Approvals(Mode.ASK, RecordingAsker(Decision.DENY)), "denied by the user"),
                              (Approvals(Mode.AUTO_EDIT, None), "no one can answer in a headless run")]:
        with ScriptedEndpoint(list(calls)) as endpoint:
            agent = Agent(ChatClient(endpoint.url), tools, approvals)
            await agent.run_turn("read the notes")
            await agent.client.aclose()
        (output,) = [m["content"] for m in endpoint.requests[1]["messages"] if m["role"] == "tool"]
        assert reason in output and "plain notes" not in output
