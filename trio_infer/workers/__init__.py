"""Worker processes: where model code runs.

``pool`` (the server side: lanes that start, feed and replace trio-parallel worker processes),
``wire`` (the messages between them: pickles with out-of-band buffers), ``child`` (the loop that
runs inside each worker) and ``forkserver`` (what the forkserver preloads).

May import: ``trio_infer.scheduling`` (reply slots, priority levels), the repository's settings,
the model API, ``trio_infer.buffers`` and ``trio_infer.errors``. ``child``, ``wire`` and
``forkserver`` run in the worker processes and never import trio, a transport or the core.
"""
