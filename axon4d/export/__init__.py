"""Export to Hugging Face format by slices (docs/parallelize.md, "Exporting").

What transformers' ``save_pretrained`` writes — ``config.json``, ``model.safetensors`` (or shards of
at most ``max_shard_size`` and ``model.safetensors.index.json``) and the tokenizer's files — from a
model no process holds whole:

- ``live``: ``save_pretrained_(model, out_dir)``, every rank of a running job: axon4d's
  ``Transformer`` or a model ``auto_parallelize`` parallelized, one whole tensor at a time;
- ``from_checkpoint``: ``export_checkpoint(path, out_dir)``, one process, no process group;
- ``output``: the directory, config, tokenizer files and the one buffer both use;
- ``cli``: ``axon4d export-hf CHECKPOINT OUT``.
"""

from axon4d.export.from_checkpoint import export_checkpoint
from axon4d.export.live import save_pretrained_

__all__ = ["export_checkpoint", "save_pretrained_"]
