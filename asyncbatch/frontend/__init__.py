"""The caller's side of the engine: prompts in, text out.

``prompt_validation`` (refuses bad input at submission), ``request_handle`` (what a caller waits or
streams on), ``output_processor`` (the thread that turns sampled ids into text), ``detokenizer``
(incremental decoding), ``stop_strings`` (stop-string matching across token boundaries).
"""
