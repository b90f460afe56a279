"""JSON-lines logging for the services, one object per line on stderr.

Every line carries ``ts``, ``level``, ``service``, ``logger``, ``msg`` and the
``request_id`` of the RPC being served: a context variable that the server
interceptor sets from the ``x-request-id`` metadata (or a fresh id), and that
channels opened by ``specdec.serving.server.open_channel`` pass on downstream, so one
generation can be followed across the orchestrator, drafter and verifier.
Fields given with ``extra={...}`` are added to the object.
"""

from __future__ import annotations

import contextvars
import datetime as _dt
import json
import logging
import sys
import traceback

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("specdec_request_id", default="")

# Attributes every LogRecord has; anything else came in through ``extra``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ts = _dt.datetime.fromtimestamp(record.created, tz=_dt.timezone.utc)
        out = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": request_id_var.get(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        return json.dumps(out, default=str)


def configure_logging(service: str, level: str = "INFO") -> None:
    """Route the root logger to stderr as JSON lines; safe to call again."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_specdec", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    handler._specdec = True
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Python warnings (a library's deprecations) are log records too, so stderr stays one JSON object a line
    logging.captureWarnings(True)
    # grpc and the metrics HTTP server have their own chatty loggers
    logging.getLogger("grpc").setLevel(max(logging.WARNING, root.level))
