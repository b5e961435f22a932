"""Deploy a tuned context-parallel attention in a PyTorch model (``docs/torch.md``).

``ContextParallelAttention`` runs one configuration, or a plan's per sequence length, on the
caller's ``torch.distributed`` ranks: each rank passes its local q, k, v shards and gets its
local output, and in training the gradients of its shards (autograd runs the strategy's
backward). ``shard_sequence`` and ``unshard_sequence`` cut a full sequence into the shards
a configuration's layout names and put it back together (the module's ``shard`` and
``unshard`` do the same for its own rank and length). ``BatchRunner`` runs a batch plan
(``cptune.mixes.plan_batch``): each rank's ``BatchPart`` runs its group's sequences.
"""

from cptune.torch._attention import ContextParallelAttention
from cptune.torch._batch import BatchPart, BatchRunner
from cptune.torch._sequence import shard_sequence, unshard_sequence

__all__ = ["BatchPart", "BatchRunner", "ContextParallelAttention", "shard_sequence", "unshard_sequence"]
