"""The model's ``generation_config.json`` as sampling defaults (vLLM's ``generation_config="auto"``).

A tiny model whose generation config says greedy with 5 new tokens: ``LLM.generate`` without
``SamplingParams`` and a server request without those fields follow it (checked against transformers' greedy
tokens); ``generation_config="vllm"`` ignores it; bad files and overrides are refused naming the field.
"""

from __future__ import annotations

import json

import pytest
from reference import logits_at
from tiny_models import EOS_ID, save_tiny_model
from transformers import AutoModelForCausalLM

from asyncbatch import LLM, SamplingParams
from asyncbatch.frontend.generation_defaults import sampling_defaults
from asyncbatch.serve.settings import ServeSettings
from tests.serve_harness import client, serving

PROMPT = [5, 9, 44, 17, 3]
GREEDY_5 = {"temperature": 0.0, "max_new_tokens": 5, "do_sample": False, "bos_token_id": 1, "eos_token_id": EOS_ID}
ENGINE = {"device": "cpu", "dtype": "float32", "engine_process": False, "max_num_seqs": 4,
          "max_num_batched_tokens": 32, "block_size": 4, "num_threads": 1}


def write_config(folder, fields: dict) -> None:
    (folder / "generation_config.json").write_text(json.dumps(fields))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "LlamaForCausalLM")
    write_config(folder, GREEDY_5)
    return folder


@pytest.fixture(scope="module")
def greedy_tokens(tiny_dir) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype="float32").eval()
    out: list[int] = []
    while len(out) < 5:
        out.append(int(logits_at(model, PROMPT + out)[-1].argmax()))
        if out[-1] == EOS_ID:
            break
    return out


def test_the_sampling_fields_are_read_and_the_rest_left(tmp_path):
    write_config(tmp_path, {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
                            "max_new_tokens": 12, "do_sample": True, "bos_token_id": 1, "eos_token_id": 2})
    assert sampling_defaults(tmp_path) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                                           "repetition_penalty": 1.05, "max_tokens": 12}
    assert sampling_defaults(tmp_path, "vllm") == {}
    assert sampling_defaults(None, str(tmp_path), {"temperature": 0.2})["temperature"] == 0.2
    assert sampling_defaults(tmp_path / "absent") == {}  # no file: the neutral defaults


@pytest.mark.parametrize(("fields", "setting", "overrides", "match"), [
    ({"top_p": 0.0}, "auto", None, r"top_p must be in \(0, 1\]"),
    ({"temperature": -1}, "auto", None, "temperature must be >= 0"),
    ({}, "auto", {"temperature": "hot"}, "temperature must be a number"),
    ({}, "auto", {"beam_width": 4}, "override_generation_config takes"),
    ({}, "/no/such/folder", None, "generation_config must be 'auto', 'vllm' or a folder"),
])
def test_bad_defaults_are_refused_naming_the_field(tmp_path, fields, setting, overrides, match):
    write_config(tmp_path, fields)
    with pytest.raises(ValueError, match=match):
        sampling_defaults(tmp_path, setting, overrides)


def test_bad_setting_types_are_refused_by_the_config(tiny_dir):
    with pytest.raises(TypeError, match="generation_config must be"):
        LLM(str(tiny_dir), generation_config=None, **ENGINE)
    with pytest.raises(TypeError, match="override_generation_config must be a dict"):
        LLM(str(tiny_dir), override_generation_config="temperature=0", **ENGINE)


def test_generate_without_params_follows_the_models_config(tiny_dir, greedy_tokens, make_llm):
    llm = make_llm(str(tiny_dir), **ENGINE)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    assert llm.get_tokenizer() is llm.tokenizer
    (out,) = llm.generate([PROMPT], use_tqdm=False)
    assert out.token_ids == greedy_tokens
    streamed = [t for delta in llm.stream(PROMPT) for t in delta.token_ids]
    assert streamed == greedy_tokens
    # Given params stand as given: the model's defaults are for what the caller left out.
    (given,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert given.token_ids == greedy_tokens[:3]


def test_vllm_setting_and_overrides(tiny_dir, make_llm):
    neutral = make_llm(str(tiny_dir), generation_config="vllm", **ENGINE)
    assert neutral.get_default_sampling_params() == SamplingParams()
    overridden = make_llm(str(tiny_dir), override_generation_config={"max_new_tokens": 2, "top_k": 3}, **ENGINE)
    params = overridden.get_default_sampling_params()
    assert (params.temperature, params.max_tokens, params.top_k) == (0.0, 2, 3)


def test_a_folder_setting_reads_that_folders_file(tiny_dir, tmp_path, make_llm):
    write_config(tmp_path, {"max_new_tokens": 7})
    params = make_llm(str(tiny_dir), generation_config=str(tmp_path), **ENGINE).get_default_sampling_params()
    assert (params.max_tokens, params.temperature) == (7, 1.0)  # that file alone: the model's is not read


def test_the_server_fills_what_a_request_leaves_out(tiny_dir, greedy_tokens):
    with serving(ServeSettings(("m",)), str(tiny_dir), **ENGINE) as (server, _), client(server) as http:
        body = {"model": "m", "prompt": PROMPT}
        out = http.post("/v1/completions", json={**body, "max_tokens": 10, "return_token_ids": True}).json()
        choice = out["choices"][0]
        assert choice["token_ids"] == greedy_tokens  # greedy and capped at 5, as the config says (vLLM's cap)
        sampled = http.post("/v1/completions", json={**body, "temperature": 1.0, "seed": 3, "max_tokens": 4,
                                                     "ignore_eos": True, "return_token_ids": True}).json()
        assert len(sampled["choices"][0]["token_ids"]) == 4
