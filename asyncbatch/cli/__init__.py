"""The command line: ``main`` (entry point and ``generate``), ``args`` (options shared by every
command), ``demo`` (the README's main job), ``profile`` (the idle-gap report)."""
