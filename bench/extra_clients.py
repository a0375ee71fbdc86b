"""The overload scenarios' extra clients, in a process of their own.

``python -m bench.extra_clients TARGET CLIENTS ORIGIN DURATION DEADLINE [--backoff]`` runs
``CLIENTS`` closed-loop clients of the overload request on one channel of their own and prints
their :class:`bench.client.Samples` as one JSON object. ``ORIGIN`` is when the measured window
starts, on ``time.perf_counter()``'s clock, which on Linux is CLOCK_MONOTONIC and so the same in
every process: the window lines up with the benchmark's own.

Why a second process: the clients the benchmark measures would otherwise share one asyncio loop
(and grpc's threads) with the clients that only make the overload, and the measured calls would
wait on their own client rather than on the server. Measured at ten times the budget's load,
clients backing off, on one server at the same time: 5 clients in a process of their own saw
p50 / p99 80 / 133 ms, the 45 others, in one process, 104 / 198 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
from collections.abc import Sequence

from bench import client, scenarios


async def _run(
    target: str, clients: int, origin: float, duration: float, deadline: float, backoff: bool
) -> client.Samples:
    _, request = scenarios.overload_input()
    async with client.open_channel(target) as channel:
        return await client.closed_loop(
            client.infer_serialized_once(channel, request),
            concurrency=clients,
            origin=origin,
            duration=duration,
            call_timeout=deadline,
            retry_on=(scenarios.OVERLOAD_REFUSED,),
            backoff=scenarios.OVERLOAD_BACKOFF if backoff else None,
            seed=1,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the clients and print their samples as JSON on stdout."""
    parser = argparse.ArgumentParser(prog="python -m bench.extra_clients")
    parser.add_argument("target")
    parser.add_argument("clients", type=int)
    parser.add_argument("origin", type=float, help="window start, time.perf_counter() clock")
    parser.add_argument("duration", type=float)
    parser.add_argument("deadline", type=float)
    parser.add_argument("--backoff", action="store_true")
    args = parser.parse_args(argv)
    # Ctrl+C reaches the whole process group; the benchmark stops this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    samples = asyncio.run(
        _run(args.target, args.clients, args.origin, args.duration, args.deadline, args.backoff)
    )
    json.dump(dataclasses.asdict(samples), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
