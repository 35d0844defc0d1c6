"""Scale-out: asyncbatch replicas on Ray Serve, with a request router that knows the replicas' prefix caches.

Needs the ``cluster`` extra (``pip install -e '.[cluster]'``, Ray Serve). Only this package imports ``ray``,
and only in the modules that are Ray's side (``router``, ``deployment``, ``ingress``, ``launch``); the
routing policy (``routing_policy``) and what replicas publish (``cache_summary``) are plain Python, so they
are tested without Ray. See ``docs/scaling.md``.
"""
