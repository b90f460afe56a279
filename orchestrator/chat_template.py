"""Chat messages -> prompt text, with the model's own chat template (no transformers).

A model directory carries its template as ``chat_template.jinja`` or as the
``chat_template`` entry of ``tokenizer_config.json`` (a string, or a list of
``{"name", "template"}`` of which "default" is the one used for chat); a
server may be given a template file instead (``--chat-template FILE``).

Rendering follows transformers' ``apply_chat_template``: a sandboxed Jinja
environment (templates come with downloaded models) with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, ``{% generation %}`` blocks
(rendered as their body), a ``tojson`` filter that keeps non-ASCII text, and
the globals ``raise_exception`` (a template refusing a conversation: the
client's error) and ``strftime_now``. The variables are ``messages``,
``add_generation_prompt``, the special tokens of ``tokenizer_config.json``
(``bos_token``, ``eos_token``, ...) and any extra ``chat_template_kwargs``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specdec.request.errors import InvalidArgument

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for
    training masks in transformers): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def raise_exception(message: str):
    raise jinja2.TemplateError(message)


def tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@dataclass(frozen=True)
class ChatTemplate:
    source: str                          # the Jinja text
    special_tokens: dict[str, str]       # bos_token, eos_token, ... as text
    origin: str                          # where it came from (logs, errors)

    def __post_init__(self):
        try:
            compiled = environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template {self.origin} does not parse: {exc}") from None
        object.__setattr__(self, "compiled", compiled)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, extra: dict | None = None) -> str:
        """The prompt text; ``extra``: more template variables (a request's
        ``chat_template_kwargs``). InvalidArgument (field ``messages``) when
        the template refuses them."""
        variables = {**self.special_tokens, **(extra or {}), "messages": messages,
                     "add_generation_prompt": add_generation_prompt}
        try:
            return self.compiled.render(**variables)
        except jinja2.TemplateError as exc:
            raise InvalidArgument(f"messages: the chat template refused them: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise InvalidArgument(f"messages: the chat template failed on them: {type(exc).__name__}: {exc}") \
                from None


def special_tokens(config: dict) -> dict[str, str]:
    """``bos_token`` and the others of a tokenizer_config.json, as text ("" when unset)."""
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        out[name] = value if isinstance(value, str) else ""
    return out


def _read_config(directory: Path) -> dict:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg})") from None
    return config if isinstance(config, dict) else {}


def _template_in(config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):           # named templates: "default" is the chat one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def load_chat_template(tokenizer_dir: str | Path, template_file: str | Path | None = None) -> ChatTemplate | None:
    """The template a server renders chats with: ``template_file`` if given,
    else the tokenizer directory's own; None when there is none."""
    directory = Path(tokenizer_dir)
    config = _read_config(directory)
    tokens = special_tokens(config)
    if template_file is not None:
        path = Path(template_file)
        if not path.is_file():
            raise ValueError(f"chat template file not found: {path}")
        return ChatTemplate(path.read_text(), tokens, str(path))
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(), tokens, str(jinja_file))
    template = _template_in(config)
    if template is None:
        return None
    return ChatTemplate(template, tokens, f"{directory / 'tokenizer_config.json'} (chat_template)")


def chat_prompt(template: ChatTemplate, messages: list[dict], tokenizer, extra: dict | None = None) -> str:
    """The prompt text of ``messages``: rendered with the generation prompt, less
    a leading BOS that ``tokenizer`` (``orchestrator.text.TextTokenizer``) adds
    again when encoding, so the BOS is encoded once either way."""
    text = template.render(messages, add_generation_prompt=True, extra=extra)
    bos = template.special_tokens.get("bos_token", "")
    if not bos or not text.startswith(bos):
        return text
    added = tokenizer.encode("")
    return text[len(bos):] if added and added[0] == tokenizer.tokenizer.token_to_id(bos) else text


class MessageRenderer:
    """``OrchestratorService.chat_renderer``: the ``messages`` of a gRPC / SDK
    request (``specdec.request.params.ChatMessage``) rendered as the HTTP API renders chats."""

    def __init__(self, template: ChatTemplate, tokenizer):
        self.template = template
        self.tokenizer = tokenizer

    def __call__(self, messages) -> str:
        return chat_prompt(self.template, [{"role": m.role, "content": m.content} for m in messages],
                           self.tokenizer)
