"""`torch.nn.utils.clip_grad_norm_` on DTensor gradients where a rank holds no rows, right on every
rank: a workaround for two upstream behaviours, installed while a sharded model lives.

A parameter with fewer rows than ranks (or rows that do not split evenly: 5 rows on 4 ranks are
2 + 2 + 1 + 0) leaves some rank's `Shard(0)` local tensor empty, as FSDP2's does.

- The infinity norm of an empty tensor is an error since pytorch/pytorch#173203 (PR #173238:
  `_foreach_norm cannot compute the infinity norm on an empty tensor ...`; `linalg.vector_norm`
  says the same), raised on that rank alone while the others wait in the collective that follows:
  a hang. torchrec filters empty gradients before clipping for the same reason
  (meta-pytorch/torchrec#3891). Here the empty local's norm is the reduction's identity (0 for
  |x|'s max and every p-norm), which is what it contributes to the total.
- The inf-norm's total comes back `Partial("max")`, whose `.item()` is each rank's own value:
  torch's clipping uses it correctly, but the norm it returns (what a training loop logs) differs
  per rank. The norm of a `Partial` DTensor is taken after reducing it to `Replicate`, so the
  returned total is the global one everywhere.

Both are handlers in DTensor's table of custom op handlers (`DTensor._op_dispatcher.
_custom_op_handlers`, the table torch's own `loss_parallel` uses), for `aten.linalg_vector_norm`
and `aten._foreach_norm`; anything else goes to DTensor's own path unchanged, so a DTensor that
is not empty and not partial computes exactly as before. `tests/test_torch_habits.py` shows both
behaviours on the release it runs on.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Partial

_ATEN = torch.ops.aten
_NORMS = (_ATEN.linalg_vector_norm.default, _ATEN._foreach_norm.Scalar)


def install_empty_shard_norms() -> None:
    """Install the handlers (idempotent)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers[_ATEN.linalg_vector_norm.default] = _vector_norm
    handlers[_ATEN._foreach_norm.Scalar] = _foreach_norm


def remove_empty_shard_norms() -> None:
    """Put DTensor's own handling back (idempotent)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op, mine in zip(_NORMS, (_vector_norm, _foreach_norm)):
        if handlers.get(op) is mine:
            del handlers[op]


def _partial_of_norm(ord: float) -> Partial:
    """How DTensor combines ranks' norms of a sharded tensor (max for the inf-norm, p-th powers else)."""
    if ord == math.inf:
        return Partial("max")
    if ord == -math.inf:
        return Partial("min")
    if ord == 0:
        return Partial("sum")
    from torch.distributed.tensor._ops._math_ops import _NormPartial

    return _NormPartial(norm_type=ord)


def _local_norm(local: torch.Tensor, ord: float, dtype: torch.dtype | None) -> torch.Tensor:
    if local.numel() == 0:  # the identity of the reduction across ranks (-inf's is +inf)
        fill = math.inf if ord == -math.inf else 0.0
        return torch.full((), fill, dtype=dtype or local.dtype, device=local.device)
    return torch.linalg.vector_norm(local, ord, dtype=dtype)


def _rows_sharded(x: Any) -> bool:
    return isinstance(x, DTensor) and len(x.placements) == 1 and isinstance(x.placements[0], Shard)


def _by_dtensor(op: Any, args: tuple, kwargs: dict) -> Any:
    """DTensor's own dispatch of `op`, this module's handler set aside for the call."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    mine = handlers.pop(op)
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = mine


def _vector_norm(op: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    dtype = kwargs.get("dtype")
    if dim is None and _rows_sharded(x) and x._local_tensor.numel() == 0:
        local = _local_norm(x._local_tensor, ord, dtype)
        return DTensor.from_local(local, x.device_mesh, [_partial_of_norm(ord)], run_check=False)
    if dim is None and isinstance(x, DTensor) and any(isinstance(p, Partial) for p in x.placements):
        whole = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
        local = torch.linalg.vector_norm(whole._local_tensor, ord, dtype=dtype)
        return DTensor.from_local(local, x.device_mesh, whole.placements, run_check=False)
    return _by_dtensor(op, args, kwargs)


def _foreach_norm(op: Any, args: tuple, kwargs: dict) -> Any:
    tensors = args[0]
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    if not (all(_rows_sharded(t) for t in tensors) and any(t._local_tensor.numel() == 0 for t in tensors)):
        return _by_dtensor(op, args, kwargs)
    filled = [t._local_tensor for t in tensors if t._local_tensor.numel()]
    norms = iter(torch._foreach_norm(filled, ord, dtype=dtype) if filled else [])
    return [
        DTensor.from_local(
            next(norms) if t._local_tensor.numel() else _local_norm(t._local_tensor, ord, dtype),
            t.device_mesh,
            [_partial_of_norm(ord)],
            run_check=False,
        )
        for t in tensors
    ]
