"""vLLM's ``add_special_tokens`` on both routes and ``/tokenize``: a text prompt gets the tokenizer's BOS by default
(completions), a chat prompt does not (its template writes what it needs), and the field turns either around.

The tiny model's byte tokenizer is given a post-processor that puts BOS first, as Llama's tokenizers do.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[serve]')")

from tokenizers import processors

from asyncbatch.serve.settings import ServeSettings
from tests.serve_harness import client, serving
from tests.tiny_models import BOS_ID, SPECIAL_TOKENS, build_byte_tokenizer, save_tiny_model

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("bos"), "LlamaForCausalLM", max_position_embeddings=128)
    tokenizer = build_byte_tokenizer()
    bos = SPECIAL_TOKENS[BOS_ID]
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, BOS_ID)])
    tokenizer.save_pretrained(path)
    assert tokenizer.encode("ab")[0] == BOS_ID and tokenizer.encode("ab", add_special_tokens=False)[0] != BOS_ID
    with serving(ServeSettings(("tiny",)), str(path), device="cpu", dtype="float32", max_num_seqs=2,
                 engine_process=False, chat_template=TEMPLATE) as (server, _engine):
        yield server


def test_add_special_tokens_on_both_routes_and_tokenize(served) -> None:
    with client(served) as http:
        def completion_ids(**fields) -> list[int]:
            response = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1, "return_token_ids": True,
                                                          **fields})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["prompt_token_ids"]

        def chat_prompt_tokens(**fields) -> int:
            response = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, **fields})
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens"]

        def tokenized(**fields) -> list[int]:
            response = http.post("/tokenize", json=fields)
            assert response.status_code == 200, response.text
            return response.json()["tokens"]

        completion = completion_ids()
        assert completion[0] == BOS_ID and completion_ids(add_special_tokens=False) == completion[1:]
        assert tokenized(prompt="ab") == completion and tokenized(prompt="ab", add_special_tokens=False) == completion[1:]
        chat = tokenized(messages=CHAT)  # the chat route's ids: no BOS unless asked
        assert chat[0] != BOS_ID and tokenized(messages=CHAT, add_special_tokens=True) == [BOS_ID] + chat
        assert chat_prompt_tokens() == len(chat) and chat_prompt_tokens(add_special_tokens=True) == len(chat) + 1
