"""The engine core: the planner loop and what it plans with.

``core`` (the planner thread: schedule -> stage -> launch -> apply), ``scheduler`` (which requests run
next, plain data), ``step_plan`` (what it returns), ``row_state`` (per-request counters and constants in
arrays indexed by token row), ``step_apply`` (a step's sampled tokens applied by masks),
``block_manager`` (paged KV accounting and the block table), ``request`` (a request's planner-side state),
``step_metadata`` (a plan written into a staging buffer), ``host_staging`` (the double-buffered host
staging buffers), ``builder`` (assembles an engine from a config). Nothing is imported here so that
importing one module stays cheap.
"""
