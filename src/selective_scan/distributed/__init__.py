"""Distributed Mamba on torch.distributed: DTensor sharding rules of the operators, tensor
parallelism of the Mamba layer, and context parallelism of the scan (docs/distributed.md).

Importing this package registers the sharding rules, so that the public functions accept
DTensors.
"""

from .context_parallel import context_parallel_scan
from .sharding import register_sharding_rules
from .tensor_parallel import (
    TensorParallelMamba,
    checkpoint_state_dict,
    fsdp_shard_placement,
    load_checkpoint,
    parallelize_mamba,
)

register_sharding_rules()

__all__ = [
    "TensorParallelMamba",
    "checkpoint_state_dict",
    "context_parallel_scan",
    "fsdp_shard_placement",
    "load_checkpoint",
    "parallelize_mamba",
    "register_sharding_rules",
]
