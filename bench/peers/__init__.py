"""The peers' model files: the same ``dense`` and ``sleep`` models, written for each server.

Each module here runs inside its peer's own virtual environment (``bench/.venvs/NAME``), never
in the benchmark's interpreter, except ``grpcio_server`` which needs only grpcio.
"""
