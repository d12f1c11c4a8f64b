"""zerocompile: ZeRO data parallelism inside torch.compile.

    zc.init_distributed()
    zc.shard(model, stage=3)
    cmodel = torch.compile(model, backend="zero")
"""

from zerocompile.accumulation import no_sync
from zerocompile.clipping import clip_grad_norm_
from zerocompile.config import ZeroConfig
from zerocompile.distributed import init_distributed
from zerocompile.sharding import full_numel, model_state_bytes, shard

__all__ = [
    "ZeroConfig",
    "clip_grad_norm_",
    "full_numel",
    "init_distributed",
    "model_state_bytes",
    "no_sync",
    "shard",
]
__version__ = "0.1.0"
