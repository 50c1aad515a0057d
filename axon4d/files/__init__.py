"""Files written and read shard by shard.

    ckptindex          a checkpoint's index read without running code: the piece index, DCP's
                       index through a restricted unpickler, the shards they list, DCP's reader
    ckptfiles          a checkpoint directory's files: meta.json, per-file checksums, atomic
                       publication, ``latest``, the listing, resume checks (``CheckpointError``)
    ckptdelete         old checkpoints deleted in a background thread, failures kept
    safetensors_files  safetensors files written tensor by tensor, cut into shards, and their index

This package's ``__init__`` imports nothing; import the modules by their full names.
"""
