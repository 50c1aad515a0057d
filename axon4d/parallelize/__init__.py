"""Drop-in parallelization of an existing model: ``auto_parallelize(model)`` and ``to_dense(model)``
(docs/design.md §2; the user guide is docs/parallelize.md).

``auto_parallelize`` swaps every ``torch.nn.Linear`` (and Hugging Face's ``Conv1D``) for a
``ShardedLinear`` around an ``axon4d.Linear`` (E2–E7) and keeps the model's own forward code. The
model runs on this rank's token shard (``axon4d.shard_batch``, dim 0 split over batch = data × z).
Three styles (``auto_parallelize(model, style=...)``), from most general to most efficient:

- **general** (any model): the layer takes full features, slices its input features locally (no
  communication) and all-gathers its output features, so the code around it (norms, residuals,
  attention maths, reshapes, embeddings) runs replicated over x and y on full features.
- **chained** (blocks in ``FAMILY_STYLES``): inside an attention or MLP block whose code between
  projections only reshapes per head or acts elementwise, the first projections are normal layers
  whose output stays split over y (attention runs on this rank's heads only), and the last is a
  transposed layer that takes that split input and gathers over x — one all-gather per block.
- **sharded** (models in ``SHARDED_STYLES``, the default): the residual stream stays split over x
  between blocks, norms run on sharded features, the embedding is vocabulary-parallel where it can
  be, and only the logits are gathered.

The modules of this package:

- ``walk``: ``auto_parallelize`` and ``to_dense``, the style tables ``FAMILY_STYLES`` and ``SHARDED_STYLES``;
- ``styles``: what a style says (``LinearStyle``, ``BlockStyle``) and the pieces the family styles share;
- ``llama``, ``gpt2``: the styles of each model family; ``general``: the general path;
- ``layers``: the modules put in place of a model's own (``ShardedLinear``, ``ShardedNorm``);
- ``loading``: ``load_pretrained_``, filling a parallelized model (built on the meta device) with
  this rank's slices of a saved safetensors checkpoint — no rank reads the whole model.
"""

from axon4d.parallelize.dense import to_dense
from axon4d.parallelize.loading import load_pretrained_
from axon4d.parallelize.walk import auto_parallelize

__all__ = ["auto_parallelize", "load_pretrained_", "to_dense"]
