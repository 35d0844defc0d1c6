"""Measuring the gap: ``timeline`` (one record per step, ``stats()``), ``marks`` (NVTX ranges, free when
off), ``gap_report`` (idle time by cause), ``trace_export`` (Chrome/Perfetto JSON), ``timeline_plot``
(PNG), ``host_info`` (the machine a report names)."""
