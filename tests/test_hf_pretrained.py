"""A pretrained Hugging Face model, the way a ZeRO-3 user starts a fine-tune: built on meta,
sharded with HF's own `_init_weights`, then filled from `save_pretrained`'s files by
`load_weights`, each rank reading only its shards' bytes. Nothing is downloaded: the "pretrained"
directory is written by `save_pretrained` from a randomly initialised tiny model.

Against the unsharded `from_pretrained(dir)` model: eval logits (fp32; the sharded forward gathers
the very same values, so only the order of floating-point sums could differ: 1e-6), greedy
`generate()` token for token, training against DDP (tolerance of the core HF parity tests), and
`save_weights` -> `from_pretrained` exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from ranks import run_cases
from test_hf_models import EAGER_TOLERANCE, VOCAB, build_model, report_offline, train_steps

LOGIT_TOLERANCE = 1e-6
MODELS = ("gpt2", "llama")


def _pretrained_dir(name: str, root: str) -> str:
    """Rank 0 writes the "pretrained" model; the others wait for it."""
    path = f"{root}/{name}-pretrained"
    if dist.get_rank() == 0:
        torch.manual_seed(123)
        build_model(name).save_pretrained(path)
    dist.barrier()
    return path


def _from_pretrained(name: str, path: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    model.loss_type = "ForCausalLM"  # as build_model sets it: the class name picks no loss
    return model


def _meta_sharded(name: str, path: str) -> nn.Module:
    """meta from_config -> shard(stage 3, init=model._init_weights) -> load_weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    model.loss_type = "ForCausalLM"
    torch.manual_seed(0)
    zc.shard(model, stage=3, init=model._init_weights)
    zc.load_weights(model, path)
    return model


def _logits_and_generate(name: str, path: str) -> dict:
    reference = _from_pretrained(name, path).eval()
    model = _meta_sharded(name, path).eval()
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logit_error = (model(prompt).logits - reference(prompt).logits).abs().max().item()
        settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=VOCAB - 1)
        generated = model.generate(prompt, **settings)
        expected = reference.generate(prompt, **settings)
    return {"logit_error": logit_error, "same_tokens": torch.equal(generated, expected)}


def _trains_like_ddp(name: str, path: str, rank: int, world_size: int) -> dict:
    reference = _from_pretrained(name, path)
    ref_losses = train_steps(reference, nn.parallel.DistributedDataParallel(reference), rank, world_size)
    model = _meta_sharded(name, path)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    losses = train_steps(model, compiled, rank, world_size)
    state = zc.full_state_dict(model)
    ref_state = reference.state_dict()
    return {
        "loss_error": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "param_error": max(((state[k] - ref_state[k]).abs().max().item() for k in state), default=None),
    }


def _round_trip(name: str, path: str, root: str) -> dict:
    """save_weights beside the config -> from_pretrained: the same tensors, bit for bit."""
    model = _meta_sharded(name, path)
    out = f"{root}/{name}-saved"
    if dist.get_rank() == 0:
        model.config.save_pretrained(out)
    zc.save_weights(model, out)
    if dist.get_rank() != 0:
        return {"differing": []}
    original, saved = _from_pretrained(name, path).state_dict(), _from_pretrained(name, out).state_dict()
    return {"differing": sorted(k for k in original if not torch.equal(original[k], saved[k])) + sorted(set(original) ^ set(saved)), "files": sorted(__import__("os").listdir(out))}


def _report(rank: int, world_size: int, root: str) -> dict:
    paths = {name: _pretrained_dir(name, root) for name in MODELS}
    cases = []
    for name in MODELS:
        cases.append(((name, "logits"), lambda n=name: _logits_and_generate(n, paths[n])))
        cases.append(((name, "train"), lambda n=name: _trains_like_ddp(n, paths[n], rank, world_size)))
        cases.append(((name, "round_trip"), lambda n=name: _round_trip(n, paths[n], root)))
    return run_cases(cases)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> list[dict]:
    return report_offline(_report, str(tmp_path_factory.mktemp("hf-pretrained")))


def _facts(report: list[dict], key: tuple, rank: int = 0) -> dict:
    outcome = report[rank][key]
    assert not isinstance(outcome, str), outcome
    return outcome


@pytest.mark.parametrize("name", MODELS)
def test_loaded_logits_and_greedy_generation_equal_from_pretrained(report, name):
    for rank in range(2):
        facts = _facts(report, (name, "logits"), rank)
        assert facts["logit_error"] <= LOGIT_TOLERANCE, facts
        assert facts["same_tokens"], facts


@pytest.mark.parametrize("name", MODELS)
def test_loaded_model_trains_like_ddp_from_pretrained(report, name):
    facts = _facts(report, (name, "train"))
    assert facts["loss_error"] <= EAGER_TOLERANCE, facts
    assert facts["param_error"] <= EAGER_TOLERANCE, facts


@pytest.mark.parametrize("name", MODELS)
def test_save_weights_round_trips_through_from_pretrained(report, name):
    assert _facts(report, (name, "round_trip"))["differing"] == [], _facts(report, (name, "round_trip"))
