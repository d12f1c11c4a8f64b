"""Plan each ZeRO stage's memory and traffic per rank for N ranks, without the ranks.

Answers "how much will N ranks need" before anything is launched, in two ways:

  zerocompile plan --params 7.5e9 --ranks 64 --optimizer-bytes 12
      The ZeRO paper's accounting (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
      Training Trillion Parameter Models", §5 and Figure 1) for Φ parameters: model state per rank
      and bytes sent per step, stages 0-3. Reproduces Figure 1: 120.0, 31.4, 16.6, 1.9 GB. It is the
      paper's, not zerocompile's: see the precision paragraph below.

  zerocompile plan --model zerocompile.tools.gpt:GPT --ranks 1024 [--param-dtype bf16]
      What zerocompile does. Imports FACTORY from MODULE (a callable taking no arguments that
      returns an nn.Module), calls it under `torch.device("meta")` so no parameter is allocated,
      counts parameters as zerocompile.shard() does (tied ones once; frozen ones held and gathered,
      but without gradient or optimizer state), pads each to N shards of a multiple of 16
      elements as shard() does, and prints per stage what a rank holds between steps (what
      zc.model_state_bytes reports), the full-size tensors alive inside a step, and the bytes it
      sends per step.

Precision. --params follows the paper: --param-dtype (default bf16) is the dtype of parameters and
gradients, --optimizer-bytes K the optimizer state per parameter, by default 12 with bf16/fp16
(mixed-precision Adam: fp32 master weights, momentum, variance) and 8 with fp32 (Adam's momentum
and variance). --model follows zerocompile, whose mixed precision is different: the shards, their
gradients and the optimizer state keep the model's own dtype whatever the settings (param_dtype
keeps fp32 master shards; reduced gradients land in the shards' dtype), so a model built in fp32
holds 4 + 4 + 8 bytes per parameter with Adam at any --param-dtype (K by default: Adam's two
moments in each shard's dtype). --param-dtype (ZeroConfig.param_dtype; default: none, the model
computes in its own dtype) is what parameters are gathered and computed in: it sizes the
gathered buffers, the gradients awaiting reduction and the bytes sent. --reduce-dtype
(ZeroConfig.reduce_dtype; default: the dtype gradients are computed in) is what gradients are
reduced in: it sizes only the bytes the reductions send. With --offload and a --param-dtype
narrower than the model, the masters leave too (ZeroConfig.offload_masters): the offload table
counts them with the state and the shards and gradients held in --param-dtype.

Sizes are decimal: 1 GB = 10^9 bytes, the unit that reproduces the paper's Figure 1 (in GiB its
120 GB would be 111.8). --json prints exact byte counts instead of the table.

Stated limits of --model: the model is counted, not traced. Whether a stage-3 backward gathers a
parameter again, and which gathered buffers and gradients are alive together, are properties of
the traced graph; without it the plan gives bounds and marks them (≥, ≤): stage-3 traffic is at
most ZeRO's 3Φ (a parameter the backward does not need, such as an embedding's weight, is not
gathered again), the stage-3 gathered-buffer peak is at least the largest single parameter, and
the stage-2/3 peak of unreduced gradients at least the largest trainable one. Stages 1-2 are exact
if the forward uses every parameter. Tracing forward and backward on FakeTensorMode with a fake
process group of N ranks through the "zero" backend would read the exact figures off the lowered
graphs, but it needs example inputs that a no-argument factory does not give, and for a
1B-parameter GPT at N = 1024 it took 7.5 s (stage 0) to 11.6 s (stage 3) per stage after a 3 s
import, about 45 s for the four stages against the 60 s budget; counting takes about 5 s.
tests/test_plan.py holds the counted figures and their bounds against traced graphs of small models.
"""

from .command import run
from .flags import add_arguments

__all__ = ["add_arguments", "run"]
