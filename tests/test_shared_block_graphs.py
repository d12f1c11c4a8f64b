"""Same-shaped blocks share one compiled graph: graph breaks and block-by-block compiles stay cheap.

A graph break inside a block (or compiling each block on its own, as FSDP2 users do) makes Dynamo
compile the block's `forward` as a frame of its own. Plain modules then compile it twice (for the
first block, then once more for all the others) and share that graph across the remaining blocks;
a sharded module must do the same. When the parameter FQN was a traced constant, each block
compiled its own graph and, past Dynamo's recompile limit (8), the rest ran eagerly with blocking
collectives. DEPTH is above that limit, so such a regression fails here on graph counts, measured
against plain modules' in the same run.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from ranks import run_on_ranks
from test_parity import EAGER_TOLERANCE
from training import full_parameters, train

DEPTH = 10  # > torch._dynamo.config.recompile_limit
STEPS = 2
FEATURES = 12
LAYOUTS = ("graph_break", "regional")


class Block(nn.Module):
    def __init__(self, graph_break: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(FEATURES, FEATURES)
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.fc(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        return x + 1


class Deep(nn.Module):
    def __init__(self, graph_break: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(graph_break) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    return torch.randn(8, FEATURES, generator=torch.Generator().manual_seed(step)).chunk(world_size)[rank]


def _train(model: nn.Module, forward, rank: int, world_size: int, no_sync=None) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def loss(step: int) -> torch.Tensor:
        if no_sync is not None:  # a micro-step first, its gradients accumulated into the step's
            with no_sync():
                forward(_batch(100 + step, rank, world_size)).backward()
        return forward(_batch(step, rank, world_size))

    train(loss, optimizer, range(STEPS))
    return full_parameters(model)


def _compile(model: Deep, layout: str, backend: Any, options: dict | None) -> Callable:
    if layout == "regional":
        for block in model.blocks:
            block.compile(backend=backend, options=options)
        return model
    return torch.compile(model, backend=backend, options=options)


def _plain_graph_count(layout: str, rank: int, world_size: int) -> int:
    """How many graphs Dynamo makes of the unsharded model (one step is enough: no mode changes)."""
    graphs = []

    def count(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    forward = _compile(Deep(graph_break=layout == "graph_break"), layout, count, None)
    for step in range(STEPS):
        forward(_batch(step, rank, world_size)).backward()
    return len(graphs)


def _run(rank: int, world_size: int) -> dict:
    report: dict = {layout: _plain_graph_count(layout, rank, world_size) for layout in LAYOUTS}
    for accumulate in (False, True):
        torch.manual_seed(0)
        model = Deep(graph_break=False)
        ddp = nn.parallel.DistributedDataParallel(model)
        report["ddp", accumulate] = _train(model, ddp, rank, world_size, ddp.no_sync if accumulate else None)
    for layout in LAYOUTS:
        for accumulate in (False, True):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = zc.shard(Deep(graph_break=layout == "graph_break"), stage=3)
            forward = _compile(model, layout, "zero", {"compiler": "eager"})
            no_sync = (lambda model=model: zc.no_sync(model)) if accumulate else None
            with zc.record_graphs() as graphs:
                params = _train(model, forward, rank, world_size, no_sync)
            dist.barrier()
            report[layout, accumulate] = {
                "params": params,
                "forward_graphs": sum(g.kind == "forward" for g in graphs),
                "gathered": sorted({p for g in graphs for e in g.ledger.entries for p in e.params}),
            }
    return report


@pytest.fixture(scope="module")
def report() -> dict:
    return run_on_ranks(2, _run, timeout=600)[0]


@pytest.mark.parametrize("accumulate", (False, True), ids=("synced", "no_sync"))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_blocks_share_their_graphs(report, layout: str, accumulate: bool) -> None:
    ours, plain = report[layout, accumulate], report[layout]
    # no_sync adds one graph per mode (local copies; pending gradients) of the one block frame that
    # holds parameters, shared by all blocks like the synced one.
    assert ours["forward_graphs"] == plain + (2 if accumulate else 0)
    # Graphs name the parameters of the block they were traced for: blocks 2.. reuse block 1's.
    assert ours["gathered"] == [f"blocks.{b}.fc.{name}" for b in (0, 1) for name in ("bias", "weight")]


@pytest.mark.parametrize("accumulate", (False, True), ids=("synced", "no_sync"))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shared_graphs_train_like_ddp(report, layout: str, accumulate: bool) -> None:
    ours, ddp = report[layout, accumulate]["params"], report["ddp", accumulate]
    assert ours.keys() == ddp.keys()
    assert max((ours[k] - ddp[k]).abs().max().item() for k in ddp) <= EAGER_TOLERANCE

