"""A LoRA adapter on a base no rank holds whole: `zc.from_pretrained(path, stage, lora=LoraConfig)`,
and checkpoints of the adapter alone (`zc.save(..., trainable_only=True)`).

Against PEFT on the whole base (transformers' `from_pretrained`, then `get_peft_model`) with the same
seed: the adapter bit for bit whatever each rank's own seed (it follows group rank 0's generator, as
`shard()`'s meta build does), the base's bytes from the files, the generator left where PEFT leaves
it. The training itself against Trainer+DDP is tests/test_hf_trainer.py's (`--lora`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerocompile as zc
from zerocompile.checkpoint_files import METADATA
from ranks import run_on_ranks
from test_hf_models import report_offline

TARGETS = ["q_proj", "v_proj"]
STEPS = 3
# Three AdamW steps of the adapter on 2 ranks against 1 (or stage 3 against 2): the same values
# summed in another order (the gradient reduction), nothing else.
RESUME_TOLERANCE = 1e-5


def _lora(**settings):
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0, **settings)


def _write_base(root: str) -> str:
    """A tiny Llama (untied head, rotary buffers) written by `save_pretrained` in two files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = f"{root}/base"
    if dist.get_rank() == 0 and not Path(path).exists():
        config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
        torch.manual_seed(11)
        model = LlamaForCausalLM(config)
        model.save_pretrained(path, max_shard_size=sum(p.numel() * 4 for p in model.parameters()) // 2)
    dist.barrier()
    return path


def _whole(path: str, seed: int):
    """PEFT on the whole base, as users attach it without zerocompile."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), _lora())
    return model, torch.get_rng_state()


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, torch.distributed.tensor.DTensor) else param).detach()


def _built_on_meta(rank: int, world_size: int, root: str) -> dict:
    """Each rank seeded differently: rank 0 with the reference's seed."""
    path = _write_base(root)
    torch.manual_seed(0 if rank == 0 else 1000 + rank)
    own_state = torch.get_rng_state()
    model = zc.from_pretrained(path, stage=3, lora=_lora())
    state_after = torch.get_rng_state()
    reference, reference_state_after = _whole(path, 0)
    expected = dict(reference.named_parameters())
    params = dict(model.named_parameters())
    differing = [name for name, param in params.items() if not torch.equal(_full(param), expected[name].detach())]
    trainable = sorted(name for name, param in params.items() if param.requires_grad)
    # The frozen base gets no gradient, and an optimizer over the trainable parameters no state of it.
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(rank))
    torch.compile(model, backend="zero", options={"compiler": "eager"})(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    with_grad = sorted(name for name, param in model.named_parameters() if param.grad is not None)
    return {
        "names_alike": sorted(params) == sorted(expected),
        "differing": differing,
        "trainable": trainable,
        "expected_trainable": sorted(name for name, param in expected.items() if param.requires_grad),
        "with_grad": with_grad,
        "state_entries": len(optimizer.state),
        "generator_as_peft_leaves_it": torch.equal(state_after, reference_state_after),
        "generator_own_state_back": torch.equal(state_after, own_state),
        "base_shard_numel": max(p.to_local().numel() for n, p in params.items() if not p.requires_grad),
        "base_largest_numel": max(p.numel() for n, p in params.items() if not p.requires_grad),
        "type": type(model).__name__,
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> list[dict]:
    return report_offline(_built_on_meta, str(tmp_path_factory.mktemp("lora-meta")))


def test_adapter_equals_peft_on_the_whole_base_whatever_each_rank_seeded(built):
    for rank, facts in enumerate(built):
        assert facts["type"] == "PeftModel", facts
        assert facts["names_alike"], facts
        assert facts["differing"] == [], facts  # adapter and base, bit for bit, on every rank
        assert facts["trainable"] == facts["expected_trainable"] and len(facts["trainable"]) == 8, facts
    # Rank 0 drew PEFT's numbers from its own generator and ends where PEFT leaves it; rank 1,
    # seeded otherwise, drew them from rank 0's state and has its own back.
    assert built[0]["generator_as_peft_leaves_it"], built[0]
    assert built[1]["generator_own_state_back"] and not built[1]["generator_as_peft_leaves_it"], built[1]


def test_frozen_base_is_sharded_and_holds_no_gradient_or_state(built):
    for facts in built:
        assert facts["with_grad"] == facts["trainable"], facts
        assert facts["state_entries"] == len(facts["trainable"]), facts
        assert facts["base_shard_numel"] <= facts["base_largest_numel"] // 2, facts


# ---------------------------------------------------------------------------------------------
# Checkpoints of the adapter alone


def _train(model, optimizer, steps: range, rank: int, world_size: int) -> list[float]:
    """AdamW steps on this rank's slice of a global batch of 4 sequences; the global losses."""
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    losses = []
    for step in steps:
        tokens = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(100 + step)).chunk(world_size)[rank]
        loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses


def _adapter_model(path: str, stage: int):
    torch.manual_seed(0)
    model = zc.from_pretrained(path, stage=stage, lora=_lora())
    model.train()
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _save_then_continue(rank: int, world_size: int, root: str) -> dict:
    path = _write_base(root)
    model, optimizer = _adapter_model(path, stage=3)
    _train(model, optimizer, range(STEPS), rank, world_size)
    zc.save(f"{root}/adapter", model, optimizer, trainable_only=True)
    later = _train(model, optimizer, range(STEPS, 2 * STEPS), rank, world_size)
    adapter = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"later": later, "adapter_bytes": adapter}


def _resume(rank: int, world_size: int, root: str, stage: int) -> dict:
    model, optimizer = _adapter_model(_write_base(root), stage=stage)
    zc.load(f"{root}/adapter", model, optimizer)
    return {"later": _train(model, optimizer, range(STEPS, 2 * STEPS), rank, world_size)}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("lora-checkpoint"))
    saved = report_offline(_save_then_continue, root)[0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        one_rank = run_on_ranks(1, _resume, root, 2, timeout=600)[0]
    return {"root": root, "saved": saved, "one_rank_stage2": one_rank}


def test_adapter_checkpoint_holds_the_adapter_and_its_state_alone(resumed):
    directory = Path(resumed["root"], "adapter")
    metadata = json.loads((directory / METADATA).read_text())
    assert metadata["trainable_only"] is True
    assert all(".lora_" in entry["names"][0] for entry in metadata["params"]) and len(metadata["params"]) == 8, metadata["params"]
    assert metadata["buffers"] == []
    assert metadata["base"]["path"] == str(Path(resumed["root"], "base").absolute()) and len(metadata["base"]["digest"]) == 64
    # The adapter, its two AdamW moments and step counters, and the metadata (a few hundred bytes
    # per tensor: 6 % of this small adapter's checkpoint); nothing of the base (21x the adapter).
    held = sum(file.stat().st_size for file in directory.rglob("*") if file.is_file())
    assert held <= 1.1 * 3 * resumed["saved"]["adapter_bytes"], (held, resumed["saved"]["adapter_bytes"])


def test_adapter_checkpoint_resumes_at_another_world_size_and_stage(resumed):
    expected = resumed["saved"]["later"]
    got = resumed["one_rank_stage2"]["later"]
    assert max(abs(a - b) for a, b in zip(got, expected)) <= RESUME_TOLERANCE, (got, expected)


def test_adapter_checkpoint_refuses_another_base(resumed, single_rank, tmp_path):
    from transformers import AutoModelForCausalLM

    other = tmp_path / "other-base"
    AutoModelForCausalLM.from_pretrained(Path(resumed["root"], "base")).save_pretrained(other)  # one file: another layout
    model, optimizer = _adapter_model(str(other), stage=3)
    before = [_full(p).clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"trained on the base at .*base.*other weights.*from_pretrained\("):
        zc.load(Path(resumed["root"], "adapter"), model, optimizer)
    assert all(torch.equal(a, _full(b)) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(use_dora=True), r"use_dora=.*DoRA reads the base weights"),
        (dict(init_lora_weights="pissa"), r"init_lora_weights in .*'pissa' reads the base weights"),
        (dict(modules_to_save=["lm_head"]), r"modules_to_save=.*trainable copies"),
    ],
)
def test_adapters_that_need_the_whole_base_are_refused(single_rank, tmp_path, settings, match):
    from peft import LoraConfig

    path = _write_base(str(tmp_path))
    with pytest.raises(ValueError, match=match):
        zc.from_pretrained(path, stage=3, lora=LoraConfig(r=4, target_modules=TARGETS, **settings))


def test_adapter_of_an_embedding_is_refused(single_rank, tmp_path):
    from peft import LoraConfig

    path = _write_base(str(tmp_path))
    with pytest.raises(ValueError, match=r"LoRA target 'base_model.model.model.embed_tokens' is a Embedding.*nn.Linear layers only"):
        zc.from_pretrained(path, stage=3, lora=LoraConfig(r=4, target_modules=["embed_tokens"]))
