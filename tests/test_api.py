"""The user-facing API: starting the group, bad input that must fail with a fix, world size 1."""

from __future__ import annotations

import functools
import weakref

import pytest
import torch
from torch.distributed.tensor import DTensor
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from models import FrozenAndBuffer, TiedGPT, UnevenMLP, local_batch
from ranks import run_on_ranks
from training import train
from zerocompile.tools.spawn import free_loopback_port


@pytest.fixture
def single_rank():
    """A one-rank group in this process, as `init_distributed()` starts it without a launcher."""
    assert not dist.is_initialized()
    assert zc.init_distributed() == (0, 1)
    assert zc.init_distributed() == (0, 1), "a second call is a no-op"
    torch._dynamo.reset()
    yield
    dist.destroy_process_group()


def test_shard_without_process_group_names_init_distributed() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"zerocompile.init_distributed\(\)"):
        zc.shard(UnevenMLP())


def test_stage_outside_0_to_3_is_refused(single_rank) -> None:
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3, got 4"):
        zc.shard(UnevenMLP(), stage=4)
    with pytest.raises(ValueError, match="got 'three'"):
        zc.ZeroConfig(stage="three")


def test_sharding_twice_is_refused(single_rank) -> None:
    model = zc.shard(UnevenMLP(), stage=3)
    with pytest.raises(RuntimeError, match="already sharded"):
        zc.shard(model, stage=2)


def test_meta_and_real_parameters_mixed_are_refused(single_rank) -> None:
    """Real parameters next to meta ones were made on each rank outside shard()'s walk."""
    model = UnevenMLP()
    model.fc2.to("meta")
    with pytest.raises(ValueError, match=r"\['fc1.weight', 'fc1.bias', 'fc3.weight'\] are real tensors .*meta"):
        zc.shard(model)
    assert not any(hasattr(p, "_zero") for p in model.parameters())


def test_unknown_setting_and_option_list_the_valid_ones(single_rank) -> None:
    with pytest.raises(TypeError, match="unknown ZeroConfig setting.*'bucket'"):
        zc.shard(UnevenMLP(), stage=3, bucket=1)
    model = zc.shard(UnevenMLP(), stage=3)
    compiled = torch.compile(model, backend="zero", options={"prefetch_depth": 2})
    with pytest.raises(Exception, match=r"unknown option\(s\) \['prefetch_depth'\].*valid options: \['compiler', 'dump_dir', 'bucket_bytes', 'prefetch', 'check_ranks', 'memory_budget'\]"):
        compiled(torch.randn(2, 7))


@pytest.mark.parametrize(
    "backends, expected",
    [
        ("gloo", 16 * 2**20),
        ("cpu:gloo,cuda:nccl", 16 * 2**20),  # CPU parameters: gloo runs their collectives
        ("cpu:nccl", 25 * 2**20),  # stands in for CUDA parameters under nccl, which this machine lacks
    ],
)
def test_default_bucket_bytes_follow_the_backend_of_the_parameters_device(
    single_rank, monkeypatch: pytest.MonkeyPatch, backends: str, expected: int
) -> None:
    """None until shard() decides: gloo's 4 MiB (measured on CPU ranks), DDP's 25 MiB for any other
    backend. Decided for whole models and meta-built ones alike; a number given is kept."""
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: backends)
    assert zc.ZeroConfig().bucket_bytes is None
    with torch.device("meta"):
        on_meta = UnevenMLP()
    for model in (zc.shard(UnevenMLP(), stage=3), zc.shard(on_meta, stage=3)):
        assert model._zero_config.bucket_bytes == expected
        assert {p._zero.config.bucket_bytes for p in model.parameters()} == {expected}
    chosen = zc.shard(UnevenMLP(), stage=3, bucket_bytes=0)
    assert {p._zero.config.bucket_bytes for p in chosen.parameters()} == {0}


def test_bucket_bytes_option_must_be_a_number() -> None:
    """The backend's default is decided by shard(); a compile option can only override it."""
    with pytest.raises(ValueError, match=r"options=\{'bucket_bytes': None\}: give a number of bytes"):
        zc.ZeroConfig(bucket_bytes=4 * 2**20).with_options({"bucket_bytes": None})
    assert zc.ZeroConfig(bucket_bytes=4 * 2**20).with_options({"bucket_bytes": 0}).bucket_bytes == 0


def test_optimizer_that_stepped_before_shard_must_be_passed_in(single_rank) -> None:
    model = UnevenMLP()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 7)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    zc.shard(model, stage=3)
    model(torch.randn(2, 7)).backward()
    with pytest.raises(RuntimeError, match=r"stepped before zerocompile.shard\(\).*optimizer=optimizer"):
        optimizer.step()


def test_full_shape_state_loaded_after_steps_is_refused(single_rank) -> None:
    """The state check walks the state again when it changed after steps had passed it (it skips
    the walk while the groups and the state are those it looked at)."""
    unsharded = UnevenMLP()
    full = torch.optim.AdamW(unsharded.parameters())
    unsharded(torch.randn(2, 7)).sum().backward()
    full.step()
    model = zc.shard(UnevenMLP(), stage=3)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(2, 7)).sum().backward()
        optimizer.step()
    optimizer.load_state_dict(full.state_dict())  # as many entries as it held: the full shapes differ
    with pytest.raises(RuntimeError, match=r"has the full shape .*optimizer=optimizer"):
        optimizer.step()


def _train(forward, optimizer, steps: range) -> list[float]:
    return train(forward, optimizer, (local_batch("uneven_mlp", step, 0, 1) for step in steps))


def _seeded_mlp_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = UnevenMLP()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _plain_losses() -> list[float]:
    """Four steps of the unsharded model in this one process: the reference at world size 1."""
    model, optimizer = _seeded_mlp_and_optimizer()
    return _train(model, optimizer, range(4))


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_world_size_1_trains_like_the_plain_model(single_rank, stage: int) -> None:
    plain_losses = _plain_losses()
    model, optimizer = _seeded_mlp_and_optimizer()
    zc.shard(model, stage=stage)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    assert _train(compiled, optimizer, range(4)) == pytest.approx(plain_losses, abs=1e-6)


def test_optimizer_passed_in_after_stepping_keeps_training_exactly(single_rank) -> None:
    """Sharding mid-run with optimizer= slices its state: the run continues as if unsharded."""
    plain_losses = _plain_losses()
    model, optimizer = _seeded_mlp_and_optimizer()
    losses = _train(model, optimizer, range(2))
    zc.shard(model, stage=3, optimizer=optimizer)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    losses += _train(compiled, optimizer, range(2, 4))
    assert losses == pytest.approx(plain_losses, abs=1e-6)
    assert all(state["exp_avg"].shape == p.shape for p, state in optimizer.state.items())


def compile_unsharded_model(rank: int, world_size: int) -> str:
    model = UnevenMLP()
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    try:
        compiled(torch.randn(2, 7))
    except Exception as error:  # Dynamo wraps backend errors
        return str(error)
    return "no error"


def test_unsharded_model_in_multi_rank_job_is_refused_on_every_rank() -> None:
    messages = run_on_ranks(2, compile_unsharded_model, timeout=120)
    for message in messages:
        assert "unsharded parameter" in message and "zerocompile.shard(model" in message, message


def torchrun_env(port: int, rank: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def slurm_env(port: int, rank: int) -> dict[str, str]:
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_STEP_ID": "0",  # srun's mark: without it SLURM_* means an sbatch/salloc shell
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": str(rank),
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def init_and_report(rank: int, world_size: int) -> tuple[tuple[int, int], str]:
    started = zc.init_distributed()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return started, f"{dist.get_backend()} {total.item()}"


@pytest.mark.parametrize("launcher", [torchrun_env, slurm_env], ids=["torchrun", "slurm"])
def test_init_distributed_reads_launcher_environment(launcher) -> None:
    env = functools.partial(launcher, free_loopback_port())
    results = run_on_ranks(2, init_and_report, launcher_env=env, timeout=120)
    assert results == [((0, 2), "gloo 3.0"), ((1, 2), "gloo 3.0")]


def test_backend_resolves_by_name_through_the_entry_point() -> None:
    assert "zero" in torch._dynamo.list_backends()


def test_shard_keeps_names_and_gives_dtensor_parameters_of_the_full_shapes(single_rank) -> None:
    """What users see is a DTensor of each parameter's full shape; the object held before shard()
    is its flat shard (what the graphs read), and a tied pair stays one parameter."""
    model = TiedGPT()
    before = dict(model.named_parameters())
    shapes = {name: p.shape for name, p in before.items()}
    zc.shard(model, stage=3)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(isinstance(after[name], DTensor) and after[name].shape == shapes[name] for name in before)
    assert all(zc.sharded_parameters.user_parameter(before[name]) is after[name] for name in before)
    assert all(before[name].dim() == 1 for name in before)  # the flat shards
    assert model.gpt.lm_head.weight.shape == model.gpt.wte.weight.shape == (256, 32)
    assert model.gpt.wte._parameters["weight"] is model.gpt.lm_head._parameters["weight"]
    tied = zc.sharded_parameters.shard_info(model.gpt.wte._parameters["weight"])
    assert tied.names == ("gpt.wte.weight", "gpt.lm_head.weight")


def test_zero_grad_frees_the_gradients_behind_the_dtensor_parameters(single_rank) -> None:
    """Each parameter's `.grad` is a DTensor view of a padded flat gradient; nothing else keeps
    that gradient, so `zero_grad()` frees it as it frees a plain model's (held past it, stage 3
    would carry Φ/N gradient bytes through the next forward)."""
    model = zc.shard(UnevenMLP(), stage=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    compiled(local_batch("uneven_mlp", 0, 0, 1)).sum().backward()
    optimizer.step()
    flat = [weakref.ref(zc.dtensor_parameters.flat_grad(p)) for p in model.parameters()]
    assert all(isinstance(p.grad, DTensor) for p in model.parameters()) and all(ref() is not None for ref in flat)
    optimizer.zero_grad(set_to_none=True)
    assert [ref() for ref in flat] == [None] * len(flat)


def test_module_to_keeps_the_dtensor_parameters_on_their_shards(single_rank) -> None:
    """`model.to(...)` (Trainer and accelerate call it on a sharded model) keeps each parameter the
    same DTensor object, now over its shard's converted data: nn.Module._apply would otherwise
    swap a DTensor's contents for a new Parameter's, cutting it from its shard."""
    model = zc.shard(UnevenMLP(), stage=3)
    before = list(model.parameters())
    model.to("cpu")
    model.to(torch.float64)
    after = list(model.parameters())
    assert all(p is q for p, q in zip(before, after, strict=True))
    for param in after:
        shard = zc.sharded_parameters.shard_of_parameter(param)
        assert shard is not param and param.dtype == shard.dtype == torch.float64
        assert param.to_local().untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    compiled(local_batch("uneven_mlp", 0, 0, 1).double()).sum().backward()
    assert all(isinstance(p.grad, DTensor) and p.grad.dtype == torch.float64 for p in after)


def test_frozen_parameters_get_no_reduction(single_rank) -> None:
    model = zc.shard(FrozenAndBuffer(), stage=2)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    with zc.record_graphs() as graphs:
        compiled(torch.randn(2, 6)).backward()
    (backward,) = [g for g in graphs if g.kind == "backward"]
    reduced = sorted((p, n) for e in backward.ledger.entries for p, n in zip(e.params, e.param_bytes))
    # The bytes of this rank's shards: head (5, 10) and its bias, ceil(5 / N) rows each.
    assert reduced == [("head.bias", 5 * 4), ("head.weight", 50 * 4)], "only the trainable head is reduced"
    assert model.frozen._parameters["weight"].grad is None


def test_record_graphs_keeps_the_graphs_of_compiles_started_inside_it(single_rank, monkeypatch) -> None:
    """Nested blocks each get the records; the backward, lowered at its first call, goes to the
    blocks its forward was compiled in even once they are closed; outside any block no record is
    made at all (a long job that recompiles keeps nothing)."""
    from zerocompile import backend

    made = []
    record = backend.CompiledGraph
    monkeypatch.setattr(backend, "CompiledGraph", lambda *args: made.append(record(*args)) or made[-1])
    model = zc.shard(UnevenMLP(), stage=3)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    compiled(local_batch("uneven_mlp", 0, 0, 1)).backward()
    assert made == []
    torch._dynamo.reset()
    with zc.record_graphs() as outer:
        with zc.record_graphs() as inner:
            loss = compiled(local_batch("uneven_mlp", 0, 0, 1))
        assert [g.kind for g in inner] == [g.kind for g in outer] == ["forward"]
    loss.backward()
    assert [g.kind for g in outer] == ["forward", "backward"]
    assert inner == outer == made


def test_record_graphs_records_graphs_that_inductors_caches_already_hold(single_rank, tmp_path) -> None:
    """The second compile of the same model finds its graphs in AOTAutograd's and Inductor's caches
    (as every job does after the first on a machine), which skip our passes: with a record block
    open the backend compiles afresh, so the block still gets both graphs with their ledgers.
    Without that the block stayed empty."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    model = zc.shard(UnevenMLP(), stage=3)
    batch = local_batch("uneven_mlp", 0, 0, 1)
    with temporary_cache_dir(str(tmp_path)):
        torch.compile(model, backend="zero")(batch).backward()  # no block open: fills the caches
        torch._dynamo.reset()
        with zc.record_graphs() as graphs:
            torch.compile(model, backend="zero")(batch).backward()
    assert [(g.kind, len(g.ledger.entries) > 0) for g in graphs] == [("forward", True), ("backward", True)]


def subgroups_and_uncompiled_match_ddp(rank: int, world_size: int) -> list[float]:
    """Ranks {0,1} and {2,3} each shard over their own pair; rank 0's parameters differ at first."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    errors = []
    for stage, compiled in [(3, True), (2, True), (3, False), (1, False)]:
        torch._dynamo.reset()
        torch.manual_seed(rank)  # shard() must broadcast the pair's first rank's values
        model = zc.shard(UnevenMLP(), stage=stage, group=pair)
        torch.manual_seed(rank // 2 * 2)
        reference = nn.parallel.DistributedDataParallel(UnevenMLP(), process_group=pair)
        forward = torch.compile(model, backend="zero", options={"compiler": "eager"}) if compiled else model
        optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
        for step in range(3):
            x = local_batch("uneven_mlp", step, rank, world_size)
            for run, optimizer in zip((forward, reference), optimizers):
                train(run, optimizer, [x])
        full = {fqn: p.detach().full_tensor() for fqn, p in model.named_parameters()}
        errors.append(max((full[k] - v).abs().max().item() for k, v in reference.module.named_parameters()))
    return errors


def test_any_process_group_and_uncompiled_code_train_like_ddp() -> None:
    for errors in run_on_ranks(4, subgroups_and_uncompiled_match_ddp, timeout=300):
        assert max(errors) <= 1e-6, errors


def test_each_of_our_compile_steps_is_timed_like_dynamos_own(single_rank) -> None:
    """Our passes show beside torch's phases (compile_times(), tlparse's timeline via TORCH_TRACE)."""
    from torch._dynamo.utils import compile_times

    torch._dynamo.utils.compilation_time_metrics.clear()
    model = zc.shard(UnevenMLP(), stage=3)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    with zc.record_graphs():  # (the facts are recorded only for an open recorder)
        compiled(local_batch("uneven_mlp", 0, 0, 1)).backward()
    timed = compile_times(repr="csv")[0]
    for key in (
        "zerocompile.dynamo_graph_passes",
        "zerocompile.check_ranks_agree",
        "zerocompile.tag_gathers_for_recompute",
        "zerocompile.min_cut_rematerialization_partition",
        "zerocompile.lower_markers",
        "zerocompile.record_graph",
    ):
        assert key in timed, timed
