"""Does torch's gloo survive collectives running at once? The check behind `passes.one_in_flight`.

Each iteration issues `--in-flight` coalesced all-gathers of 8 tensors (and with `--all-to-all`
as many all-to-alls) on a gloo backend of `--threads` worker threads, churns the heap on the
main thread while they run, then waits for all and checks every value received. Run it under
torchrun, 2 ranks, from the repository root; each rank prints its outcome, and a corrupted heap
shows as a rank killed by SIGABRT ("malloc(): unaligned tcache chunk detected") or SIGSEGV, or
as a hang (gloo's timeout is 120 s).

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 -m benchmarks.gloo_concurrency --threads 2 --in-flight 10
    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 -m benchmarks.gloo_concurrency --threads 1 --in-flight 10

torch builds every group's gloo backend with two worker threads, so two collectives in flight
run at once; one worker thread runs them one after another, which is what one collective in
flight at a time gives a stock group.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroupGloo

SIZES = [41_312, 287_731, 1_203, 153_004, 99_999, 212_388, 5_876, 260_000]  # elements, uneven on purpose
ALL_TO_ALL_NUMEL = 50_000  # per rank


def _gloo_backend(threads: int) -> ProcessGroupGloo:
    options = ProcessGroupGloo._Options()
    options._threads = threads
    options._timeout = datetime.timedelta(seconds=120)
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    store = PrefixStore("gloo_concurrency", dist.distributed_c10d._get_default_store())
    return ProcessGroupGloo(store, dist.get_rank(), dist.get_world_size(), options)


def _iteration(backend: ProcessGroupGloo, step: int, in_flight: int, all_to_all: bool) -> str | None:
    """Issue, churn, wait, check; a description of the first wrong value, or None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pending = []
    for bucket in range(in_flight):
        value = float(100 * rank + bucket + step % 7)
        shards = [torch.full((numel,), value) for numel in SIZES]
        fulls = [torch.empty(world * numel) for numel in SIZES]
        by_rank = [[full.view(world, -1)[r] for full in fulls] for r in range(world)]
        pending.append((bucket, fulls, backend.allgather_coalesced(by_rank, shards)))
        if all_to_all:
            received = torch.empty(world * ALL_TO_ALL_NUMEL)
            sent = torch.full((world * ALL_TO_ALL_NUMEL,), value)
            pending.append((bucket, [received], backend.alltoall_base(received, sent, [], [])))
        churn = [torch.randn(numel // 3 + 17) for numel in SIZES]  # the main thread allocates meanwhile
        del churn
    for bucket, outputs, work in pending:
        work.wait()
        for output in outputs:
            for source, row in enumerate(output.view(world, -1)):
                if not bool((row == float(100 * source + bucket + step % 7)).all()):
                    return f"step {step}, bucket {bucket}: wrong values from rank {source}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="gloo worker threads (torch's default: 2)")
    parser.add_argument("--in-flight", type=int, default=10, help="coalesced all-gathers issued before the first wait")
    parser.add_argument("--all-to-all", action="store_true", help="an all-to-all in flight next to each all-gather")
    parser.add_argument("--iterations", type=int, default=2000)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    backend = _gloo_backend(args.threads)
    started = time.monotonic()
    for step in range(args.iterations):
        wrong = _iteration(backend, step, args.in_flight, args.all_to_all)
        if wrong is not None:
            print(f"rank {dist.get_rank()}: {wrong}", flush=True)
            return 1
    print(
        f"rank {dist.get_rank()}: {args.iterations} iterations of {args.in_flight} coalesced all-gathers in flight"
        f"{' with all-to-alls' if args.all_to_all else ''} on {args.threads} gloo thread(s): every value right, "
        f"{time.monotonic() - started:.0f} s",
        flush=True,
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
