"""The parameters users see after `shard()`: DTensors of the full shape, over the flat shards that
the compiled graphs, the optimizers' steps and every zerocompile module work on.

Each sharded parameter is two objects, linked by a `ParameterLink`:

- its *shard*: the Parameter object the model held before `shard()` (so references taken before
  keep pointing at it), its data this rank's padded flat shard, carrying `ShardInfo` as `_zero`.
  The module properties read it, so it is the compiled graphs' input; it is not registered.
- its *parameter*: a `Shard(0)` DTensor of the full shape over the shard group whose local tensor
  is a view of the shard's valid rows (`zerocompile.dtensors.as_dtensor`: same storage), registered
  in the module under the parameter's name. `model.parameters()`, `state_dict()`, `p.dim()`,
  `p.shape`, `p.numel()`, `torch.nn.utils.clip_grad_norm_`, DCP and FSDP2's tools see it, as they
  see FSDP2's parameters.

Gradients. The backward accumulates into the shard; a post-accumulate-grad hook on the shard
moves each gradient on into the parameter's `.grad`, a DTensor view of the padded flat gradient
(no copy: the first gradient is kept, later ones are added in place); the flat gradient hangs
on that view (`_zero_flat`), so `zero_grad()` and `p.grad = None`, which act on the parameter,
free it, and the shard holds no gradient between backward passes.
A gradient the user set on the parameter is adopted (one padded copy) the next time one is added
or an optimizer steps.

The optimizer step. Stepping DTensors pays DTensor's dispatch per op (AdamW over 148 parameters:
foreach 1.34-1.67x, fused 2.3-3.9x the time on plain tensors, measured here). So `LocalStep`
swaps, for the step only, each group's list for one holding the shards (made once per list)
and sets each shard's `.grad` to the padded flat gradient and the optimizer's `state` for the flat state it keeps,
keyed by the shards; after the step users' `state` holds the same tensors as DTensor views, keyed
by the parameters (what `get_optimizer_state_dict` reads). The views are made once, when a state
tensor first appears; a state that was replaced (`load_state_dict`) is taken back into flat
tensors at the next step.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from zerocompile.dtensors import as_dtensor, shard_mesh, shard_of
from zerocompile.gathered import is_gathered
from zerocompile.meta_init import local_slice
from zerocompile.sharded_modules import data_replaced_message
from zerocompile.sharded_parameters import (
    ShardInfo,
    is_sharded,
    shard_info,
    shard_of_parameter,
    user_parameter,
)


class ParameterLink:
    """One sharded parameter's two objects. The padded flat gradient behind `param.grad` hangs on
    that DTensor (`_zero_flat`), not here: `zero_grad()` frees it."""

    __slots__ = ("shard", "param", "info", "mesh", "shape", "shown", "__weakref__")

    def __init__(self, shard: nn.Parameter, info: ShardInfo, mesh: DeviceMesh) -> None:
        self.shard, self.info, self.mesh, self.shape = shard, info, mesh, torch.Size(info.shape)
        self.shown: dict[str, Any] = {}  # the step's state values users' state shows, by key
        # A Parameter as nn.Parameter(dtensor) makes one, without its detach(): a DTensor op whose
        # cached sharding would keep the mesh, and its group, past the world's end and hand it
        # to a later world's parameters (pytorch/pytorch#172504).
        self.param = as_dtensor(shard.data, info, mesh).requires_grad_(shard.requires_grad)
        self.param._is_param = True
        self.param._zero = info
        self.param._zero_link = self
        shard._zero_link = self
        if shard.requires_grad:  # a frozen one computes no gradient (unfrozen later: see LocalStep.before)
            shard.register_post_accumulate_grad_hook(_hook_of(weakref.ref(self)))

    def follow_shard(self) -> None:
        """After the shard's data was replaced (`model.to(...)`, `model.half()`): the parameter
        shows the new data (same object, so optimizers and references keep it)."""
        local, data = self.param._local_tensor, self.shard.data
        same_place = local.dtype == data.dtype and local.device == data.device
        if same_place and local.untyped_storage().data_ptr() == data.untyped_storage().data_ptr():
            return
        if data.device.type != self.mesh.device_type:
            self.mesh = shard_mesh(self.info, data.device)
        fresh = self.view(data)
        self.param.data = fresh  # the wrapper's dtype and device; its local tensor and spec next
        self.param._local_tensor, self.param._spec = fresh._local_tensor, fresh._spec

    def view(self, flat: torch.Tensor) -> DTensor:
        """A flat padded tensor of the shard's layout as a DTensor of the full shape (same storage).
        One of the parameter's dtype and device (every gradient, most state) reuses its spec, as
        FSDP2 does (`DTensor.from_local` cost 3x the time), and skips DTensor's `__init__`, which
        does nothing behind a `torch._disable_dynamo` wrapper that cost more than the rest of the
        backward's gradient hook: a backward makes one view per parameter."""
        local, spec = self.param._local_tensor, self.param._spec
        if flat.dtype != local.dtype or flat.device != local.device:
            return as_dtensor(flat, self.info, self.mesh)
        rows = flat[: local.numel()].view(local.shape)
        if torch.compiler.is_compiling():  # traced (compiled autograd): the constructor Dynamo knows
            return DTensor(rows, spec, requires_grad=False)
        return DTensor.__new__(DTensor, rows, spec, requires_grad=False)

    def padded_grad(self) -> torch.Tensor | None:
        """The parameter's gradient as a padded flat tensor of the shard's layout: the one behind
        `param.grad` (no copy), or, for a gradient the user set, a padded copy it adopts."""
        grad = self.param.grad
        if grad is None:
            return None
        flat = grad.__dict__.get("_zero_flat")
        return self._adopt(grad) if flat is None else flat

    def _adopt(self, grad: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if isinstance(grad, DTensor):
                flat = shard_of(grad, self.info)
            else:
                flat = local_slice(grad.reshape(-1), self.info.shard_numel, self.info.group_rank)
        return self._hold(flat.to(self.shard.dtype))

    def _hold(self, flat: torch.Tensor) -> torch.Tensor:
        view = self.view(flat)
        view._zero_flat = flat
        self.param.grad = view
        return flat

    def _take_gradient(self, shard: nn.Parameter) -> None:
        """The shard's post-accumulate-grad hook: its gradient moves on to the parameter."""
        if is_gathered(shard):
            return  # full inside gathered(): `gathered` refuses a gradient there at exit
        grad, shard.grad = shard.grad, None
        if grad is None or not self.param.requires_grad:
            return  # frozen after shard(): the gradient is dropped, as it would not have been computed
        self.add_gradient(grad)

    def add_gradient(self, flat: torch.Tensor) -> None:
        """Add a padded flat gradient of the shard's layout to the parameter's: the first one is
        kept as it is, later ones are added in place."""
        with torch.no_grad():
            held = self.padded_grad()
            if held is None:
                self._hold(flat)
            else:
                held.add_(flat)


def _hook_of(link: weakref.ref[ParameterLink]) -> Callable[[nn.Parameter], None]:
    """The shard's gradient hook, holding its link weakly: torch keeps a tensor's hooks where the
    garbage collector does not look, so a strong one would keep the link, the shard and the
    parameter (and the mesh with its group) alive after the model's end."""

    def take_gradient(shard: nn.Parameter) -> None:
        alive = link()
        if alive is not None:
            alive._take_gradient(shard)

    return take_gradient


def link_of(param: torch.Tensor) -> ParameterLink | None:
    """The link of a sharded parameter (its DTensor or its shard); None for any other tensor."""
    return getattr(param, "_zero_link", None)


def flat_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient of `param` (a DTensor parameter or its shard) in the shard's padded flat layout;
    a parameter without a link (stage 0, unsharded) answers its own `.grad`."""
    link = link_of(param)
    return param.grad if link is None else link.padded_grad()


def link_parameters(shards: Iterable[nn.Parameter]) -> None:
    """A link (and so a DTensor parameter) for every sharded Parameter among `shards`."""
    meshes: dict[tuple[str, str], DeviceMesh] = {}
    for shard in shards:
        info = shard_info(shard)
        if not is_sharded(info):
            continue
        key = (info.group_name, shard.device.type)
        if key not in meshes:
            meshes[key] = shard_mesh(info, shard.device)
        ParameterLink(shard, info, meshes[key])


_SHAPE = operator.attrgetter("shape")


class _GroupOnShards:
    """One parameter group's list as its step sees it (each linked parameter's shard in its place)
    and what the step's swap walks: made once per list, so a step's host work is a loop over the
    linked parameters and a comparison of their shapes, not DTensor's dispatch."""

    __slots__ = ("params", "length", "shards", "linked", "linked_params", "linked_shards", "shapes", "frozen")

    def __init__(self, params: list) -> None:
        links = [link_of(param) for param in params]
        self.params, self.length = params, len(params)
        self.shards = [param if link is None else link.shard for param, link in zip(params, links)]
        linked = [link for link in links if link is not None]
        self.linked = [(link.shard, link.param, link) for link in linked]
        self.linked_params = [link.param for link in linked]
        self.linked_shards = [link.shard for link in linked]
        self.shapes = [link.shape for link in linked]
        self.frozen = [link for link in linked if not link.shard.requires_grad]

    def problem(self) -> str | None:
        """What makes stepping this group wrong: a parameter replaced through `param.data = t`
        (which sets a DTensor's shape, not its rows), or one unfrozen after `shard()`."""
        if list(map(_SHAPE, self.linked_params)) != self.shapes:
            link = next(link for _, param, link in self.linked if param.shape != link.shape)
            return data_replaced_message(link.info, link.param)
        for link in self.frozen:
            if link.param.requires_grad:
                return (
                    f"parameter '{link.info.fqn}' was frozen when zerocompile.shard() ran and is trainable now: "
                    "its shard computes no gradient, so it would never train. Set requires_grad before "
                    "zerocompile.shard() (freezing after it is fine: its gradients are dropped)"
                )
        return None


class LocalStep:
    """An optimizer's steps on the shards while users' groups and state hold DTensor parameters (see
    the module docstring). Kept on the optimizer as `_zero_local_step`; `before` and `after` run
    from the process-wide step hooks of `zerocompile.process_hooks`."""

    def __init__(self) -> None:
        self.user_state: Any = None  # optimizer.state as users see it (keyed by parameters)
        self.flat_state: Any = None  # the state the step sees (keyed by shards)
        self.user_groups: list[list[torch.Tensor]] | None = None
        self.groups: dict[int, _GroupOnShards] = {}
        self.shown_entries = -1

    @staticmethod
    def of(optimizer: torch.optim.Optimizer) -> LocalStep:
        step = optimizer.__dict__.get("_zero_local_step")
        if step is None:
            step = optimizer._zero_local_step = LocalStep()
            optimizer.register_state_dict_pre_hook(lambda optimizer: step.show_state() if optimizer.state is step.user_state else None)
        return step

    def before(self, optimizer: torch.optim.Optimizer, args: tuple = (), kwargs: dict | None = None) -> tuple[tuple, dict] | None:
        """Groups and state swapped onto the shards for the step; the step's arguments with its
        closure (if any) wrapped to run on users' objects (`_closure_on_parameters`), else None."""
        self._swap_to_shards(optimizer)
        return self._closure_on_parameters(optimizer, args, kwargs or {})

    def _closure_on_parameters(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """torch's optimizers call a step's closure (zero_grad, forward, backward) inside the
        step, after its pre-hooks: it must see the DTensor parameters and their gradients, and
        the step the shards holding the gradients it made."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0]: the optimizer
        if closure is None:
            return None

        def closure_on_parameters() -> Any:
            self.after(optimizer)
            try:
                return closure()
            finally:
                self._swap_to_shards(optimizer)

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_on_parameters}
        return (args[0], closure_on_parameters, *args[2:]), kwargs

    def _swap_to_shards(self, optimizer: torch.optim.Optimizer) -> None:
        if self.user_groups is not None:  # the last step raised before `after`: still swapped
            self.after(optimizer)
        if optimizer.state is not self.user_state:
            self._take_state(optimizer)
        self.user_groups = []
        for group in optimizer.param_groups:
            params = group["params"]
            self.user_groups.append(params)
            on_shards = self._on_shards(group, params)
            problem = on_shards.problem()
            if problem is not None:
                self.after(optimizer)
                raise RuntimeError(problem)
            for shard, param, link in on_shards.linked:
                grad = param.grad
                if grad is not None:
                    flat = grad.__dict__.get("_zero_flat")
                    shard.grad = link._adopt(grad) if flat is None else flat
            group["params"] = on_shards.shards
        optimizer.state = self.flat_state

    def _on_shards(self, group: dict, params: list) -> _GroupOnShards:
        on_shards = self.groups.get(id(group))
        if on_shards is None or on_shards.params is not params or on_shards.length != len(params):
            on_shards = self.groups[id(group)] = _GroupOnShards(params)
        return on_shards

    def after(self, optimizer: torch.optim.Optimizer) -> None:
        if self.user_groups is None:
            return
        for group, params in zip(optimizer.param_groups, self.user_groups):
            for shard in self._on_shards(group, params).linked_shards:
                shard.grad = None  # the gradient stays the parameter's; the hook expects none here
            group["params"] = params
        self.user_groups = None
        optimizer.state = self.user_state
        if len(self.flat_state) != self.shown_entries:  # a step made state: show it (once per parameter)
            self.show_state()

    def show_state(self) -> None:
        """Users' state shows the step's: a DTensor view of each new or replaced flat tensor. After a
        step only when entries appeared (torch's optimizers update their state in place); in full
        before `state_dict()` (a hook), so what is saved is what the step holds."""
        flat, user = self.flat_state, self.user_state
        if flat is None:
            return
        for shard, state in flat.items():
            link = link_of(shard)
            if link is None:
                user[shard] = state
                continue
            seen = link.shown
            if len(seen) != len(state) or link.param not in user or any(seen.get(k) is not v for k, v in state.items()):
                user[link.param] = {k: self._shown(link, v) for k, v in state.items()}
                link.shown = dict(state)
        self.shown_entries = len(flat)

    def _take_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Users' state (new, or replaced by `load_state_dict`) into the flat state the step sees."""
        user, flat = optimizer.state, type(optimizer.state)(dict)
        for param, state in user.items():
            link = link_of(param)
            if link is None:
                flat[param] = state
                continue
            flat[link.shard] = {k: self._flat(link, v) for k, v in state.items()}
            user[param] = {k: self._shown(link, v) for k, v in flat[link.shard].items()}
            link.shown = dict(flat[link.shard])
        self.user_state, self.flat_state = user, flat

    @staticmethod
    def _flat(link: ParameterLink, value: Any) -> Any:
        if isinstance(value, DTensor):
            shown = value.__dict__.get("_zero_flat")  # a view `_shown` made: the flat tensor itself
            return shown if shown is not None else shard_of(value, link.info)
        return value  # a plain full-shape tensor stays: the step's check names how it got there

    @staticmethod
    def _shown(link: ParameterLink, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and tuple(value.shape) == (link.info.shard_numel,):
            shown = link.view(value)
            shown._zero_flat = value
            return shown
        return value


def show_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Groups and state of `optimizer` that name shards (it was built before `shard()`) name their
    DTensor parameters instead, as users' groups always do between steps."""
    for group in optimizer.param_groups:
        group["params"] = [user_parameter(param) for param in group["params"]]
    state = optimizer.state
    for key in [key for key in state if link_of(key) is not None and link_of(key).shard is key]:
        link = link_of(key)
        state[link.param] = {k: LocalStep._shown(link, v) for k, v in state.pop(key).items()}


@contextlib.contextmanager
def on_shards(*optimizers: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, each optimizer's groups and state are the shards' as its step sees them (for code
    that walks an optimizer outside its step: `GradScaler.unscale_`, zerocompile's checkpoints)."""
    entered: list[torch.optim.Optimizer] = []
    try:
        for optimizer in optimizers:
            LocalStep.of(optimizer).before(optimizer)
            entered.append(optimizer)
        yield
    finally:
        for optimizer in entered:
            LocalStep.of(optimizer).after(optimizer)


def flat_state(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, dict[str, Any]]:
    """`optimizer.state` as its step sees it: keyed by the shards, each DTensor view users see as
    the flat tensor behind it."""
    return {
        shard_of_parameter(param): {
            k: (v.__dict__.get("_zero_flat", v) if isinstance(v, DTensor) else v) for k, v in state.items()
        }
        for param, state in optimizer.state.items()
    }
