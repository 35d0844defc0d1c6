"""vLLM's tokenizer arguments: ``tokenizer=`` (a separate folder), ``skip_tokenizer_init`` (token ids only),
``chat_template`` (an override); a model folder without a tokenizer says what to pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncbatch import LLM, SamplingParams
from asyncbatch.model.loader import resolve_model_path

TEMPLATE = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return Path(resolve_model_path(None))


@pytest.fixture
def bare_model(tmp_path: Path, model_dir: Path) -> Path:
    """The default model's weights and config, without its tokenizer files."""
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (tmp_path / name).symlink_to(model_dir / name)
    return tmp_path


def test_folder_without_tokenizer_names_the_way_out(make_llm, bare_model: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer=PATH.*skip_tokenizer_init=True"):
        make_llm(str(bare_model), device="sim")


def test_separate_tokenizer_folder(make_llm, bare_model: Path, model_dir: Path) -> None:
    llm = make_llm(str(bare_model), device="sim", tokenizer=str(model_dir))
    out = llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and out.prompt_token_ids == llm.tokenizer.encode("Hello")
    with pytest.raises(ValueError, match="tokenizer path"):
        make_llm(str(bare_model), device="sim", tokenizer=str(bare_model / "missing"))


def test_skip_tokenizer_init_token_ids_only(make_llm) -> None:
    llm = make_llm(device="sim", skip_tokenizer_init=True)
    assert llm.tokenizer is None
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 5 and out.text == ""
    deltas = list(llm.stream([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    assert sum(len(d.token_ids) for d in deltas) == 3
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text", use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[1, 2]], SamplingParams(stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        LLM(device="sim", skip_tokenizer_init=True, tokenizer="x")


def test_chat_template_override(make_llm, tmp_path: Path) -> None:
    llm = make_llm(device="sim", chat_template=TEMPLATE)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert llm.chat_prompt_ids(messages) == llm.tokenizer.encode("hi|yo|", add_special_tokens=False)
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    from_file = make_llm(device="sim", chat_template=str(path))
    assert from_file.chat_prompt_ids(messages) == llm.chat_prompt_ids(messages)
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        make_llm(device="sim", chat_template=str(tmp_path / "missing.jinja"))
