"""What decides when a request runs: admission, priority, batching, and the reply slot.

``admission`` (the memory budget and per-model queue bounds), ``priority`` (the ``priority``
parameter's levels), ``batching`` (the batch planner, a pure function, and the batcher tasks) and
``reply`` (the slot a waiting request owns).

May import: trio, numpy, the repository's settings, the model API, ``trio_infer.datatypes`` and
``trio_infer.errors``. Never protobuf, a transport or the worker pool: batching is handed the
pool as a :class:`~trio_infer.scheduling.batching.Predictor`.
"""
