"""Every tensor zerocompile hands to a collective lives on its parameters' device (issue 18), and
`init_distributed()` / `group_device()` pick devices a GPU job can use.

NCCL takes only CUDA tensors. A tensor made without naming a device (`torch.tensor(0.)`,
`torch.zeros(1)`) is a CPU tensor; handed to an NCCL collective it crashes its rank while the
others wait for it. This machine has only a CPU, where such a tensor lands on the parameters'
device by accident, so the audit makes the accident visible: every tensor a factory function
makes without being told a device is tagged, and so is whatever is computed from tagged tensors
alone (as a GPU would keep it on the CPU). A collective handed a tagged tensor, or one off the
parameters' device, is a finding. Findings are recorded, not raised: the collective still runs,
so a finding fails the test instead of leaving the other ranks waiting.

The audit watches both doors to a collective: `ProcessGroup`'s methods, which every eager
`torch.distributed` call goes through (object collectives and DCP's included), and the functional
collectives (`torch.ops._c10d_functional`) that the compiled graphs, the markers' eager kernels
and DTensor call. Tagging follows Python-level torch calls and is switched off while a
compiled model runs (Dynamo would trace the mode and compile other graphs than the ones to
audit); there the device check alone applies, and the graphs' collectives take tensors computed
from the shards.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_leaves

import zerocompile as zc
from models import BatchNormMLP
from ranks import run_cases, run_on_ranks
from training import train
from zerocompile import distributed as zc_distributed
from zerocompile.sharded_parameters import shard_info
from zerocompile.config import ZeroConfig, refuse_gloo_gathers_on_accelerator

WORLD_SIZE = 2
# Every eager torch.distributed collective ends in one of these ProcessGroup methods.
PROCESS_GROUP_COLLECTIVES = (
    "_allgather_base", "_reduce_scatter_base", "all_gather_single", "all_gather_single_coalesced",
    "all_to_all_single", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "allreduce", "allreduce_coalesced", "alltoall", "alltoall_base", "broadcast", "gather", "recv",
    "recv_anysource", "reduce", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "scatter", "send",
)
FUNCTIONAL_COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
_TAG = "_cpu_bound"


def _tensors(*values: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(values) if isinstance(leaf, torch.Tensor)]


def cpu_bound(tensor: torch.Tensor) -> bool:
    """Whether a GPU job would hold `tensor` on the CPU (see `TagCpuBoundTensors`)."""
    return getattr(tensor, _TAG, False)


class TagCpuBoundTensors(TorchFunctionMode):
    """Tags the tensors a GPU job would hold on the CPU: made by a factory function without a
    device (and not from a tensor, whose device it would follow), moved by `.cpu()`, or computed
    from tagged tensors alone (a CPU scalar next to a CUDA tensor yields a CUDA tensor, so one
    untagged input means an untagged result). `.to(device)` naming a device gives an untagged
    tensor. A device named as a literal "cpu" passes unnoticed: on this machine it is the
    parameters' device."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = _tensors(args, kwargs)
        moved = func is torch.Tensor.cpu or (func is torch.Tensor.to and _device_named(args[1:], kwargs))
        if moved and result is args[0]:
            result = result.view_as(result)  # a GPU job gets a new tensor here, not its input back
        if func in _device_constructors():
            tag = kwargs.get("device") is None and not inputs
        elif moved:
            tag = func is torch.Tensor.cpu
        else:
            tag = bool(inputs) and all(cpu_bound(t) for t in inputs)
        if tag:
            for output in _tensors(result):
                setattr(output, _TAG, True)
        return result


def _device_named(to_args: tuple, to_kwargs: dict) -> bool:
    """Whether `Tensor.to(*to_args, **to_kwargs)` names a device."""
    settings = {key: value for key, value in to_kwargs.items() if key != "copy"}  # _parse_to lacks it
    return torch._C._nn._parse_to(*to_args, **settings)[0] is not None


@dataclasses.dataclass
class Finding:
    collective: str
    device: str
    cpu_bound: bool
    caller: str  # the innermost zerocompile line on the way to it

    def __str__(self) -> str:
        why = "a GPU job would hold on the CPU" if self.cpu_bound else f"on {self.device}"
        return f"{self.collective} got a tensor {why}, from {self.caller}"


class CollectiveDeviceAudit:
    """Findings of the collectives run while `watching()`: tensors off `device` or tagged."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.findings: list[Finding] = []
        self.collectives_seen = 0
        self.inside_op = False

    def check(self, collective: str, args: tuple, kwargs: dict) -> None:
        tensors = _tensors(args, kwargs)
        if any(t.is_meta or isinstance(t, FakeTensor) for t in tensors):
            return  # traced (by Dynamo, or the lowering's make_fx), not run
        self.collectives_seen += 1
        for tensor in tensors:
            if tensor.device != self.device or cpu_bound(tensor):
                caller = next(
                    (f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(traceback.extract_stack())
                     if "/zerocompile/" in f.filename),
                    "outside zerocompile",
                )
                self.findings.append(Finding(collective, str(tensor.device), cpu_bound(tensor), caller))

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        process_group = torch._C._distributed_c10d.ProcessGroup
        overload, packet = torch._ops.OpOverload, torch._ops.OpOverloadPacket
        # The class attributes themselves (pybind's method descriptors), to put back as they were.
        saved = {(owner, name): vars(owner)[name] for owner, name in [
            *[(process_group, name) for name in PROCESS_GROUP_COLLECTIVES if name in vars(process_group)],
            (overload, "__call__"), (packet, "__call__"),
        ]}
        for (owner, name), method in saved.items():
            if owner is process_group:
                setattr(owner, name, self._checking_method(f"ProcessGroup.{name}", method.__get__))
        overload.__call__ = self._checking_op_call(vars(overload)["__call__"], lambda op: op.namespace)
        packet.__call__ = self._checking_op_call(
            vars(packet)["__call__"], lambda op: op._qualified_op_name.split("::")[0]
        )
        try:
            yield
        finally:
            for (owner, name), method in saved.items():
                setattr(owner, name, method)

    def _checking_method(self, collective: str, bind: Callable) -> Callable:
        def checked(group: Any, *args: Any, **kwargs: Any) -> Any:
            self.check(collective, args, kwargs)
            return bind(group)(*args, **kwargs)

        return checked

    def _checking_op_call(self, call: Callable, namespace_of: Callable[[Any], str]) -> Callable:
        def checked(op: Any, /, *args: Any, **kwargs: Any) -> Any:
            if namespace_of(op) not in FUNCTIONAL_COLLECTIVE_NAMESPACES or self.inside_op:
                return call(op, *args, **kwargs)
            # Checked once per call: a torch function mode re-enters the op it intercepts.
            self.check(str(op), args, kwargs)
            self.inside_op = True
            try:
                return call(op, *args, **kwargs)
            finally:
                self.inside_op = False

        return checked


# ---------------------------------------------------------------------------------------------
# On 2 ranks: every public entry point under the audit; clipping where ranks hold only padding


def _audited_model() -> nn.Module:
    """Buffers (BatchNorm: broadcast by shard(), the forward and gathered()) and a one-element
    bias that only rank 0 holds more than padding of."""
    return BatchNormMLP(7, 13, 1, torch.tanh)


class Tiny(nn.Module):
    """One-element parameters: every rank but 0 holds only padding of each."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).square().mean()


def _batch(features: int, step: int, rank: int, world_size: int) -> torch.Tensor:
    return torch.randn(8, features, generator=torch.Generator().manual_seed(300 + step)).chunk(world_size)[rank]


def entry_points(stage: int, rank: int, world_size: int, tmp: Path) -> dict[str, Callable[[], Any]]:
    """Each public entry point as a job makes them, one after another on one model. Eager code runs
    under tagging; compiled calls do not (see the module docstring)."""
    tagged = TagCpuBoundTensors
    torch.manual_seed(0)
    model = _audited_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    made: dict[str, Any] = {}

    def backward(step: int) -> None:
        compiled(_batch(7, step, rank, world_size)).backward()

    def step_optimizer() -> None:
        with tagged():
            optimizer.step()
            optimizer.zero_grad()

    def shard() -> None:
        with tagged():
            zc.shard(model, stage=stage, optimizer=optimizer)

    def shard_meta_built() -> None:
        with torch.device("meta"):
            built = _audited_model()
        with tagged():
            zc.shard(built, stage=stage)

    def compiled_step() -> None:
        backward(0)
        step_optimizer()

    def clip() -> None:
        backward(1)
        with tagged():
            zc.clip_grad_norm_(model, 0.1)
            zc.clip_grad_norm_(model, 0.1, norm_type=math.inf)
        step_optimizer()

    def no_sync() -> None:
        with zc.no_sync(compiled):
            backward(2)
        backward(3)
        step_optimizer()

    def gathered() -> None:
        with tagged(), zc.gathered(model), torch.no_grad():
            model.head.bias.add_(1.0)

    def gathered_read_only() -> None:
        with tagged(), zc.gathered(model, writeback=False):
            pass

    def gathered_failing_on_rank_1() -> None:
        with tagged(), contextlib.suppress(ValueError, RuntimeError), zc.gathered(model):
            if rank == 1:
                raise ValueError("rank 1 fails inside the block")

    def ema() -> None:
        with tagged():
            made["ema"] = zc.EMA(model, decay=0.9)
            made["ema"].update()
            made["ema"].full_state_dict()

    def save() -> None:
        with tagged():
            zc.save(tmp / f"ckpt-{stage}", model, optimizer, made["ema"], step=1)

    def load() -> None:
        with tagged():
            zc.load(tmp / f"ckpt-{stage}", model, optimizer, made["ema"])

    def full_state_dict() -> None:
        with tagged():
            zc.full_state_dict(model)

    def save_weights() -> None:
        with tagged():
            zc.save_weights(model, tmp / f"weights-{stage}")

    def load_weights() -> None:
        with tagged():
            zc.load_weights(model, tmp / f"weights-{stage}")

    def grad_scaler() -> None:
        scaler = zc.ShardedGradScaler("cpu", init_scale=16.0)
        scaler.scale(compiled(_batch(7, 4, rank, world_size))).backward()
        with tagged():
            scaler.unscale_(optimizer)
            zc.clip_grad_norm_(model, 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

    def inference() -> None:
        model.eval()
        with torch.no_grad():
            compiled(_batch(7, 5, rank, world_size))
        model.train()

    calls = {
        "shard": shard,
        "shard of a meta-built model": shard_meta_built,
        "compiled step": compiled_step,
        "clip_grad_norm_": clip,
        "no_sync": no_sync,
        "gathered": gathered,
        "gathered(writeback=False)": gathered_read_only,
        "gathered, failing on one rank": gathered_failing_on_rank_1,
        "EMA": ema,
        "save": save,
        "load": load,
        "full_state_dict": full_state_dict,
        "save_weights": save_weights,
        "load_weights": load_weights,
        "ShardedGradScaler": grad_scaler,
        "compiled inference": inference,
    }
    assert tuple(calls) == ENTRY_POINTS
    return calls


ENTRY_POINTS = (
    "shard", "shard of a meta-built model", "compiled step", "clip_grad_norm_", "no_sync", "gathered",
    "gathered(writeback=False)", "gathered, failing on one rank", "EMA", "save", "load", "full_state_dict",
    "save_weights", "load_weights", "ShardedGradScaler", "compiled inference",
)
STAGES = (0, 3)
# What sends nothing: loading weights (each rank reads its own bytes), and at stage 0, where every
# rank holds whole parameters, reading them whole.
WITHOUT_COLLECTIVES = {
    (0, "gathered(writeback=False)"), (0, "EMA"), (0, "full_state_dict"), (0, "load_weights"), (3, "load_weights"),
}
CLIP_STEPS = 3
# (norm type, dtype of the model): bf16 because a rank holding only padding must also match the
# others' dtype, or the all-reduce's ranks disagree on its size.
CLIP_CASES = ((2.0, torch.float32), (math.inf, torch.float32), (2.0, torch.bfloat16))


def _clipped_training(
    model: nn.Module, forward: Callable, clip: Callable, norm_type: float, rank: int, world_size: int
) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    dtype = next(model.parameters()).dtype
    norms = []

    def clip_tagged() -> None:
        with TagCpuBoundTensors():
            norms.append(clip(model.parameters(), 0.01, norm_type).item())

    batches = (_batch(1, step, rank, world_size).to(dtype) for step in range(CLIP_STEPS))
    train(forward, optimizer, batches, after_backward=clip_tagged)
    return norms


def clip_with_only_padding(rank: int, world_size: int, norm_type: float, dtype: torch.dtype) -> dict[str, Any]:
    """`Tiny` in `dtype` at stage 3 (ranks 1 and up hold only padding) against DDP + torch's clipping."""
    torch.manual_seed(0)
    twin = Tiny().to(dtype)
    ddp = nn.parallel.DistributedDataParallel(twin)
    ddp_norms = _clipped_training(twin, ddp, torch.nn.utils.clip_grad_norm_, norm_type, rank, world_size)
    torch.manual_seed(0)
    model = zc.shard(Tiny().to(dtype), stage=3)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    norms = _clipped_training(model, compiled, zc.clip_grad_norm_, norm_type, rank, world_size)
    with zc.gathered(model, writeback=False):
        error = max((p - dict(twin.named_parameters())[n]).abs().max().item() for n, p in model.named_parameters())
    infos = [shard_info(p) for p in model.parameters()]
    real = sum(max(0, min(info.shard_numel, info.numel - info.shard_offset)) for info in infos)
    return {"norms": norms, "ddp_norms": ddp_norms, "parameter_error": error, "real_elements_held": real}


def _audited(cases: dict[Any, Callable[[], Any]]) -> dict[Any, Any]:
    """Each case's result, the collectives it ran and their findings; a case that raised has its
    traceback instead."""

    def watched(call: Callable[[], Any]) -> dict[str, Any]:
        audit = CollectiveDeviceAudit(torch.device("cpu"))
        with audit.watching():
            result = call()
        findings = [str(finding) for finding in audit.findings]
        return {"findings": findings, "collectives": audit.collectives_seen, "result": result}

    return run_cases((key, lambda call=call: watched(call)) for key, call in cases.items())


def entry_points_report(rank: int, world_size: int, tmp: Path) -> dict[Any, Any]:
    """{(stage, entry point): audited case}."""
    report = {}
    for stage in STAGES:
        torch._dynamo.reset()
        calls = entry_points(stage, rank, world_size, tmp)
        report.update(_audited({(stage, name): call for name, call in calls.items()}))
    return report


def clip_report(rank: int, world_size: int) -> dict[Any, Any]:
    """{(norm type, dtype): audited case}. In a group of its own: on a rank holding only padding,
    torch's float32 zero beside the other ranks' bf16 norms aborts gloo (its sizes differ)."""
    def case(norm_type: float, dtype: torch.dtype) -> Callable[[], Any]:
        def run() -> dict[str, Any]:
            torch._dynamo.reset()
            return clip_with_only_padding(rank, world_size, norm_type, dtype)

        return run

    return _audited({(norm_type, dtype): case(norm_type, dtype) for norm_type, dtype in CLIP_CASES})


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return run_on_ranks(WORLD_SIZE, entry_points_report, tmp_path_factory.mktemp("audit"), timeout=300)


@pytest.fixture(scope="module")
def clipping() -> list[dict[Any, Any]]:
    return run_on_ranks(WORLD_SIZE, clip_report, timeout=300)


def _case(report: list[dict[Any, Any]], key: Any) -> list[dict[str, Any]]:
    cases = [rank_report[key] for rank_report in report]
    for rank, case in enumerate(cases):
        assert isinstance(case, dict), f"rank {rank} failed:\n{case}"
    return cases


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_collectives_take_tensors_on_the_parameters_device(report, stage: int, entry_point: str) -> None:
    cases = _case(report, (stage, entry_point))
    findings = {rank: case["findings"] for rank, case in enumerate(cases) if case["findings"]}
    assert not findings, f"tensors off the parameters' device reached collectives: {findings}"
    silent = (stage, entry_point) in WITHOUT_COLLECTIVES
    assert all((case["collectives"] == 0) == silent for case in cases), [case["collectives"] for case in cases]


@pytest.mark.parametrize(("norm_type", "dtype"), CLIP_CASES)
def test_clip_on_ranks_holding_only_padding_gives_ddps_norm(clipping, norm_type: float, dtype: torch.dtype) -> None:
    cases = _case(clipping, (norm_type, dtype))
    held = [case["result"]["real_elements_held"] for case in cases]
    assert held == [2] + [0] * (WORLD_SIZE - 1), "ranks 1 and up hold only padding"
    for rank, case in enumerate(cases):
        assert not case["findings"], case["findings"]
        result = case["result"]
        assert result["norms"] == pytest.approx(result["ddp_norms"], rel=1e-6, abs=0), f"rank {rank}"
        assert result["parameter_error"] <= 1e-6, f"rank {rank}"


# ---------------------------------------------------------------------------------------------
# In this process: the audit itself, group_device() and init_distributed()'s device


@pytest.fixture
def cpu_gloo_world():
    """A one-rank world whose only backend is gloo for CPU tensors ("cpu:gloo")."""
    assert not dist.is_initialized()
    dist.init_process_group("cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_audit_finds_the_tensors_a_gpu_job_would_hold_on_the_cpu_and_only_those(cpu_gloo_world) -> None:
    parameter = torch.ones(3)
    audit = CollectiveDeviceAudit(parameter.device)
    funcol = torch.ops._c10d_functional
    process_group = torch._C._distributed_c10d.ProcessGroup
    methods = dict(vars(process_group))
    with audit.watching(), TagCpuBoundTensors():
        dist.all_reduce(torch.tensor(0.0).pow(2))  # torch's norm of nothing, squared: found
        funcol.wait_tensor(funcol.all_reduce(torch.zeros(2), "sum", cpu_gloo_world.group_name))  # found twice
        dist.all_reduce(parameter.cpu())  # found
        dist.all_reduce(torch.zeros((), device=parameter.device))
        dist.all_reduce(parameter.new_zeros(()))
        dist.all_reduce(parameter.sum() + torch.tensor(1.0))  # a CUDA tensor plus a CPU scalar is CUDA
        dist.all_reduce(torch.tensor(1.0).to(parameter.device))
        dist.all_gather_object([None], {"an": "object"})  # torch puts its tensors on the group's device
    assert [(f.collective, f.cpu_bound, f.caller) for f in audit.findings] == [
        ("ProcessGroup.allreduce", True, "outside zerocompile"),
        ("_c10d_functional.all_reduce", True, "outside zerocompile"),
        ("_c10d_functional.wait_tensor", True, "outside zerocompile"),
        ("ProcessGroup.allreduce", True, "outside zerocompile"),
    ]
    assert audit.collectives_seen == 10
    assert vars(process_group) == methods, "ProcessGroup is as it was"


@pytest.fixture
def accelerator_present(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """This process looks as if it had a current CUDA device, cuda:0."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    return torch.device("cuda", 0)


def test_group_device_is_the_accelerator_only_where_a_non_gloo_backend_runs_it(
    cpu_gloo_world, accelerator_present, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU for "cpu:gloo" (whose `get_backend` is not "gloo") and plain gloo groups, cuda:0
    where nccl runs CUDA tensors."""
    assert dist.get_backend(cpu_gloo_world) == "cpu:gloo"
    plain_gloo = dist.new_group([0], backend="gloo")
    assert zc_distributed.group_device(cpu_gloo_world) == torch.device("cpu")
    assert zc_distributed.group_device(plain_gloo) == torch.device("cpu")
    for config in ("cpu:gloo,cuda:nccl", "cuda:nccl"):
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None, config=config: config)
        assert zc_distributed.group_device(cpu_gloo_world) == accelerator_present, config


LAUNCHERS = {
    "torchrun": {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
    "srun": {
        "SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3",
        "SLURM_STEP_NODELIST": "127.0.0.1",
    },
}


@dataclasses.dataclass
class Started:
    """What init_distributed asked of CUDA and of torch.distributed, which are mocks here."""

    current_device: list[Any] = dataclasses.field(default_factory=list)
    init_process_group: list[tuple[tuple, dict]] = dataclasses.field(default_factory=list)


def _cuda(device: torch.device | int) -> torch.device:
    """torch.cuda.set_device's argument as a device (it takes an index too)."""
    return device if isinstance(device, torch.device) else torch.device("cuda", device)


def _start(
    monkeypatch: pytest.MonkeyPatch,
    environment: dict[str, str],
    gpus_visible: int,
    backend: str | None = None,
    device: str | None = None,
) -> Started:
    """init_distributed() under `environment` in a process that sees `gpus_visible` GPUs."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(key, raising=False)
    for key in [key for key in os.environ if key.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    started = Started()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus_visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus_visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: started.current_device.append(_cuda(device)))
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kw: started.init_process_group.append((args, kw)))
    zc.init_distributed(backend, device=device)
    return started


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_each_task_seeing_one_gpu_uses_cuda_0(monkeypatch: pytest.MonkeyPatch, launcher: str) -> None:
    """Slurm's --gpus-per-task=1 or a per-task CUDA_VISIBLE_DEVICES: local rank 3 sees one GPU."""
    started = _start(monkeypatch, LAUNCHERS[launcher], gpus_visible=1)
    ((args, kwargs),) = started.init_process_group
    assert started.current_device == [torch.device("cuda", 0)]
    assert args == ("nccl",) and kwargs["device_id"] == torch.device("cuda", 0)
    assert (kwargs["rank"], kwargs["world_size"]) == (3, 4)


def test_each_task_seeing_the_nodes_gpus_uses_its_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    started = _start(monkeypatch, LAUNCHERS["torchrun"], gpus_visible=4)
    assert started.current_device == [torch.device("cuda", 3)]
    assert started.init_process_group[0][1]["device_id"] == torch.device("cuda", 3)


def test_alone_with_a_gpu_binds_cuda_0(monkeypatch: pytest.MonkeyPatch) -> None:
    started = _start(monkeypatch, {}, gpus_visible=2)
    assert started.current_device == [torch.device("cuda", 0)]
    assert started.init_process_group[0][1]["device_id"] == torch.device("cuda", 0)


def test_gloo_binds_no_gpu_even_if_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    started = _start(monkeypatch, LAUNCHERS["torchrun"], gpus_visible=1, backend="gloo")
    assert started.current_device == [] and "device_id" not in started.init_process_group[0][1]


def test_a_cpu_device_starts_gloo_on_a_machine_with_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """`zerocompile train --device cpu` on a GPU node: NCCL would refuse the CPU model's broadcast."""
    started = _start(monkeypatch, LAUNCHERS["torchrun"], gpus_visible=2, device="cpu")
    ((args, kwargs),) = started.init_process_group
    assert args == ("gloo",) and "device_id" not in kwargs and started.current_device == []
    assert _start(monkeypatch, LAUNCHERS["torchrun"], gpus_visible=2, device="cuda").init_process_group[0][0] == ("nccl",)


@pytest.mark.parametrize("tool", ["train", "bench"])
def test_the_tools_start_the_backend_of_their_device(monkeypatch: pytest.MonkeyPatch, tool: str) -> None:
    """Each tool hands its --device to init_distributed (stopped there: nothing else runs)."""
    from zerocompile.tools import train
    from zerocompile.tools.bench.rank import rank_session
    from zerocompile.tools.bench.settings import Settings

    asked: list[Any] = []

    class Started(Exception):
        pass

    def init_distributed(*args: Any, **kwargs: Any) -> None:
        asked.append(kwargs.get("device"))
        raise Started

    monkeypatch.setattr(zc, "init_distributed", init_distributed)
    environment = dict(os.environ)
    with pytest.raises(Started):
        if tool == "train":
            parser = argparse.ArgumentParser()
            train.add_arguments(parser)
            train.train_this_rank(parser.parse_args(["--device", "cpu"]))
        else:
            settings = Settings(
                ranks=2, model_size="tiny", steps=1, warmup=1, batch_size=2, seed=0, modes=(),
                interleave=(), cache_root="unused", device=torch.device("cpu"),
            )  # fmt: skip
            with rank_session(0, settings, cache_name="unused"):
                pass
    assert asked == [torch.device("cpu")]
    assert dict(os.environ) == environment, "a rank's variables come from its spawner, not from the rank's code"


def test_nccl_without_a_visible_gpu_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError, match=r"sees no CUDA device.*backend='gloo'"):
        _start(monkeypatch, LAUNCHERS["torchrun"], gpus_visible=0, backend="nccl")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("backend, device", [("gloo", "cuda:0"), ("gloo", "cpu"), ("nccl", "cuda:0")])
def test_gloo_never_gathers_accelerator_parameters(stage: int, backend: str, device: str) -> None:
    """Stages 1-3 gather parameters with coalesced all-gathers, which gloo cannot run on
    accelerator tensors: on an H200 two gloo ranks sharing cuda:0 matched DDP at stage 0 and a rank
    died (SIGSEGV) at stage 1. shard() refuses that combination, naming the fix, and only that one."""
    config = ZeroConfig(stage=stage)
    if stage > 0 and backend == "gloo" and device != "cpu":
        with pytest.raises(ValueError, match=rf"stage {stage} on a gloo group.*pytorch/pytorch#152645.*use nccl"):
            refuse_gloo_gathers_on_accelerator(config, backend, torch.device(device))
    else:
        refuse_gloo_gathers_on_accelerator(config, backend, torch.device(device))
