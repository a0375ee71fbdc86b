"""Side-by-side benchmarks of trio-infer against MLServer, KServe, Triton and a bare grpcio server.

Run ``python -m bench --help`` from the repository root; ``bench/README.md`` explains the
scenarios. This package is imported by the chart helper in a separate virtual environment, so
it imports nothing here.
"""
