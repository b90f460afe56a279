"""Chat templates without transformers: where they are found and how they render
(compared with transformers' own ``apply_chat_template`` on the same template)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from specdec.request.errors import InvalidArgument
from orchestrator.chat_template import ChatTemplate, chat_prompt, load_chat_template, special_tokens
from orchestrator.text import TextTokenizer

# A template in the style of real ones: loop controls, tojson, generation
# blocks, raise_exception, whitespace control.
TEMPLATE = """{{ bos_token }}
{%- for m in messages %}
  {%- if m.role == 'tool' %}{% continue %}{% endif %}
  {%- if m.role == 'system' and not loop.first %}{{ raise_exception('system comes first') }}{% endif %}
  <|{{ m.role }}|>
  {%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}
  {%- else %}{{ m.content }}{% endif %}
{% endfor %}
{%- if meta is defined %}{{ meta | tojson }}{% endif %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""

MESSAGES = [{"role": "system", "content": "Sé breve"}, {"role": "user", "content": "hi"},
            {"role": "tool", "content": "ignored"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"}]


def write_dir(path, config: dict, jinja: str | None = None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


def test_renders_like_transformers(tiny_family, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_family["target"])
    want = tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True,
                                   meta={"lang": "español"})
    config = json.loads((tiny_family["target"] / "tokenizer_config.json").read_text())
    template = ChatTemplate(TEMPLATE, special_tokens(config), "test")
    assert template.render(MESSAGES, add_generation_prompt=True, extra={"meta": {"lang": "español"}}) == want
    # extra variables never replace the conversation itself
    assert template.render(MESSAGES, extra={"meta": {"lang": "español"}, "messages": [],
                                            "add_generation_prompt": False}) == want
    assert "español" in want and tok.bos_token in want
    no_prompt = tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=False)
    assert template.render(MESSAGES, add_generation_prompt=False) == no_prompt


def test_raise_exception_is_the_clients_error():
    template = ChatTemplate(TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"}, "test")
    with pytest.raises(InvalidArgument, match="^messages: .*system comes first"):
        template.render([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}])


def test_the_sandbox_refuses_unsafe_templates():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", {}, "test")
    with pytest.raises(InvalidArgument, match="messages"):
        template.render([])


def test_where_templates_are_found(tmp_path):
    tokens = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}
    assert load_chat_template(write_dir(tmp_path / "none", tokens)) is None
    plain = load_chat_template(write_dir(tmp_path / "plain", {**tokens, "chat_template": "{{ bos_token }}A"}))
    assert plain.render([]) == "<s>A"
    named = write_dir(tmp_path / "named", {**tokens, "chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]})
    assert load_chat_template(named).render([]) == "D</s>"
    jinja = write_dir(tmp_path / "jinja", {**tokens, "chat_template": "old"}, jinja="J")
    assert load_chat_template(jinja).render([]) == "J"          # chat_template.jinja wins
    override = tmp_path / "override.jinja"
    override.write_text("O{{ messages | length }}")
    assert load_chat_template(jinja, override).render([{"role": "user", "content": "x"}]) == "O1"
    with pytest.raises(ValueError, match="not found"):
        load_chat_template(jinja, tmp_path / "missing.jinja")
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% for %}", {}, "broken")


def test_the_demo_tokenizer_has_no_template():
    from specdec.model.loading import demo_path

    assert load_chat_template(demo_path("target")) is None


@pytest.mark.parametrize("adds_bos", [False, True])
def test_a_bos_is_encoded_once(tiny_family, adds_bos):
    """A template writes BOS; a tokenizer that adds one itself must not get a second."""
    tok = Tokenizer.from_file(str(tiny_family["target"] / "tokenizer.json"))
    bos = json.loads((tiny_family["target"] / "tokenizer_config.json").read_text())["bos_token"]
    bos_id = tok.token_to_id(bos)
    if adds_bos:
        tok.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    text_tok = TextTokenizer(tok, frozenset())
    template = ChatTemplate("{{ bos_token }}{{ messages[0].content }}", {"bos_token": bos}, "test")
    prompt = chat_prompt(template, [{"role": "user", "content": "def add"}], text_tok)
    ids = text_tok.encode(prompt)
    assert ids[0] == bos_id and ids.count(bos_id) == 1
    assert prompt == ("def add" if adds_bos else bos + "def add")
