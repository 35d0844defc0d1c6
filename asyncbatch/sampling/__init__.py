"""Sampling on the device: ``sampler`` (greedy, temperature, top-k/top-p/min-p, seeded noise) and
``penalties`` (presence, frequency and repetition penalty state per request row)."""
