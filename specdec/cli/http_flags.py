"""The orchestrator's OpenAI-compatible HTTP API on the command line (``orchestrator.http``).

``specdec orchestrator serve`` serves it with ``--http-port PORT`` (env
SPECDEC_HTTP_PORT; off unless given, 0 = any free port) on ``--host``, with
the gRPC port's bearer token (``--auth-token``) and TLS files. Chat
completions render messages with the tokenizer directory's chat template, or
``--chat-template FILE`` (env SPECDEC_CHAT_TEMPLATE); ``--served-model-name``
(env SPECDEC_SERVED_MODEL_NAME) is the model id clients send (default: the
verifier's model name); ``--http-timeout-s`` (env SPECDEC_HTTP_TIMEOUT_S)
bounds each request (504 past it). ``specdec up`` passes ``--http-port``
(default 8000, any free port when ``--port`` is 0).
"""

from __future__ import annotations

import argparse

from specdec.cli.options import env
from specdec.request.errors import UsageError
from orchestrator.chat_template import ChatTemplate, load_chat_template
from orchestrator.http import HttpConfig

UP_HTTP_PORT = 8000
NOT_GIVEN = object()     # ``up --http-port`` left out (unlike 'off')


def http_port(text: str) -> int | None:
    """A port, 0 (any free one) or 'off'."""
    if str(text).lower() in ("off", "none"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {value}")
    return value


def add_http_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("OpenAI-compatible HTTP API")
    g.add_argument("--http-port", type=http_port, metavar="PORT", default=env("SPECDEC_HTTP_PORT", "off"),
                   help="serve /v1/completions, /v1/chat/completions, /v1/models and /health on this port "
                        "(0 = any free port; env SPECDEC_HTTP_PORT; default off)")
    g.add_argument("--chat-template", metavar="FILE", default=env("SPECDEC_CHAT_TEMPLATE"),
                   help="Jinja chat template for chat completions, instead of the tokenizer's own "
                        "(env SPECDEC_CHAT_TEMPLATE)")
    g.add_argument("--served-model-name", metavar="NAME", default=env("SPECDEC_SERVED_MODEL_NAME"),
                   help="the model id of /v1/models and requests (env SPECDEC_SERVED_MODEL_NAME; "
                        "default: the verifier's model name)")
    g.add_argument("--http-timeout-s", type=float, metavar="S", default=env("SPECDEC_HTTP_TIMEOUT_S"),
                   help="give up on an HTTP request after this long: 504 (env SPECDEC_HTTP_TIMEOUT_S; "
                        "default: no limit)")


def up_http_port(args) -> int | None:
    """``specdec up``'s HTTP port: --http-port, else 8000 (0 when --port asks for any free port)."""
    if args.http_port is not NOT_GIVEN:
        return args.http_port
    return 0 if args.port == 0 else UP_HTTP_PORT


def add_up_http_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http-port", type=http_port, default=NOT_GIVEN, metavar="PORT",
                   help=f"the orchestrator's OpenAI-compatible HTTP port (0 = any free port, 'off' = none; "
                        f"default {UP_HTTP_PORT}, or any free port with --port 0)")
    p.add_argument("--chat-template", metavar="FILE", default=env("SPECDEC_CHAT_TEMPLATE"),
                   help="Jinja chat template for chats (HTTP and gRPC messages), instead of the tokenizer's own "
                        "(env SPECDEC_CHAT_TEMPLATE)")


def chat_template_from(args, tokenizer_dir) -> ChatTemplate | None:
    """The chat template of ``--chat-template``, else the tokenizer directory's; None: none."""
    try:
        return load_chat_template(tokenizer_dir, args.chat_template)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def http_config_from(args, server_cfg, template: ChatTemplate | None) -> HttpConfig | None:
    """The HttpConfig of ``orchestrator serve``'s flags; None without --http-port."""
    if args.http_port is None:
        return None
    timeout = None if args.http_timeout_s is None else float(args.http_timeout_s)
    return HttpConfig(host=server_cfg.host, port=args.http_port, served_model_name=args.served_model_name,
                      chat_template=template, auth_token=server_cfg.auth_token, timeout_s=timeout,
                      tls_cert=server_cfg.tls_cert, tls_key=server_cfg.tls_key,
                      tls_client_ca=server_cfg.tls_client_ca)
