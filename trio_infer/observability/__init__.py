"""What the server tells its operators: Prometheus metrics, made from its statistics.

``metrics`` (a collector that reads the core's statistics and the front-ends' transport counts
when scraped, and renders them in Prometheus' text format).

May import: the core (and, through it, the snapshots of scheduling and the workers),
``prometheus_client`` and ``trio_infer.errors``. Never a front-end or a transport: the server
hands the renderer to whichever front-end serves ``/metrics``, and each transport's counts come
in through a callable, so this package knows no protocol.
"""
