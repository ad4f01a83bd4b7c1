"""What one all-reduce costs on this machine's process group: the floor under a decoded token.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=N benchmarks/collective_latency.py [--out JSON]

A decoded token of a tensor-parallel model costs at least its 2L+1 all-reduces of batch x hidden
(Megatron's minimum, what fxparallel and transformers' ``tp_plan`` both make), one after the other:
each needs the previous one's result. This script times back-to-back all-reduces of the sizes a
decode step sends (1 KiB to 64 KiB: batch 1 to 8 of hidden 256 in fp32, and hidden 4096), and a
1 MiB one (a training step's), with nothing else running in the processes: median over --repeats
runs of --calls calls each, the slowest rank's. For scale, rank 0 also times a TCP round trip of
1 KiB over loopback between two of its own processes (what the transport itself costs).

With ``--decode-layers L`` it prints the floor of a decoded token, (2L+1) x the latency at each
size, which ``docs/benchmarks.md`` sets against the measured decode steps.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = (1024, 8 * 1024, 64 * 1024, 1024 * 1024)  # bytes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decode-layers", type=int, default=4, help="L of the decode floor (2L+1 all-reduces)")
    p.add_argument("--out", default=None, help="JSON (default benchmarks/results/collective_latency_tp{N}.json)")
    return p.parse_args(argv)


def all_reduce_seconds(nbytes: int, calls: int, repeats: int) -> float:
    """Median seconds of one all-reduce of ``nbytes`` (fp32), back to back, the slowest rank's."""
    x = torch.ones(nbytes // 4)
    for _ in range(20):
        dist.all_reduce(x)
    runs = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(x)
        mine = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        runs.append(float(mine))
    return statistics.median(runs)


def tcp_round_trip_seconds(nbytes: int = 1024, trips: int = 2000) -> float:
    """Seconds of one round trip of ``nbytes`` over loopback TCP between this process and a child."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    if os.fork() == 0:  # the child echoes what it gets
        peer = socket.create_connection(("127.0.0.1", port))
        peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(trips):
            got = b""
            while len(got) < nbytes:
                got += peer.recv(nbytes - len(got))
            peer.sendall(got)
        os._exit(0)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    message = b"x" * nbytes
    start = time.perf_counter()
    for _ in range(trips):
        conn.sendall(message)
        got = b""
        while len(got) < nbytes:
            got += conn.recv(nbytes - len(got))
    seconds = (time.perf_counter() - start) / trips
    os.wait()
    conn.close()
    server.close()
    return seconds


def main(argv=None):
    args = parse_args(argv)
    load_start = os.getloadavg()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    latency = {n: all_reduce_seconds(n, args.calls, args.repeats) for n in SIZES}
    dist.barrier()
    tcp = tcp_round_trip_seconds() if rank == 0 else None
    if rank == 0:
        steps = 2 * args.decode_layers + 1
        results = {
            "tp": world, "backend": dist.get_backend(), "cores": os.cpu_count(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "load_average_start": load_start,
            "load_average_end": os.getloadavg(), "calls": args.calls, "repeats": args.repeats,
            "all_reduce_us": {str(n): latency[n] * 1e6 for n in SIZES},
            "tcp_round_trip_1KiB_us": tcp * 1e6,
            "decode_floor_ms": {str(n): steps * latency[n] * 1e3 for n in SIZES if n < 1024 * 1024},
            "decode_layers": args.decode_layers,
        }
        print(f"TP={world} ({dist.get_backend()}), load {load_start[0]:.1f} -> {results['load_average_end'][0]:.1f}")
        for n in SIZES:
            print(f"  all-reduce of {n // 1024:>5} KiB: {latency[n] * 1e6:8.0f} us")
        print(f"  TCP round trip of 1 KiB over loopback (for scale): {tcp * 1e6:.0f} us")
        print(f"  floor of a decoded token, {steps} all-reduces (L={args.decode_layers}): "
              + ", ".join(f"{v:.1f} ms at {int(k) // 1024} KiB" for k, v in results["decode_floor_ms"].items()))
        out = args.out or os.path.join(HERE, "results", f"collective_latency_tp{world}.json")
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
