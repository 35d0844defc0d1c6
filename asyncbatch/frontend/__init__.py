"""The caller's side of the engine: prompts in, text out.

``input_processor`` (the door: prompt or chat -> a validated request, once), ``engine_client`` (the
``EngineClient`` protocol every front door uses), ``prompt_validation`` (the checks the input processor
runs), ``request_handle`` (what a caller waits or streams on), ``output_processor`` (the thread that turns
sampled ids into text), ``detokenizer`` (incremental decoding), ``stop_strings`` (stop-string matching across
token boundaries).
"""
