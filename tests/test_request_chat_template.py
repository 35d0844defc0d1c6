"""vLLM's per-request ``chat_template``: refused (400 naming it) unless the server trusts request templates
(``--trust-request-chat-template``); trusted, it renders the conversation instead of the model's template, on the
chat route and ``/tokenize``, and a template that does not render is a 400 naming it."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[serve]')")

from asyncbatch.serve.settings import ServeSettings
from tests.serve_harness import client, serving
from tests.tiny_models import build_byte_tokenizer, save_tiny_model

MODEL_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
OWN_TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}=>"
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("template"), "LlamaForCausalLM", max_position_embeddings=128)


@pytest.mark.parametrize("trusted", [False, True], ids=["default", "trusted"])
def test_a_request_chat_template(tiny, trusted) -> None:
    own_ids = build_byte_tokenizer().encode("[Hi]=>", add_special_tokens=False)
    settings = ServeSettings(("tiny",), trust_request_chat_template=trusted)
    with serving(settings, str(tiny), device="cpu", dtype="float32", max_num_seqs=2, engine_process=False,
                 chat_template=MODEL_TEMPLATE) as (server, _engine), client(server) as http:
        tokenize = http.post("/tokenize", json={"messages": CHAT, "chat_template": OWN_TEMPLATE})
        chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2,
                                                        "chat_template": OWN_TEMPLATE})
        plain = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
        assert plain.status_code == 200  # the model's own template, either way
        if not trusted:
            for response in (tokenize, chat):
                assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template"
            return
        assert tokenize.status_code == 200 and tokenize.json()["tokens"] == own_ids
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(own_ids)
        assert plain.json()["usage"]["prompt_tokens"] != len(own_ids)
        broken = http.post("/v1/chat/completions", json={"messages": CHAT, "chat_template": "{% for %}"})
        assert broken.status_code == 400 and broken.json()["error"]["param"] == "chat_template"


@pytest.mark.parametrize(("flag", "trusted"), [([], False), (["--trust-request-chat-template"], True)])
def test_the_serve_flag_sets_the_trust(flag, trusted) -> None:
    from asyncbatch.cli.main import build_parser
    from asyncbatch.cli.serve import _model_settings_kwargs

    args = build_parser().parse_args(["serve", "--device", "sim", *flag])
    _, settings, _ = _model_settings_kwargs(args, ServeSettings)
    assert settings.trust_request_chat_template is trusted
