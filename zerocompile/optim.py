"""Optimizers that read whole matrices, on zerocompile's shards: `Muon` and `Adafactor`.

`torch.optim.Muon` orthogonalises each 2-D update with Newton-Schulz, which needs the whole
matrix; at stages 1-3 a rank holds a flat run of it. Everything else in its step is elementwise
(the momentum `lerp`, the Nesterov mix, weight decay, the final update), so `Muon` runs those on
the rank's shards, with momentum state 1/N, and once per optimizer step (after the reduction,
accumulation and clipping that precede `step()`) hands each matrix's update to one owner rank
(`zerocompile.matrix_owners`), which runs torch's own Newton-Schulz on it and returns each rank
its slice. The updates travel in bfloat16: torch's Newton-Schulz starts by rounding its input to
bfloat16 and returns bfloat16, so the owner computes bit for bit what one process would, and
the learning-rate adjustment reads the matrix's logical shape, never the shard's.

Where the stage keeps parameters whole (stage 0), or for a parameter not sharded, it steps
exactly as `torch.optim.Muon`.

`torch.optim.Adafactor` reads each parameter whole in three places: the norm of the parameter
(its step size), the row and column means of the squared gradient (its factored second moment),
and the norm of the update (its clipping). Everything else is elementwise. `Adafactor` sums each
of those over the rank's shard, by row and column for the factored ones, and all-reduces the
partial sums: two all-reduces per step of O(rows + columns) values per matrix. The row and column
statistics are then the same on every rank (kept whole: they are tiny; `zc.save` stores them
once), the second moment of a vector stays sharded, and each rank updates its shard.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.optimizer import ParamsT, _to_scalar

from zerocompile import dump
from zerocompile.matrix_owners import assign_owners, bytes_sent_each_way, compute_on_owners
from zerocompile.passes.ledger import PAIRWISE, GraphLedger, LedgerEntry, predicted_sent_bytes
from zerocompile.passes.stages import shard_numel
from zerocompile.sharded_parameters import ShardInfo, full_shape, is_sharded, shard_info

# Newton-Schulz rounds its input to bfloat16 first and returns bfloat16 (torch 2.11-2.15), so the
# updates travel in it: half the bytes, the same result.
_WIRE_DTYPE = torch.bfloat16


class Muon(torch.optim.Muon):
    """`torch.optim.Muon` with the same arguments, for parameters `zerocompile.shard()` sharded
    (or not): build it after `shard()`, with the hidden matrices chosen by their full shape
    (`zerocompile.full_shape(p)`), and an elementwise optimizer (AdamW) for the rest. A
    `torch.optim.Muon` built before `shard()` and passed to it (`optimizer=`) becomes one."""

    def __init__(self, params: ParamsT, *args: Any, **kwargs: Any) -> None:
        # torch's constructor checks the settings, and refuses a flat shard as "not 2D": its checks
        # run on a stand-in matrix, and ours on the parameters' full shapes.
        settings = torch.optim.Muon([torch.empty(0, 0)], *args, **kwargs).defaults
        torch.optim.Optimizer.__init__(self, params, settings)
        for group in self.param_groups:
            for param in group["params"]:
                _check_matrix(param)
        _emit_ledger_after_each_step(self)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = loss_of(closure)
        updates: list[tuple[torch.Tensor, torch.Tensor, dict]] = []
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor] = []
            self._init_group(group, params, grads, buffers)
            momentum = group["momentum"]
            for param, grad, buffer in zip(params, grads, buffers):
                buffer.lerp_(grad, 1 - momentum)
                updates.append((param, grad.lerp(buffer, momentum) if group["nesterov"] else buffer, group))
        for (param, _update, group), orthogonal in zip(updates, self._orthogonalise(updates)):
            lr = _to_scalar(group["lr"])
            param.mul_(1 - lr * group["weight_decay"])
            param.add_(orthogonal, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], full_shape(param)))
        return loss

    def _orthogonalise(self, updates: list[tuple[torch.Tensor, torch.Tensor, dict]]) -> list[torch.Tensor]:
        """Newton-Schulz of each (param, update, group) update, in its order."""
        return _orthogonalise_on_owners(updates)


def loss_of(closure: Callable[[], Any] | None) -> Any:
    """A step's closure run with gradients on, as torch's optimizers do (None without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Adafactor(torch.optim.Adafactor):
    """`torch.optim.Adafactor` with the same arguments and state, for parameters
    `zerocompile.shard()` sharded (or not): its whole-parameter sums all-reduced over the shards.
    A `torch.optim.Adafactor` passed to `shard()` (`optimizer=`) becomes one."""

    # State kept whole on every rank (`zc.save` writes it once): the factored second moment.
    replicated_state = ("row_var", "col_var")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _emit_ledger_after_each_step(self)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = loss_of(closure)
        for group in self.param_groups:
            pieces = [_FactoredPiece(param, self.state[param], group) for param in group["params"] if param.grad is not None]
            _all_reduce_sums([piece.first_sums() for piece in pieces], pieces)
            updates = [piece.update() for piece in pieces]
            _all_reduce_sums([update.square().sum().view(1) for update in updates], pieces)
            for piece, update in zip(pieces, updates):
                piece.apply(update)
        return loss


class _FactoredPiece:
    """One parameter's Adafactor step on this rank's shard (the whole parameter where unsharded).

    Its shard holds elements `offset` onwards of the row-major parameter, `valid` of them before
    the padding; a parameter of 2 or more dimensions is read as (batch, rows, columns)."""

    def __init__(self, param: torch.Tensor, state: dict, group: dict) -> None:
        if torch.is_complex(param):
            raise RuntimeError("Adafactor does not support complex parameters")
        if param.grad.is_sparse:
            raise RuntimeError("Adafactor does not support sparse gradients")
        info = shard_info(param)
        self.param, self.state, self.group = param, state, group
        self.shape = tuple(full_shape(param))
        self.numel = math.prod(self.shape)
        self.offset = info.shard_offset if is_sharded(info) else 0
        self.valid = max(0, min(param.numel(), self.numel - self.offset))
        self.group_name = info.group_name if is_sharded(info) else None
        grad = param.grad if not group["maximize"] else -param.grad
        self.grad = grad.reshape(-1)[: self.valid]
        self.factored = len(self.shape) >= 2
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if self.factored:
                state["row_var"] = grad.new_zeros(self.shape[:-1] + (1,))
                state["col_var"] = grad.new_zeros(self.shape[:-2] + (1, self.shape[-1]))
            else:
                state["variance"] = torch.zeros_like(grad)
        self.sums: list[torch.Tensor] = []

    def _row_and_column_of_each_element(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows, columns = self.shape[-2:]
        index = torch.arange(self.offset, self.offset + self.valid, device=self.grad.device)
        return index // columns, index // (rows * columns) * columns + index % columns

    def first_sums(self) -> torch.Tensor:
        """What the whole parameter needs summed before its update: its squared norm, and (if
        factored) the squared gradient summed along each row and each column."""
        squares = [self.param.detach().reshape(-1)[: self.valid].float().square().sum().view(1)]
        if self.factored:
            rows, columns = self.shape[-2:]
            batches = self.numel // (rows * columns)
            row, column = self._row_and_column_of_each_element()
            grad_squared = self.grad.square()
            squares.append(grad_squared.new_zeros(batches * rows).index_add_(0, row, grad_squared))
            squares.append(grad_squared.new_zeros(batches * columns).index_add_(0, column, grad_squared))
        return torch.cat([square.to(self.grad.dtype) for square in squares])

    def update(self) -> torch.Tensor:
        """The state advanced and this shard's (unclipped) update, padding zero."""
        group, state = self.group, self.state
        eps1, eps2 = group["eps"]
        eps1 = torch.finfo(self.param.dtype).eps if eps1 is None else eps1
        state["step"] += 1
        step = state["step"].item()
        one_minus_beta2 = step**group["beta2_decay"]
        lr = _to_scalar(group["lr"])
        param_norm = self.sums[0].item() ** 0.5
        self.alpha = max(eps2, param_norm / self.numel**0.5) * min(lr, 1 / step**0.5)
        if self.factored:
            rows, columns = self.shape[-2:]
            row_sums, column_sums = self.sums[1:].split([self.numel // columns, self.numel // rows])
            state["row_var"].lerp_(row_sums.div_(columns).view_as(state["row_var"]), one_minus_beta2)
            state["col_var"].lerp_(column_sums.div_(rows).view_as(state["col_var"]), one_minus_beta2)
            mean = state["row_var"].mean(dim=-2, keepdim=True).clamp_(min=eps1)
            row, column = self._row_and_column_of_each_element()
            batch = row // rows
            estimate = state["row_var"].reshape(-1)[row] * state["col_var"].reshape(-1)[column] / mean.reshape(-1)[batch]
        else:
            state["variance"].lerp_(self._padded(self.grad).square().view_as(state["variance"]), one_minus_beta2)
            estimate = state["variance"].reshape(-1)[: self.valid].clone()
        return self._padded(estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(self.grad))

    def _padded(self, values: torch.Tensor) -> torch.Tensor:
        """`values` of the shard's valid part, zero-padded to the shard (flat)."""
        return torch.nn.functional.pad(values, [0, self.param.numel() - values.numel()])

    def apply(self, update: torch.Tensor) -> None:
        """Weight decay and the update, clipped by the whole update's norm (`sums`, all-reduced)."""
        lr, group = _to_scalar(self.group["lr"]), self.group
        if group["weight_decay"] != 0:
            self.param.mul_(1 - lr * group["weight_decay"])
        denominator = max(1.0, self.sums[0].item() ** 0.5 / (self.numel**0.5 * group["d"]))
        self.param.add_(update.view_as(self.param), alpha=-self.alpha / denominator)


def _all_reduce_sums(partial: list[torch.Tensor], pieces: list[_FactoredPiece]) -> None:
    """Each piece's `sums`: its `partial` summed over the ranks sharing its parameter (one
    all-reduce per group of ranks), or as it is where the parameter is whole."""
    by_group: dict[str, list[int]] = {}
    for index, piece in enumerate(pieces):
        piece.sums = partial[index]
        if piece.group_name is not None:
            by_group.setdefault(piece.group_name, []).append(index)
    for group_name, indices in by_group.items():
        flat = torch.cat([partial[i].float() for i in indices])
        dist.all_reduce(flat, group=c10d._resolve_process_group(group_name))
        for i, summed in zip(indices, flat.split([partial[i].numel() for i in indices])):
            pieces[i].sums = summed.to(partial[i].dtype)


def step_ledger(optimizer: Muon | Adafactor) -> GraphLedger:
    """What one `step()` of `optimizer` sends from this rank, as a ledger (kind "optimizer"):
    Muon's two all-to-alls per group of ranks sharing sharded matrices (each update's slices to
    its owner, the results back), Adafactor's two all-reduces of partial sums; no entry where
    nothing is sharded. `zerocompile dump` lists it beside the graphs and counts its bytes in the
    step's."""
    entries: list[LedgerEntry] = []
    for group_name, members in _sharded_by_group(optimizer).items():
        process_group = c10d._resolve_process_group(group_name)
        entries_of = _muon_entries if isinstance(optimizer, Muon) else _adafactor_entries
        entries += entries_of(members, process_group.rank(), process_group.size(), len(entries))
    return GraphLedger.of_optimizer_step(entries)


def exchange_bytes(optimizer: Muon | Adafactor) -> int:
    """The bytes this rank sends per `step()` of `optimizer` (its `step_ledger`'s)."""
    return step_ledger(optimizer).sent_bytes


def muon_exchange_bytes(shapes: list[tuple[int, int]], ranks: int) -> list[int]:
    """Each rank's bytes sent per `Muon.step()` over `ranks` ranks for matrices of these full
    shapes, sharded as `shard()` pads them (what `zerocompile plan --muon` counts)."""
    numels = [shard_numel(shape, ranks) for shape in shapes]
    owners = _owners(shapes, ranks)
    return [sum(bytes_sent_each_way(numels, owners, rank, ranks, _WIRE_DTYPE.itemsize)) for rank in range(ranks)]


_Members = list[tuple[torch.Tensor, ShardInfo]]


def _sharded_by_group(optimizer: torch.optim.Optimizer) -> dict[str, _Members]:
    """The optimizer's sharded trainable parameters by the group of ranks sharing them."""
    groups: dict[str, _Members] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            info = shard_info(param)
            if is_sharded(info) and param.requires_grad:
                groups.setdefault(info.group_name, []).append((param, info))
    return groups


def _entry(members: _Members, ranks: int, position: int, **fields: Any) -> LedgerEntry:
    return LedgerEntry(
        params=[info.fqn for _param, info in members],
        param_bytes=[param.numel() * param.element_size() for param, _info in members],
        bucket=position,
        position=position,
        wait_position=position,  # blocking: done before the step goes on
        overlaps=[],
        freed_after=None,
        freed_position=None,
        group_size=ranks,
        **fields,
    )


def _muon_entries(members: _Members, rank: int, ranks: int, first: int) -> list[LedgerEntry]:
    numels = [info.shard_numel for _param, info in members]
    owners = _owners([info.shape for _param, info in members], ranks)
    to_owners, back = bytes_sent_each_way(numels, owners, rank, ranks, _WIRE_DTYPE.itemsize)
    owned = sum(numel for numel, owner in zip(numels, owners) if owner == rank)
    wire = str(_WIRE_DTYPE).removeprefix("torch.")
    return [
        _entry(
            members, ranks, first, op="all_to_all", dtype=wire, input_bytes=sum(numels) * _WIRE_DTYPE.itemsize,
            sent_bytes=to_owners, detail="Muon: each matrix's update slices to its owner, for Newton-Schulz",
            pattern=PAIRWISE,
        ),
        _entry(
            members, ranks, first + 1, op="all_to_all", dtype=wire, input_bytes=ranks * owned * _WIRE_DTYPE.itemsize,
            sent_bytes=back, detail="Muon: the orthogonalised slices back from their owners", pattern=PAIRWISE,
        ),
    ]  # fmt: skip


def _adafactor_entries(members: _Members, rank: int, ranks: int, first: int) -> list[LedgerEntry]:
    def sums(shape: tuple[int, ...]) -> int:  # the norm, and each row's and column's sum if factored
        numel = math.prod(shape)
        return 1 + (numel // shape[-1] + numel // shape[-2] if len(shape) >= 2 else 0)

    first_bytes = 4 * sum(sums(info.shape) for _param, info in members)  # summed in float32
    return [
        _entry(
            members, ranks, first + i, op="all_reduce", dtype="float32", input_bytes=size,
            sent_bytes=predicted_sent_bytes("all_reduce", size, ranks), detail=detail,
        )
        for i, (size, detail) in enumerate(
            [
                (first_bytes, "Adafactor: the parameters' squared norms and the squared gradients' row and column sums"),
                (4 * len(members), "Adafactor: the updates' squared norms"),
            ]
        )
    ]  # fmt: skip


def _emit_ledger_after_each_step(optimizer: Muon | Adafactor) -> None:
    """`_emit_step_ledger` as a step post-hook: it runs once around the whole `step()`, also where
    offload runs the step's own code one bucket of parameters at a time (each bucket's call would
    see only its parameters)."""
    optimizer.register_step_post_hook(_after_step)


def _after_step(optimizer: Muon | Adafactor, args: tuple, kwargs: dict) -> None:
    _emit_step_ledger(optimizer)


def _emit_step_ledger(optimizer: Muon | Adafactor) -> None:
    """The step's ledger to torch's structured trace and the dump directory of the models its
    parameters came from: on the first step, and again only when its sharded parameters change."""
    members = _sharded_by_group(optimizer)
    if not members:
        return
    key = tuple((name, tuple(info.fqn for _param, info in group)) for name, group in members.items())
    if getattr(optimizer, "_zerocompile_dumped", None) == key:
        return
    optimizer._zerocompile_dumped = key
    info = next(iter(members.values()))[0][1]
    dump.emit_ledger(
        dump.dump_dir(info.config.dump_dir),
        f"{type(optimizer).__name__.lower()}@{info.fqn}",
        lambda: step_ledger(optimizer).to_json(),
        origin="optimizer",
    )


# torch's optimizers these step on shards in their place, with the same settings and state.
SHARDED_EQUIVALENTS: dict[type[torch.optim.Optimizer], type[torch.optim.Optimizer]] = {
    torch.optim.Muon: Muon,
    torch.optim.Adafactor: Adafactor,
}


def take_over(optimizer: torch.optim.Optimizer) -> bool:
    """Make a `torch.optim.Muon` or `torch.optim.Adafactor` (those very classes) ours, in place:
    their settings and state are already what ours keep (`shard()` slices state shaped like the
    full parameter). False for any other."""
    equivalent = SHARDED_EQUIVALENTS.get(type(optimizer))
    if equivalent is None:
        return False
    optimizer.__class__ = equivalent
    optimizer._patch_step_function()  # the step hooks wrap each class's own `step`
    _emit_ledger_after_each_step(optimizer)
    return True


def _check_matrix(param: torch.Tensor) -> None:
    shape = full_shape(param)
    if len(shape) != 2:
        info = shard_info(param)
        name = f"parameter '{info.fqn}'" if info is not None else "a parameter"
        raise ValueError(
            f"Muon only supports 2-D parameters, and {name} has shape {tuple(shape)}: choose Muon's "
            "parameters by zerocompile.full_shape(p) (ndim 2) and give the others to AdamW"
        )


def _newton_schulz(update: torch.Tensor, group: dict) -> torch.Tensor:
    return _zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])


def _owners(shapes: list[tuple[int, ...]], ranks: int) -> list[int]:
    """Each matrix's owner: balanced on Newton-Schulz's multiply-adds, max(m, n) * min(m, n)^2."""
    return assign_owners([max(shape) * min(shape) ** 2 for shape in shapes], ranks)


def _orthogonalise_on_owners(updates: list[tuple[torch.Tensor, torch.Tensor, dict]]) -> list[torch.Tensor]:
    """Newton-Schulz of every update: sharded ones on their owners, one exchange per group of
    ranks; whole ones here, as torch does."""
    results: list[torch.Tensor | None] = [None] * len(updates)
    sharded: dict[str, list[int]] = {}
    for index, (param, update, group) in enumerate(updates):
        info = shard_info(param)
        if is_sharded(info):
            sharded.setdefault(info.group_name, []).append(index)
        else:
            results[index] = _newton_schulz(update.view(full_shape(param)), group)
    for group_name, indices in sharded.items():
        shapes = [tuple(full_shape(updates[i][0])) for i in indices]
        process_group = c10d._resolve_process_group(group_name)
        orthogonal = compute_on_owners(
            [updates[i][1].to(_WIRE_DTYPE) for i in indices],
            shapes,
            _owners(shapes, process_group.size()),
            process_group,
            lambda k, matrix: _newton_schulz(matrix, updates[indices[k]][2]),
        )
        for i, result in zip(indices, orthogonal):
            results[i] = result
    return results
