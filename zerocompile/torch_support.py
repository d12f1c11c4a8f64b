"""The torch releases zerocompile supports (2.11 to 2.15), and every difference between them.

No other module reads torch's version or asks which release it runs on: code that depends on a
release asks a named probe here, and a probe tests for the feature itself (an attribute, a config
key) rather than compare version numbers, so a backport or a nightly answers correctly too.

Differences measured across the window (2.11.0, 2.13.0, 2.15.0 on CPU; 2.11.0 on an H200):
- Inductor's config keys: `reorder_for_peak_memory` and both custom-pass hooks exist throughout,
  but Inductor adds and drops keys between releases and `config.patch` refuses an unknown one, so
  every patch we apply goes through `inductor_config_patches`.
- The C++ loop split that drops iterations (zerocompile/upstream_fixes.py) is in every release of
  the window: tests/test_upstream_fixes.py checks, on the release it runs on, that torch still
  needs the workaround.
- The traced graphs differ in names only, except that 2.15 reshapes a Linear's output with
  `aten._unsafe_view` where earlier releases use `view` (tests/test_snapshots.py shows both as
  `view`); nothing in our passes depends on either.
- 2.13's `SchedulerNode.snapshot_loop_state` does not exist in 2.11: the loop-split workaround
  uses only what every release has (the loop bodies' sizes and indexing).
- `zerocompile.optim` calls Muon's private `_zeropower_via_newtonschulz` and `_adjust_lr`
  (torch/optim/_muon.py), present with the same signatures throughout; 2.15 copies the input to
  bfloat16 where earlier releases convert it (the same values), and adds `adjust_lr_fn=
  "spectral_unclamped"`, which passes through. tests/test_muon.py holds Muon equal to torch's.
"""

from __future__ import annotations

from typing import Any

import torch

RELEASE: str = torch.__version__  # what guards, cache keys and reports record; never compared
SUPPORTED = "torch 2.11 to 2.15"

# Without these two hooks our passes cannot reach Inductor at all.
_REQUIRED_INDUCTOR_KEYS = frozenset({"joint_custom_pre_pass", "post_grad_custom_pre_pass"})


def inductor_config_patches(patches: dict[str, Any]) -> dict[str, Any]:
    """`patches` less the keys the running Inductor does not have (an optional tuning that a
    release dropped or has not added); raises, naming the supported window, if one of the hooks
    our passes need is missing."""
    from torch._inductor import config

    missing = sorted(key for key in patches if not hasattr(config, key))
    required = sorted(_REQUIRED_INDUCTOR_KEYS.intersection(missing))
    if required:
        raise RuntimeError(
            f"torch {RELEASE}'s Inductor has no {', '.join(required)}, which zerocompile's passes "
            f"need: install a release of the supported window ({SUPPORTED})"
        )
    return {key: value for key, value in patches.items() if key not in missing}
