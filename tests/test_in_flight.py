"""How many collectives run at once, and the gloo limit on it.

`prefetch` decides how many all-gathers are in flight in the lowered graph; on gloo, whose backend
corrupts its heap when two collectives run concurrently (`passes.one_in_flight`), one collective
of any kind runs at a time. These tests check that Inductor's generated code keeps both (it could
reorder collectives) and that a deeper prefetch is refused on a gloo group, at shard() and
through a compile option, before anything runs.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code
from torch.distributed.tensor import DTensor

import zerocompile as zc

GATHER = re.compile(r"^\s*(\w+) = torch\.ops\._c10d_functional\.all_gather_into_tensor(?:_coalesced)?\.")
COLLECTIVE = re.compile(r"^\s*(\w+) = torch\.ops\._c10d_functional\.(?!wait_tensor)\w+\.default\(")
OUTPUT = re.compile(r"^\s*(\w+) = (\w+)\[\d+\]")
WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)")

pytestmark = pytest.mark.core  # Inductor's scheduling of collectives changes between releases


def most_in_flight(code: str, issue_line: re.Pattern = COLLECTIVE) -> tuple[int, int]:
    """(most collectives matching `issue_line` issued and not yet waited at any line, all issued)
    in Inductor's output code. A collective is in flight from its call to the first wait on one of
    its outputs (a coalesced one's outputs are its getitems; that wait completes it all)."""
    collective_of: dict[str, str] = {}  # an output buffer -> the call producing it
    in_flight: set[str] = set()
    most = issued = 0
    for line in code.splitlines():
        if issue := issue_line.match(line):
            in_flight.add(issue[1])
            collective_of[issue[1]] = issue[1]
            issued += 1
            most = max(most, len(in_flight))
        elif (output := OUTPUT.match(line)) and output[2] in in_flight:
            collective_of[output[1]] = output[2]
        elif (wait := WAIT.search(line)) and wait[1] in collective_of:
            in_flight.discard(collective_of[wait[1]])
    return most, issued


class Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


@pytest.mark.parametrize("stage, prefetch", [(2, 1), (3, 1), (3, 2)])
def test_inductor_code_keeps_prefetch_gathers_in_flight_at_most(fake_two_ranks, stage: int, prefetch: int) -> None:
    torch.manual_seed(0)
    model = zc.shard(Layers(), stage, bucket_bytes=0, prefetch=prefetch)  # a gather per parameter
    compiled = torch.compile(model, backend="zero")

    _, codes = run_and_get_code(lambda: compiled(torch.randn(4, 16)).backward())

    assert most_in_flight(codes[0], GATHER) == (prefetch, 8), codes[0]
    # Stage 3 re-gathers the three weights the backward reads (not the biases); stage 2 nothing.
    assert most_in_flight(codes[1], GATHER) == ((prefetch, 3) if stage == 3 else (0, 0)), codes[1]
    if stage == 3:
        # Off gloo collectives overlap each other: a re-gather runs next to a reduction.
        assert most_in_flight(codes[1])[0] > prefetch, codes[1]


GLOO_REFUSAL = r"prefetch=2 asks for 2 all-gathers in flight.*gloo.*one collective at a time.*use prefetch=1 \(the default\) or 0"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shard_refuses_prefetch_over_one_on_gloo_and_leaves_the_model_alone(single_rank, stage: int) -> None:
    model = Layers()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=GLOO_REFUSAL):
        zc.shard(model, stage, prefetch=2)
    assert getattr(model, "_zero_config", None) is None
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_compile_option_of_prefetch_over_one_on_gloo_is_refused_before_running(single_rank) -> None:
    model = zc.shard(Layers(), 3)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager", "prefetch": 2})
    with pytest.raises(Exception, match=GLOO_REFUSAL):
        compiled(torch.randn(4, 16))


def test_stage_0_and_prefetch_one_run_on_gloo(single_rank) -> None:
    """Stage 0 gathers nothing, so any prefetch is harmless; prefetch=1 is the safe default. Both
    run, and on one rank their gradients are the plain model's."""
    for stage, prefetch in [(0, 2), (3, 1)]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        plain = Layers()
        model = zc.shard(copy.deepcopy(plain), stage, prefetch=prefetch)
        x = torch.randn(4, 16)
        compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
        compiled(x).backward()
        plain(x).backward()
        for (name, param), full in zip(model.named_parameters(), plain.parameters()):
            # Stage 3's gradient is a DTensor whose one rank holds it whole.
            got = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            assert torch.equal(got, full.grad), f"stage {stage}: {name}"


def test_on_gloo_inductor_code_keeps_one_collective_of_any_kind_in_flight(single_rank) -> None:
    """gloo corrupts its heap when two collectives run at once (`passes.one_in_flight`): at stage
    3 a re-gather must not be in flight next to a reduction either (stages 1-2 have no re-gathers
    and wait each reduction before the next: one in flight with or without the pass)."""
    model = zc.shard(Layers(), 3, bucket_bytes=0)  # a collective per parameter
    compiled = torch.compile(model, backend="zero")

    _, codes = run_and_get_code(lambda: compiled(torch.randn(4, 16)).backward())

    assert most_in_flight(codes[0]) == (1, 8), codes[0]
    # 8 gradients reduced and the three weights the backward reads re-gathered.
    assert most_in_flight(codes[1]) == (1, 11), codes[1]
