"""ServerState: what the app holds: options, the engine once loaded, and the admission count.

The engine loads in a background thread after uvicorn has started, so /health can answer 503
with the loading phase meanwhile. Once attached, a fatal-error listener is registered on the engine:
when the engine fails for good (a lost device), `engine_error` holds why, `engine_failed` is set
(`northcode serve` waits on it to exit non-zero), /health answers 503 and new requests a 503. Admission is a counter: the engine runs `max_batch` requests
and queues the rest; the server holds at most `max_batch + max_queue` and answers 503 with a
Retry-After hint beyond that. It does not parse requests or build responses.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from northcode.server.errors import RequestError
from northcode.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = (
    "You are North Mini Code, a coding assistant. Answer precisely and concisely; when you write code, "
    "make it correct and complete."
)


@dataclass(frozen=True, slots=True)
class ServerOptions:
    model_name: str = "north-mini-code"  # the id /v1/models reports and responses carry
    api_key: str | None = None
    max_batch: int = 8
    max_queue: int = 32  # requests held beyond the running batch before 503
    default_system_prompt: str | None = DEFAULT_SYSTEM_PROMPT  # used when a chat has no system message
    reasoning_alias: bool = True  # stream reasoning as both reasoning_content and reasoning
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed to call the API ("*": any); none: no CORS


class ServerState:
    def __init__(self, options: ServerOptions, engine=None) -> None:
        self.options = options
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self.phase = "starting"
        self.load_error: str | None = None
        self.engine_error: str | None = None  # why the engine failed for good after loading (its fatal error)
        self.engine_failed = threading.Event()  # set with engine_error
        self.engine = None
        self.model_dir: Path | None = None  # the checkpoint folder, once attached (vLLM's `root`)
        self.template = None
        self.markers = None
        self._in_flight = 0
        self._lock = threading.Lock()
        if engine is not None:
            self.attach(engine, engine_model_dir(engine))

    # --- loading ---

    def attach(self, engine, model_dir: Path | None) -> None:
        """Make a loaded engine servable: its chat template and marker ids first, then `ready`."""
        from northcode.server.chat_template import ChatTemplate
        from northcode.server.markers import Markers

        self.phase = "reading the chat template"
        template_source = getattr(engine.tokenizer, "chat_template", None)
        if model_dir is not None:
            self.template = ChatTemplate.from_model_dir(model_dir)
        elif template_source:
            self.template = ChatTemplate(template_source)
        else:
            raise ValueError("the model has no chat template (chat_template.jinja or tokenizer_config.json)")
        self.markers = Markers.from_tokenizer(engine.tokenizer)
        self.model_dir = model_dir.resolve() if model_dir is not None else None
        self.engine = engine
        self.phase = "ready"
        if hasattr(engine, "add_fatal_listener"):  # after "ready": a listener may be called at once
            engine.add_fatal_listener(self._on_engine_fatal)

    def _on_engine_fatal(self, message: str) -> None:
        """The engine's fatal listener (its watchdog thread): nothing can run any more."""
        self.engine_error = message
        self.phase = "failed"
        self.engine_failed.set()

    def load_in_background(self, model_dir: Path, settings) -> threading.Thread:
        thread = threading.Thread(target=self._load, args=(model_dir, settings), name="northcode-load", daemon=True)
        thread.start()
        return thread

    def _load(self, model_dir: Path, settings) -> None:
        try:
            self.phase = "importing the engine"
            from northcode import runtime

            engine = runtime.load_engine(model_dir, settings, progress=self._on_progress)
            self.attach(engine, model_dir)
        except ValueError as err:  # a bad checkpoint or setting: the message names it, no traceback
            self._fail(str(err))
        except Exception as err:  # a bug or the device: keep the traceback in the log
            log.exception("loading %s failed", model_dir)
            self._fail(f"{type(err).__name__}: {err}")

    def _fail(self, message: str) -> None:
        """Shown by /health and by `northcode serve`, which then exits."""
        self.load_error = message
        self.phase = "failed"

    def _on_progress(self, done_bytes: int, total_bytes: int) -> None:
        """load_checkpoint's callback: bytes of weights read so far, of the total."""
        percent = 100 * done_bytes // max(total_bytes, 1)
        self.phase = f"reading weights: {percent}% of {total_bytes / 2**30:.2f} GiB"

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.phase == "ready"

    def require_ready(self) -> None:
        if self.engine_error is not None:
            raise self.engine_failure()
        if self.load_error is not None:
            raise RequestError(f"the model failed to load: {self.load_error}", status=503, code="model_load_failed")
        if not self.ready:
            raise RequestError(f"the model is loading ({self.phase})", status=503, code="model_loading", headers={"Retry-After": "5"})

    def engine_failure(self) -> RequestError:
        """The 503 every request gets once the engine has failed for good."""
        return RequestError(f"the engine has failed and cannot serve requests: {self.engine_error}", status=503,
                            code="engine_failed", error_type="server_error")

    # --- admission ---

    def admit(self) -> None:
        with self._lock:
            limit = self.options.max_batch + self.options.max_queue
            if self._in_flight >= limit:
                raise RequestError(
                    f"the server is busy: {self._in_flight} requests running or queued (limit {limit}); retry shortly",
                    status=503, code="server_busy", headers={"Retry-After": "1"},
                )
            self._in_flight += 1
            self.metrics.queued.set(self._in_flight)

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet released (running in the engine or waiting there)."""
        return self._in_flight

    def release(self) -> None:
        with self._lock:
            self._in_flight -= 1
            self.metrics.queued.set(self._in_flight)


def engine_model_dir(engine) -> Path | None:
    model_dir = getattr(engine, "model_dir", None)
    return Path(model_dir) if model_dir is not None else None
