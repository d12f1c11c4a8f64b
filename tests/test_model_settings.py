"""Settings travel with the model: models sharded on one group compile and run side by side, each
with its own stage, bucket size, prefetch and precision, each equal to its own twin.

Before, the compile-time settings lived in one registry per process group: the second `shard()`
replaced the first model's bucket size in every graph compiled afterwards. So the tests also read
every compiled graph's ledger: each collective serves one model only and follows that model's
settings (dtype, bucket size, stage).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from models import ComputesIn, Linears, ReusedWeight, UnevenMLP, local_batch
from ranks import run_on_ranks
from training import train

STEPS = 4
# Plain SGD at a large rate: a gradient scaled wrongly (summed, or averaged twice) moves the
# parameters visibly. The tolerance is float32 rounding of a few steps of these small models.
LR = 0.5
TOLERANCE = 1e-5
# The bf16 critic is compared with a DDP twin doing the same arithmetic (ComputesIn and
# _bf16_average_at_once): the same bf16 casts of the same fp32 master weights and inputs and the
# same bf16 kernels, so every rank's gradients are the same bf16 values on both sides; the ranks'
# bf16 gradients are summed in one reduction (torch's sum over the rank dimension, rounded to bf16
# once), divided by N (a power of two: exact) and cast to fp32 (exact); then the same fp32 SGD
# step. No value is rounded differently, so the critic equals its twin to the bit (measured 0.0 at
# N = 2 and 4), and the fp32 tolerance (room for fp32 kernel-order differences only) applies.
# One bf16 rounding the other way is far above it: a bf16 ulp of an averaged gradient in
# [0.5, 1) (|g| <= 1 here) is 2^-8, so the SGD update moves by LR * 2^-8 = 2e-3 (what gloo's ring
# all-reduce, rounding each partial sum, did at N = 4). Training the critic in fp32 against this
# twin ends 1.8e-3 (N = 2) and 8.6e-4 (N = 4) away.
BF16_TOLERANCE = TOLERANCE
ACTOR = {"stage": 3, "bucket_bytes": 0, "prefetch": 0}  # one all-gather per parameter, fp32
# bf16 on the wire and in compute, fp32 master shards; gradients reduced in bf16 (what the
# computation produces: the bench's -bf16 modes, reduce_dtype=None, do the same). Its four
# parameters share one gather and one reduction.
CRITIC = {"stage": 2, "bucket_bytes": 4 * 2**20, "prefetch": 1, "param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16}
TEACHER = {"stage": 3, "bucket_bytes": 0, "prefetch": 1}  # inference: one gather per parameter
STUDENT = {"stage": 1, "bucket_bytes": 4 * 2**20, "prefetch": 1}  # one gather, one reduction


def _build(seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    return UnevenMLP(), ReusedWeight()


def _bf16_average_at_once(state, bucket):  # unannotated: DDP checks annotations, which are strings here
    """DDP's bucket averaged in bf16 as the critic's reduce-scatter does: every rank's bf16 gradients
    summed at once, then divided by N. (gloo's ring all-reduce, test_sgd_parity's hook, rounds each
    partial sum to bf16 instead: with 4 ranks that moved a weight by 2e-3, more than training the
    critic in fp32 does, so the comparison could not tell bf16 from fp32.)"""
    compressed = bucket.buffer().to(torch.bfloat16)
    gathered = [torch.empty_like(compressed) for _ in range(dist.get_world_size())]
    done = dist.all_gather(gathered, compressed, async_op=True).get_future()
    return done.then(lambda _: bucket.buffer().copy_(torch.stack(gathered).sum(0) / dist.get_world_size()))


def _train(models_and_forwards: list[tuple[nn.Module, object, str]], rank: int, world_size: int) -> None:
    optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=LR) for m, _f, _n in models_and_forwards]
    for step in range(STEPS):  # the models' steps taken in turn
        for (_model, forward, name), optimizer in zip(models_and_forwards, optimizers):
            train(forward, optimizer, [local_batch(name, step, rank, world_size)])


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with zc.gathered(model):
        return {fqn: p.detach().clone() for fqn, p in model.named_parameters()}


def _error(ours: nn.Module, theirs: nn.Module) -> float:
    full = _full(ours)
    return max((full[fqn] - p).abs().max().item() for fqn, p in theirs.named_parameters())


def _entries(graphs: list) -> list[tuple[str, str, tuple[str, ...], str]]:
    """(graph kind, op, parameters served, dtype) of every collective of every compiled graph."""
    return [(g.kind, e.op, tuple(e.params), e.dtype) for g in graphs for e in g.ledger.entries]


def two_models_side_by_side(rank: int, world_size: int) -> dict:
    actor_twin, critic_twin = _build(seed=0)
    # The critic gathers each parameter once per step, so its weight used twice sums its two bf16
    # gradients before the cast back: as the twin's one cast per forward does.
    critic_ddp = nn.parallel.DistributedDataParallel(ComputesIn(critic_twin, torch.bfloat16))
    critic_ddp.register_comm_hook(None, _bf16_average_at_once)
    _train(
        [
            (actor_twin, nn.parallel.DistributedDataParallel(actor_twin), "uneven_mlp"),
            (critic_twin, critic_ddp, "reused_weight"),
        ],
        rank,
        world_size,
    )
    torch._dynamo.reset()
    actor, critic = _build(seed=0)
    zc.shard(actor, **ACTOR)
    zc.shard(critic, **CRITIC)
    options = {"compiler": "eager"}
    with zc.record_graphs() as graphs:
        _train(
            [
                (actor, torch.compile(actor, backend="zero", options=options), "uneven_mlp"),
                (critic, torch.compile(critic, backend="zero", options=options), "reused_weight"),
            ],
            rank,
            world_size,
        )
    errors = {"actor": _error(actor, actor_twin), "critic": _error(critic, critic_twin)}
    return {"errors": errors, "entries": _entries(graphs)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_two_models_on_one_group_keep_their_own_settings(world_size: int) -> None:
    """An actor at stage 3 in fp32 and a critic at stage 2 in bf16 with another bucket size."""
    report = run_on_ranks(world_size, two_models_side_by_side)[0]
    assert report["errors"]["actor"] <= TOLERANCE, report["errors"]
    assert report["errors"]["critic"] <= BF16_TOLERANCE, report["errors"]
    actor_params = {fqn for fqn, _ in UnevenMLP().named_parameters()}
    critic_params = {fqn for fqn, _ in ReusedWeight().named_parameters()}
    entries = report["entries"]
    actor_entries = [e for e in entries if set(e[2]) <= actor_params]
    critic_entries = [e for e in entries if set(e[2]) <= critic_params]
    assert len(actor_entries) + len(critic_entries) == len(entries), entries  # no collective serves both
    # Each model's collectives in its own dtype: the critic gathers and reduces in bf16, the actor
    # in fp32 (one model's precision leaking into the other's graphs shows here).
    assert {dtype for *_, dtype in actor_entries} == {"float32"}, actor_entries
    assert {dtype for *_, dtype in critic_entries} == {"bfloat16"}, critic_entries
    actor_gathers = [(kind, params) for kind, op, params, _ in actor_entries if op == "all_gather"]
    # The actor's bucket_bytes=0: every parameter gathered on its own, in the forward and again in
    # the backward (the critic's 4 MiB would put all six in one bucket), and reduced on its own.
    assert all(len(params) == 1 for _kind, params in actor_gathers), actor_gathers
    assert sorted(params for kind, params in actor_gathers if kind == "forward") == sorted((f,) for f in actor_params)
    assert {kind for kind, _ in actor_gathers} == {"forward", "backward"}, actor_gathers  # stage 3 re-gathers
    actor_reductions = [params for _kind, op, params, _ in actor_entries if op != "all_gather"]
    assert sorted(actor_reductions) == sorted((f,) for f in actor_params), actor_entries
    # The critic's stage 2 and 4 MiB: its four parameters gathered in one bucket at the start of
    # the forward, never in the backward, and their gradients reduce-scattered in one bucket
    # (bucket_bytes=0 would make four of each).
    critic_collectives = [(kind, op, frozenset(params)) for kind, op, params, _ in critic_entries]
    assert critic_collectives == [
        ("forward", "all_gather", frozenset(critic_params)),
        ("backward", "reduce_scatter", frozenset(critic_params)),
    ], critic_entries


def one_graph_with_both_models(rank: int, world_size: int) -> str:
    actor, critic = _build(seed=0)
    zc.shard(actor, **ACTOR)
    zc.shard(critic, **CRITIC)
    both = torch.compile(
        lambda x, y: actor(x) + critic(y), backend="zero", options={"compiler": "eager"}
    )
    try:
        both(local_batch("uneven_mlp", 0, rank, world_size), local_batch("reused_weight", 0, rank, world_size))
    except Exception as error:  # Dynamo wraps what the backend raised
        dist.barrier()
        return str(error)
    return "compiled"


def test_one_graph_with_two_models_of_different_settings_is_refused() -> None:
    message = run_on_ranks(2, one_graph_with_both_models)[0]
    assert "different compile-time settings" in message, message
    assert "'fc1.weight'" in message and "'square.weight'" in message and "bucket_bytes=0" in message, message


# ------------------------------------------------------------------------- teacher beside student


class _Student(Linears):
    """Smaller than the teacher (UnevenMLP: 7 -> 13 -> 11 -> 3), with parameter names of its own."""

    def __init__(self) -> None:
        super().__init__(hidden=(7, 5), out=(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def _distil(teacher, student_forward, student: nn.Module, rank: int, world_size: int) -> list[torch.Tensor]:
    """STEPS of SGD on the student towards the teacher's outputs; the teacher's outputs."""
    targets = []

    def loss(batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            targets.append(teacher(batch))
        return (student_forward(batch) - targets[-1]).square().mean()

    batches = (local_batch("uneven_mlp", step, rank, world_size) for step in range(STEPS))
    train(loss, torch.optim.SGD(student.parameters(), lr=LR), batches)
    return targets


def teacher_beside_student(rank: int, world_size: int) -> dict:
    torch.manual_seed(1)
    plain_teacher, student_twin = UnevenMLP(loss=False).eval(), _Student()
    plain_targets = _distil(plain_teacher, nn.parallel.DistributedDataParallel(student_twin), student_twin, rank, world_size)
    torch._dynamo.reset()
    torch.manual_seed(1)
    teacher, student = UnevenMLP(loss=False), _Student()
    zc.shard(teacher, **TEACHER)
    zc.shard(student, **STUDENT)
    teacher.eval()
    options = {"compiler": "eager"}
    with zc.record_graphs() as graphs:
        targets = _distil(
            torch.compile(teacher, backend="zero", options=options),
            torch.compile(student, backend="zero", options=options),
            student,
            rank,
            world_size,
        )
    return {
        "teacher_error": max((ours - plain).abs().max().item() for ours, plain in zip(targets, plain_targets)),
        "teacher_moved": _error(teacher, plain_teacher),
        "teacher_grads": [fqn for fqn, p in teacher.named_parameters() if p.grad is not None],
        "student_error": _error(student, student_twin),
        "kinds": sorted(g.kind for g in graphs),
        "entries": _entries(graphs),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_teacher_inference_beside_a_training_student(world_size: int) -> None:
    """A teacher sharded at stage 3 runs compiled no_grad inference, its outputs the targets of a
    student training at stage 1 with another bucket size on the same group."""
    report = run_on_ranks(world_size, teacher_beside_student)[0]
    # The gathered weights are the teacher's own bytes and the eager compiler runs the same fp32
    # kernels as the plain module: measured 0.0; 1e-6 allows another op order's few ulps.
    assert report["teacher_error"] <= 1e-6, report
    assert report["teacher_moved"] == 0.0 and report["teacher_grads"] == [], report
    assert report["student_error"] <= TOLERANCE, report
    # One inference graph (the teacher's, reused every step) and the student's training pair.
    assert report["kinds"] == ["backward", "forward", "inference"], report["kinds"]
    teacher_params = {fqn for fqn, _ in UnevenMLP().named_parameters()}
    student_params = {fqn for fqn, _ in _Student().named_parameters()}
    teacher_entries = [(op, params) for kind, op, params, _ in report["entries"] if kind == "inference"]
    student_entries = [(kind, op, params) for kind, op, params, _ in report["entries"] if kind != "inference"]
    # The teacher's graph gathers each of its parameters on its own (stage 3, bucket_bytes=0: the
    # student's settings would gather all six at once) and reduces nothing.
    assert sorted(teacher_entries) == sorted(("all_gather", (f,)) for f in teacher_params), teacher_entries
    # The student's follow its settings: stage 1 and 4 MiB gather its four parameters in one bucket
    # in the forward, and reduce-scatter their gradients in one in the backward.
    assert [(kind, op, frozenset(params)) for kind, op, params in student_entries] == [
        ("forward", "all_gather", frozenset(student_params)),
        ("backward", "reduce_scatter", frozenset(student_params)),
    ], student_entries
