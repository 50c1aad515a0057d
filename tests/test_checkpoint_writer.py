"""Protects the thread a checkpoint is written from (``axon4d.checkpoint.writer``): it binds the
rank's device before torch's writer runs there, and it reads the tensors through torch's serial
loader (no device stream, no device sync) unless they live on an accelerator — on a machine where
``torch.cuda.is_available()`` too, for the background save, whose thread never set a device. Start
here when torch's file writer changes how it picks its loader."""

from __future__ import annotations

import os
import threading

import torch
import torch.distributed.checkpoint.filesystem as dcp_files

from axon4d import checkpoint
from axon4d import device as devices
from axon4d.checkpoint.writer import COPY_AHEAD, Writer
from axon4d.config import ModelConfig
from axon4d.models.transformer import Transformer

CFG = ModelConfig(n_layers=1, hidden=32, n_heads=4, vocab_size=64, seq_len=8)


def test_the_writer_copies_ahead_only_from_an_accelerator(tmp_path):
    accelerator = torch.device("cuda", 1)  # nothing touches it: the writer only records the choice
    on_device = Writer(str(tmp_path / "a"), accelerator, sources=accelerator)
    snapshot = Writer(str(tmp_path / "b"), accelerator, sources=devices.HOST)
    assert (on_device.per_thread_copy_ahead, snapshot.per_thread_copy_ahead) == (COPY_AHEAD, 0)
    assert snapshot.device == accelerator and snapshot.thread_count == 1


def _loaders_and_binds(grid, out):
    """Save blocking and in the background as on a CUDA machine (``torch.cuda.is_available`` says
    True): every loader torch's writer makes, and every device bound, with the thread it was in."""
    events: list[tuple[str, str, object]] = []

    def recording(cls):
        class Recorded(cls):
            def __init__(self, *a, **k):
                events.append(("loader", threading.current_thread().name, cls.__name__))
                super().__init__(*a, **k)

        return Recorded

    real = (torch.cuda.is_available, dcp_files._SerialCpuLoader, dcp_files._OverlappingCpuLoader, devices.bind)

    def bind(device):
        events.append(("bind", threading.current_thread().name, str(device)))
        real[3](device)

    torch.cuda.is_available = lambda: True
    dcp_files._SerialCpuLoader = recording(real[1])
    dcp_files._OverlappingCpuLoader = recording(real[2])
    devices.bind = bind
    try:
        torch.manual_seed(0)
        model = Transformer(CFG)
        checkpoint.save(os.path.join(out, "sync"), model, grid)
        with checkpoint.AsyncSaver(grid) as saver:
            saver.save(os.path.join(out, "async"), model)
    finally:
        torch.cuda.is_available, dcp_files._SerialCpuLoader, dcp_files._OverlappingCpuLoader, devices.bind = real
    return events, threading.current_thread().name, str(grid.device)


def test_the_writing_thread_binds_the_rank_device_and_reads_serially(pools, tmp_path):
    for events, main, device in pools(2).run((1, 2, 1, 1), _loaders_and_binds, str(tmp_path)):
        loaders = [(thread, cls) for kind, thread, cls in events if kind == "loader"]
        assert loaders and {cls for _, cls in loaders} == {"_SerialCpuLoader"}
        background = {thread for thread, _ in loaders} - {main}
        assert background, "the background save wrote from the calling thread"
        for thread in {thread for thread, _ in loaders}:  # each writing thread: bound before its first loader
            mine = [(kind, what) for kind, t, what in events if t == thread]
            assert mine[0] == ("bind", device), mine[:3]
