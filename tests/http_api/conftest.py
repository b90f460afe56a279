"""The ``api`` fixture: one stack and its HTTP servers for every test here (see ``http_api.helpers``)."""

from __future__ import annotations

import pytest

from http_api.helpers import TOKEN, Api, chat_tokenizer_dir
from orchestrator.chat_template import load_chat_template
from running_stack import Stack


@pytest.fixture(scope="package")
def api(tiny_family, tmp_path_factory):
    stack = Stack(tiny_family)
    stack.add_verifier("verifier")
    stack.add_drafter("drafter-eagle", "eagle")
    stack.add_orchestrator("eagle", drafter="drafter-eagle")
    a = Api(stack)
    template = load_chat_template(chat_tokenizer_dir(tiny_family, tmp_path_factory.mktemp("chat")))
    a.serve("eagle", "eagle", chat_template=template)
    a.serve("plain", "eagle")
    a.serve("auth", "eagle", auth_token=TOKEN, chat_template=template)
    a.serve("timeout", "eagle", timeout_s=0.3)
    yield a
    a.close()
