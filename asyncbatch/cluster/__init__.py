"""Scale-out: asyncbatch replicas on Ray Serve, with a request router that knows the replicas' prefix caches.

Needs the ``cluster`` extra (``pip install -e '.[cluster]'``, Ray Serve). Only this package imports ``ray``,
and only in the modules that are Ray's side (``router``, ``observed_routers``, ``deployment``, ``ingress``,
``launch``, ``lifecycle``, ``ray_processes``); the routing policy (``routing_policy``), what replicas publish
(``cache_summary``, ``replica_metrics``), the ingress's view of them (``router_registry``, ``cluster_metrics``)
and the stop signals (``stop_signals``) are plain Python, so they are tested without Ray. See
``docs/scaling.md``.
"""
