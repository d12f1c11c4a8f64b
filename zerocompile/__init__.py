"""zerocompile: ZeRO data parallelism inside torch.compile.

    zc.init_distributed()
    zc.shard(model, stage=3)
    cmodel = torch.compile(model, backend="zero")
"""

from zerocompile.config import ZeroConfig
from zerocompile.distributed import init_distributed
from zerocompile.gathered import gathered
from zerocompile.sharding import full_numel, model_state_bytes, shard

__all__ = ["ZeroConfig", "full_numel", "gathered", "init_distributed", "model_state_bytes", "shard"]
__version__ = "0.1.0"
