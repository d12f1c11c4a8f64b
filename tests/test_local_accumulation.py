"""Gradient accumulation without a reduction per micro-step, as users ask for it:
`ZeroTrainer(sync_each_micro_step=False)` and `zerocompile train --no-sync`, on 2 gloo ranks.

Each ZeroTrainer run trains test_hf_trainer's tiny Llama for STEPS optimizer steps of 2 sequences
per rank and micro-step; one run reduces every micro-step (the default), the other accumulates
locally, on the same data. Their losses and gradient norms (Trainer's log, over both ranks) are
compared step by step, and each rank's bytes written (/proc/self/io's wchar) are measured around
every micro-step of the last step, when nothing compiles any more (the guard's store writes count
as bytes too).

Tolerance: the two modes add the same numbers in another order. Reducing every micro-step averages
each micro-step over the ranks, then sums the micro-steps in the shard's `.grad`; accumulating
locally sums the micro-steps on each rank, then averages over the ranks once. fp32 addition is not
associative, so gradients differ in the last bits (fp32's epsilon: 1.2e-7) and the difference
compounds through AdamW's steps: measured 1.6e-7 relative on the gradient norms at 4 micro-steps,
none at 2, and none in the losses.
LOSS_TOLERANCE (1e-5, test_hf_trainer's) and NORM_TOLERANCE (1e-5 relative) allow for that and
miss no real error: with the gradients accumulated in `no_sync` lost, the gradient norms are
29 % (2 micro-steps) and 50 % (4) low and the losses off by 1.9e-3 and 2.9e-3 from the second step.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import zerocompile as zc
from ranks import run_on_ranks
from test_hf_trainer import LOSS_TOLERANCE, _tiny_llama
from training import written_bytes

STEPS = 3
PER_DEVICE = 2
SEQ_LEN = 16
NORM_TOLERANCE = 1e-5
# (stage, micro-steps per optimizer step): each stage and each count once (suite time).
CASES = [(2, 2), (3, 4)]


def _metered(training_step: Callable[..., torch.Tensor], sent: list[int]) -> Callable[..., torch.Tensor]:
    """`trainer.training_step` measuring the bytes each call writes; the barrier first, so that it
    starts when the peer's previous micro-step has ended and its own bytes fall outside."""

    def step(*args: Any, **kwargs: Any) -> torch.Tensor:
        dist.barrier()
        before = written_bytes()
        loss = training_step(*args, **kwargs)
        sent.append(written_bytes() - before)
        return loss

    return step


def _trainer(stage: int, micro_steps: int, sync_each_micro_step: bool, out: str, shard_size: int | None = None, **options: Any):
    """ZeroTrainer on the tiny Llama; `shard_size`: hybrid sharding; `options`: ZeroTrainer's."""
    from transformers import TrainingArguments

    from zerocompile.hf import ZeroTrainer

    torch.manual_seed(0)
    model = _tiny_llama()
    tokens = torch.randint(0, model.config.vocab_size, (64, SEQ_LEN), generator=torch.Generator().manual_seed(5))
    dataset = [{"input_ids": row, "labels": row} for row in tokens]
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=micro_steps,
        max_steps=STEPS, logging_steps=1, learning_rate=1e-2, seed=0, report_to=[], use_cpu=True,
        disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    # Buffers (the rotary frequencies) broadcast in a window's first forward only: kept out, so the
    # bytes measured are the parameters' gathers and the gradients' reductions alone.
    config = zc.ZeroConfig(stage=stage, broadcast_buffers=False, shard_size=shard_size)
    return ZeroTrainer(model=model, args=args, train_dataset=dataset, zero_config=config,
                       compile_options={"compiler": "eager"}, sync_each_micro_step=sync_each_micro_step, **options)  # fmt: skip


def _train(rank: int, world_size: int, stage: int, micro_steps: int, sync_each_micro_step: bool, out: str) -> dict:
    trainer = _trainer(stage, micro_steps, sync_each_micro_step, out)
    sent: list[int] = []
    trainer.training_step = _metered(trainer.training_step, sent)
    trainer.train()
    dist.barrier()
    before = written_bytes()
    with zc.no_sync(trainer.model):  # what entering the block alone sends: its gather
        pass
    entering = written_bytes() - before
    logged = trainer.state.log_history
    return {
        "losses": [entry["loss"] for entry in logged if "loss" in entry],
        "grad_norms": [entry["grad_norm"] for entry in logged if "grad_norm" in entry],
        "sent": sent[-micro_steps:],  # the last optimizer step's micro-steps
        "entering": entering,
    }


def _stopped_between_micro_steps(rank: int, world_size: int, out: str) -> bool:
    """Whether the model still holds `no_sync` copies after `train()` stopped between the micro-steps
    of a window (a callback's `should_training_stop`)."""
    from transformers import TrainerCallback

    from zerocompile.sharded_modules import module_state

    class StopAfterFirstMicroStep(TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):
            control.should_training_stop = True

    trainer = _trainer(3, 2, False, out)
    trainer.add_callback(StopAfterFirstMicroStep())
    trainer.train()
    return any(state.sync.holds_copies() for m in trainer.model.modules() if (state := module_state(m)) is not None)


def _report(rank: int, world_size: int, out: str) -> dict:
    report = {
        (stage, micro_steps, sync): _train(rank, world_size, stage, micro_steps, sync, out)
        for stage, micro_steps in CASES
        for sync in (True, False)
    }
    report["stopped holds copies"] = _stopped_between_micro_steps(rank, world_size, out)
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return run_on_ranks(2, _report, str(tmp_path_factory.mktemp("trainer")), timeout=900)[0]


def _ids(case: tuple[int, int]) -> str:
    return f"stage{case[0]}-accum{case[1]}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_local_accumulation_trains_like_reducing_every_micro_step(report, case) -> None:
    every, local = report[(*case, True)], report[(*case, False)]
    assert len(local["losses"]) == len(every["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(local["losses"], every["losses"])) <= LOSS_TOLERANCE
    assert local["grad_norms"] == pytest.approx(every["grad_norms"], rel=NORM_TOLERANCE)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_local_accumulation_reduces_once_per_optimizer_step(report, case) -> None:
    """Reducing every micro-step, each sends a step's gathers and reductions; accumulating locally,
    the first micro-step sends only the gather of entering `no_sync`, the ones after it nothing,
    and the last only the one reduction of every gradient (`zc.reduce_gradients`): a gather and a
    reduction in all, what one stage-2 micro-step sends, where stage 3's gathers twice."""
    every, local = report[(*case, True)]["sent"], report[(*case, False)]["sent"]
    entering = report[(*case, False)]["entering"]
    assert min(every) > 0 and max(every) == min(every), every
    assert local[1:-1] == [0] * (case[1] - 2) and local[0] == entering > 0, (local, entering)
    if case[0] == 2:  # exact: the same collectives write the same gloo messages (measured equal)
        assert entering + local[-1] == every[-1], (local, every)
    else:
        assert 0 < entering + local[-1] < every[-1], (local, every)


def test_a_stop_between_micro_steps_drops_the_no_sync_copies(report) -> None:
    """`train()` stopped inside a window leaves no copies of the parameters, which a later `load`
    into the shards would leave stale."""
    assert report["stopped holds copies"] is False


# --- zerocompile train --no-sync ------------------------------------------------------------------


def _train_command_micro_steps(rank: int, world_size: int, no_sync: bool) -> list[int]:
    """Bytes written by each of the 4 micro-steps of `zerocompile train`'s second step (the first
    compiles), stage 3: from one forward call to the next, the last to the return."""
    from zerocompile.tools.gpt import GPT, SIZES
    from zerocompile.tools.train import _accumulate

    torch.manual_seed(0)
    model = GPT(SIZES["tiny"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    zc.shard(model, stage=3, optimizer=optimizer)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    marks: list[tuple[int, int]] = []  # (bytes at a forward call, bytes after the barrier that follows)

    def forward(*batch: torch.Tensor) -> torch.Tensor:
        now = written_bytes()
        dist.barrier()
        marks.append((now, written_bytes()))
        return compiled(*batch)

    args = argparse.Namespace(grad_accum=4, no_sync=no_sync)
    for step in range(2):
        marks.clear()
        tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(step * world_size + rank))
        _accumulate(forward, model, tokens[:, :-1], tokens[:, 1:], args)
        end = written_bytes()
        optimizer.step()
        optimizer.zero_grad()
    starts = [after for _, after in marks]
    return [later - start for start, later in zip(starts, [now for now, _ in marks[1:]] + [end])]


def test_train_no_sync_sends_nothing_before_the_last_micro_step() -> None:
    """`--no-sync`: one `no_sync` block over the micro-steps (entered before the first forward),
    so nothing is sent until the reduction after the last; without it every micro-step gathers
    twice (stage 3) and reduces, so the one reduction sends less than any of them."""
    every, local = (run_on_ranks(2, _train_command_micro_steps, no_sync)[0] for no_sync in (False, True))
    assert min(every) > 0 and max(every) == min(every), every
    assert local[:-1] == [0, 0, 0] and 0 < local[-1] < every[-1], (local, every)
