"""The model: Llama-family ``CausalLM`` over the paged KV cache, and how it is loaded.

Entry points live in their modules (``loader.resolve_model_path``,
``loader.load_model``, ``loader.load_tokenizer``); nothing is imported here so
that importing the package stays cheap.
"""
