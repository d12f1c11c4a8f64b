"""The modules of a sharded model: one `ModuleState` each, and the generated classes whose
properties make every use of a parameter a `zerocompile::unshard` marker.

Each module holding parameters gets a generated subclass whose `weight`/`bias`/... properties
return `zerocompile::unshard(shard)`: a class property wins over `nn.Module.__getattr__`, so model
code is untouched and every use of a parameter becomes a marker in the traced graph. What those
properties, the registration guard, `no_sync` and the state-dict hooks need of a module is its
`ModuleState` (`module._zero_state`), set once by `shard()` through `install_state`. The two parts
a property reads at every use, `access` and `sync`, are bound on the module too (`_zero_access`,
`_zero_sync`): under torch.compile each attribute on the way is traced and guarded, and reading
them through the state was one more guard per module and 3% more of Dynamo's Python calls.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerocompile.passes.markers import REPLICA_KEYWORDS, UNSHARD
from zerocompile.sharded_parameters import ShardInfo, shard_info, sharded_shape, user_parameter, views_its_shard

if TYPE_CHECKING:
    from zerocompile.accumulation import AccumulationSlot, GradientSync

FIX_BEFORE_SHARD = (
    "zerocompile.shard() slices each parameter once, so change the model before it (build the model "
    "again, change it, then shard it), or change values in place under "
    "`with zerocompile.gathered(model): module.weight.copy_(new)`"
)


@dataclasses.dataclass(eq=False)
class ModuleState:
    """What `shard()` recorded on one module of a sharded model (`module._zero_state`); every
    module of the model has one, those without parameters with empty dicts."""

    prefix: str  # its name in the model: what the registration guard names; its mark of a sharded model
    sync: GradientSync  # one per model: what no_sync(model) enters and exits
    shards: dict[str, nn.Parameter]  # its own parameters as shard() left them: what the properties read
    # What it holds in `_parameters` for users: each shard's DTensor parameter (stage 0: the shard).
    params: dict[str, nn.Parameter]
    # The property's one lookup: the shard, its sharded shape and the marker's arguments after the
    # shard (see zerocompile.passes.markers.unshard). The FQN is left out: Dynamo would guard on
    # it, and every block of a model compiled block by block (or split by graph breaks) would then
    # compile a graph of its own. The backend fills it in.
    access: dict[str, tuple[nn.Parameter, tuple[int, ...], tuple, dict[str, Any]]]
    slots: dict[str, AccumulationSlot]  # each parameter's no_sync slot, shared by every module holding it


def module_state(module: nn.Module) -> ModuleState | None:
    """`module`'s state if it belongs to a sharded model, else None (read without nn.Module's
    attribute lookup: the registration guard asks this of every module anything registers on)."""
    return module.__dict__.get("_zero_state")


def install_state(module: nn.Module, prefix: str, sync: GradientSync) -> ModuleState:
    """Record `module`'s state (its parameters already carry their shard info, and the sharded
    ones a DTensor parameter) and, if it holds parameters, register what users see and give it
    the sharded class whose properties read the shards."""
    shards = {name: param for name, param in module._parameters.items() if param is not None}
    params = {name: user_parameter(shard) for name, shard in shards.items()}
    access, slots = {}, {}
    for name, shard in shards.items():
        info = shard_info(shard)
        markers, keywords = info.marker_args(shard.dtype).call()
        access[name] = (shard, sharded_shape(info), markers, keywords)
        slots[name] = sync.slots[info.fqn]
    module._parameters.update(params)  # no registration hook runs: the guard below is not yet armed
    state = ModuleState(prefix=prefix, sync=sync, shards=shards, params=params, access=access, slots=slots)
    module._zero_state = state
    if shards:
        module._zero_access, module._zero_sync = state.access, state.sync  # what the properties read (see above)
        module.__class__ = _sharded_class(type(module), tuple(shards))
    return state


def plain_class(module: nn.Module) -> type:
    """The class a module of the sharded class had before `shard()` (what `gathered()` swaps back
    to for its block)."""
    return type(module)._zero_plain_class


@functools.cache
def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    def make_property(name: str) -> property:
        def full_parameter(self: nn.Module) -> torch.Tensor:
            # What shard() recorded, in one lookup: under torch.compile every attribute this reads
            # is traced and guarded at every use of every parameter. Walking param._zero's
            # ShardInfo, config and stage policy instead was a fifth of Dynamo's work on a GPT
            # (Python calls while tracing a 12-layer one: 5.7M, 4.6M with this lookup).
            param, sharded, markers, keywords = self._zero_access[name]
            # What users hold is checked eagerly only: traced, reading it would make every DTensor
            # parameter an input of the graph, which reads the shard. Replacing one by assignment
            # is refused when it happens (the registration guard of zerocompile.sharding).
            if not torch.compiler.is_compiling():
                held = self._parameters.get(name)
                if held is not self._zero_state.params[name] or not views_its_shard(held, param):
                    _raise_changed_after_shard(self._zero_state, name, held)
            # The shape comparison is decided while tracing (a changed shape fails a guard).
            if tuple(param.shape) != sharded:
                _raise_changed_after_shard(self._zero_state, name, param)
            if self._zero_sync.quiet:  # no no_sync copy or pending gradient: the plain marker
                return UNSHARD(param, *markers, **keywords)
            if self._zero_sync.replicas_deferred:  # reduced inside the shard group only
                return UNSHARD(param, *markers, **{k: v for k, v in keywords.items() if k not in REPLICA_KEYWORDS})
            return self._zero_state.slots[name].marker(param, markers, keywords)

        return property(full_parameter, doc=f"the full `{name}`, gathered from its shards")

    def _apply(self: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
        # nn.Module._apply (`model.to`, `.half()`) swaps a DTensor parameter's contents for a new
        # Parameter's (torch.utils.swap_tensors), cutting it from its shard: it runs on the shards,
        # as before shard(), and each DTensor parameter then shows its shard's new data.
        state = self._zero_state
        state.sync.drop_kept_copies()  # no_sync's copies of the parameters `fn` is about to change
        self._parameters.update(state.shards)
        try:
            return super(sharded, self)._apply(fn, recurse)
        finally:
            self._parameters.update(state.params)
            for shard in state.shards.values():
                link = getattr(shard, "_zero_link", None)
                if link is not None:
                    link.follow_shard()

    attributes: dict[str, Any] = {name: make_property(name) for name in names}
    attributes["_apply"] = _apply
    attributes["_zero_plain_class"] = cls
    sharded = type(cls.__name__, (cls,), attributes)
    return sharded


def _raise_changed_after_shard(state: ModuleState, name: str, param: torch.Tensor | None) -> None:
    """The error for a parameter whose Parameter object or data changed since shard()."""
    info = shard_info(state.shards[name])
    if param is None:
        raise RuntimeError(f"parameter '{info.fqn}' was removed after zerocompile.shard(): {FIX_BEFORE_SHARD}")
    if param is not state.shards[name] and param is not state.params[name]:
        raise RuntimeError(
            f"parameter '{info.fqn}' was replaced after zerocompile.shard() by a new Parameter of shape "
            f"{tuple(param.shape)}, which is not sharded: {FIX_BEFORE_SHARD}"
        )
    raise RuntimeError(data_replaced_message(info, param))


def data_replaced_message(info: ShardInfo, param: torch.Tensor) -> str:
    """The error for a parameter whose data was replaced after shard() (a shape its shard never has)."""
    return (
        f"parameter '{info.fqn}' holds a tensor of shape {tuple(param.shape)}, but at stage {info.stage} "
        f"it is sharded to {sharded_shape(info)} (full shape {info.shape}): its .data was replaced after "
        f"zerocompile.shard(). {FIX_BEFORE_SHARD}"
    )
