"""Capacity: the peak memory per rank of a whole training job, per mode, and what fits in 8 GiB.

Every configuration (mode, GPT size, N ranks) runs in N freshly spawned gloo ranks on 127.0.0.1,
one process per rank, and each rank reports its peak resident set (VmHWM) over the job's whole
life: interpreter and torch start-up, building the model, sharding and initialising it, compiling,
and --steps training steps of fp32 AdamW (lr 3e-4) on one sequence of --tokens tokens per rank
(windows of the bundled prose, bytes as tokens, as `zerocompile train` reads it). Modes:

  ddp     the GPT built whole on the CPU (initialised by its constructor), DistributedDataParallel,
          torch.compile'd with the same compiler as the zero modes: "aot_eager" (AOTAutograd, FX
          graphs run op by op) for --compiler eager, Inductor for --compiler inductor
  fsdp2   built on the meta device, fully_shard on every Block and the root, to_empty("cpu"),
          then GPT._init_weights applied to the DTensor parameters under no_grad; eager (the
          route FSDP2's documentation prescribes)
  zero1..3  built on the meta device, zerocompile.shard(model, stage=s, init=GPT._init_weights)
          (only this rank's shards are ever allocated, one module's full parameters at a time),
          torch.compile(model, backend="zero", options={"compiler": --compiler})

--compiler defaults to eager: the graphs zerocompile's passes produce are the same, compiling
takes seconds instead of minutes on a 2-core machine, and the compile's own memory stays small;
Inductor (--compiler inductor) compiles with one worker thread in the rank itself
(compile_threads = 1), so its memory is counted in the rank's peak too. The ranks run with
glibc's default malloc: the table is what a user's job costs, allocator caching included
(--exact-rss: MALLOC_MMAP_THRESHOLD_=65536, so RSS follows live tensors instead).

Before a configuration starts, its need is predicted (`predicted_peak`: a start-up baseline plus
bytes per parameter by mode, plus the full tensors a step keeps alive) and multiplied by the N
ranks and a safety margin; when that exceeds the machine's MemAvailable (/proc/meminfo) less a
reserve for others, the configuration is skipped ("skipped: needs ~X GB") instead of run, so the
machine is never driven out of memory; --wait polls MemAvailable that long before giving up.
While ranks run, MemAvailable is watched, and if it falls under the reserve the ranks (and only
they) are killed and the configuration reported as aborted.

Reported per configuration: the peak RSS of the largest rank, bytes per parameter per rank
(peak / Φ) and the phase in which the peak was reached. Per mode and N, a least-squares line
peak = a + b·Φ through the measured sizes gives "the largest GPT that would train in 8 GiB per
rank": Φ = (8 GiB − a) / b (an extrapolation by a line; a and b are printed).

--load-check measures two memory promises of zerocompile's weights path, on the --load-size GPT
at N = --load-ranks and stage 3, with MALLOC_MMAP_THRESHOLD_=65536 in the ranks so every freed
tensor over 64 kB is unmapped at once and RSS follows live tensors. A one-rank job first writes the
model's weights to a temporary safetensors file (deleted afterwards). Then, per rank, the rise of
the peak RSS (VmHWM, reset by writing 5 to /proc/self/clear_refs) above the RSS just before:
  meta route   meta build; from just before shard(init=GPT._init_weights) to just after
               load_weights(model, file): bound 4Φ/N (its shards) + the largest module's own full
               parameters + 64 MB
  plain route  from just before the GPT is built whole on the CPU, through shard() and
               load_weights: expected to rise by at least 4Φ (the whole model existed)
  save         save_weights(model, file) of the meta-route model: the writing rank's rise, bound
               the largest tensor + 64 MB
A sampling thread also records the peaks of RssAnon and RssFile (file pages mapped into the
process, such as the safetensors file's mmap) separately, so a broken bound says where it broke.

--big is one real run: --big-ranks (8) ranks training the "1b" GPT at stage 3 from meta
initialisation for --steps steps on the same batch every step (so the loss must fall: the model
is learning it; AdamW lr --big-lr, smaller than the table's as a larger model needs), printing the loss of every step and the peak RSS of every rank and their total;
FSDP2 beside it only if its prediction fits the machine. Its predictions come from this run's
measured configurations, or from a previous report's (--calibrate capacity.json).

Prints markdown tables and writes JSON (--json) with the date, the machine (cores, RAM) and every
rank's measurements.
"""

from .command import add_arguments, run

__all__ = ["add_arguments", "run"]
