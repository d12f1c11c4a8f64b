"""zerocompile: ZeRO data parallelism inside torch.compile.

    zc.init_distributed()
    zc.shard(model, stage=3)
    cmodel = torch.compile(model, backend="zero")
    zc.save(path, model, optimizer, ema, step=step)   # zc.load(...) at any stage / world size
"""

from zerocompile.accumulation import no_sync, reduce_gradients
from zerocompile.checkpoint import full_state_dict, load, save
from zerocompile.clipping import clip_grad_norm_
from zerocompile.config import ZeroConfig
from zerocompile.distributed import init_distributed
from zerocompile.ema import EMA
from zerocompile.gathered import gathered
from zerocompile.graph_records import record_graphs
from zerocompile.grad_scaler import ShardedGradScaler
from zerocompile import optim
from zerocompile.pretrained import from_pretrained
from zerocompile.sharded_parameters import full_shape
from zerocompile.sharding import full_numel, model_state_bytes, shard
from zerocompile.weights import LoadResult, load_weights, save_weights

__all__ = [
    "EMA",
    "LoadResult",
    "ShardedGradScaler",
    "ZeroConfig",
    "clip_grad_norm_",
    "from_pretrained",
    "full_numel",
    "full_shape",
    "full_state_dict",
    "gathered",
    "init_distributed",
    "load",
    "load_weights",
    "model_state_bytes",
    "no_sync",
    "optim",
    "record_graphs",
    "reduce_gradients",
    "save",
    "save_weights",
    "shard",
]
__version__ = "0.1.0"
