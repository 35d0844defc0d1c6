"""Device backends behind one interface: ``cuda``, ``cpu`` and ``sim``."""
