"""Files written and read shard by shard.

    ckptfiles          a checkpoint's files: the restricted reader of DCP's index, per-file
                       checksums, atomic publication (``CheckpointError``)
    safetensors_files  safetensors files written tensor by tensor, cut into shards, and their index

This package's ``__init__`` imports nothing; import the modules by their full names.
"""
