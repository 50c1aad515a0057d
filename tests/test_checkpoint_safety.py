"""Protects checkpoints that are safe and honest (issue 16): loading a planted directory runs no
code; a flipped byte, a truncated or a missing file, a bad meta.json and another model's
checkpoint are clear errors raised alike on every rank; a save is published atomically (a save
that fails midway leaves the previous checkpoint as ``latest`` and loadable, and its leftovers are
removed by the next save); ``keep_last``, the ``latest`` pointer and stray names; data position
and RNG states come back from ``load``. A checkpoint from before the piece index (DCP's ``.metadata``,
made here by ``_legacy``) loads as before, and its index is read as safely."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from axon4d import checkpoint
from axon4d import device as devices
from axon4d.config import ModelConfig
from axon4d.files import ckptdelete, ckptfiles, ckptindex
from axon4d.models.transformer import Transformer

CFG = ModelConfig(n_layers=1, hidden=32, n_heads=4, vocab_size=64, seq_len=16)


class _Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _save(grid, out, steps, keep_last=0, **kwargs):
    """Save a small model and AdamW state as ``out/step_<s>`` for each of ``steps``; the names left."""
    torch.manual_seed(1)
    model = Transformer(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():  # one step on a made-up gradient, so that both moments exist
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    for s in steps:
        checkpoint.save(os.path.join(out, f"step_{s}"), model, grid, opt, step=s, keep_last=keep_last, **kwargs)
    assert ckptdelete.wait_deletions() == []  # old checkpoints are deleted in the background
    return sorted(os.listdir(out))


def _outcome(call):
    try:
        return ("ok", call())
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        return (type(e).__name__, str(e))


def _load(grid, path, cfg=CFG):
    """("ok", step) or (error type, message) of loading ``path`` into a fresh model and optimizer."""
    torch.manual_seed(7)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return _outcome(lambda: checkpoint.load(path, model, grid, opt)["step"])


def _record(path, name):
    """Rewrite meta.json's checksum of ``name`` to match the file as it is now (as a forger would)."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(path, name), "rb") as f:
        data = f.read()
    meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)


def _legacy(path):
    """Make the checkpoint at ``path`` one written before the piece index: DCP's whole index pickled
    as ``.metadata`` (as DCP wrote it) in place of pieces.json and pieces.npy, meta.json to match."""
    md = ckptindex.read_index(path)  # built from the piece index
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    for name in (ckptfiles.PIECES, ckptfiles.CHUNKS):
        os.remove(os.path.join(path, name))
        del meta["files"][name]
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    _record(path, ".metadata")
    return path


def _index(path):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # the test's own, trusted file


def _plant_index(path, obj):
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(obj, f)
    _record(path, ".metadata")


def _planted(kind, path, marker):
    """Replace the checkpoint's DCP index by one whose unpickling would run code (``kind``)."""
    if kind == "top-level":
        _plant_index(path, _Payload(marker))
    elif kind == "nested":
        md = _index(path)
        md.planner_data = {"note": _Payload(marker)}
        _plant_index(path, md)
    elif kind == "bytes-entry":  # DCP would torch.load(weights_only=False) such an entry's bytes
        md = _index(path)
        md.state_dict_metadata[next(iter(md.state_dict_metadata))] = BytesStorageMetadata()
        _plant_index(path, md)
    elif kind == "eval":
        with open(os.path.join(path, ".metadata"), "wb") as f:
            f.write(b"cbuiltins\neval\n(V__import__('os').system('touch " + marker.encode() + b"')\ntR.")
        _record(path, ".metadata")


@pytest.fixture(scope="module")
def saved_once(pools, tmp_path_factory):
    """A 2-rank checkpoint ``step_2`` made once; tests copy it before changing it."""
    out = str(tmp_path_factory.mktemp("saved"))
    pools(2).run((2, 1, 1, 1), _save, out, [2])
    return os.path.join(out, "step_2")


def _copy(src, tmp_path, legacy=True):
    dst = str(tmp_path / "ckpts" / "step_2")
    shutil.copytree(src, dst)
    return _legacy(dst) if legacy else dst


@pytest.mark.parametrize("kind", ["top-level", "nested", "bytes-entry", "eval"])
def test_a_planted_index_is_refused_without_running_it(saved_once, tmp_path, kind):
    path, marker = _copy(saved_once, tmp_path), str(tmp_path / "pwned")
    _planted(kind, path, marker)
    with pytest.raises(ckptfiles.CheckpointError, match=r"\.metadata") as e:
        ckptindex.read_index(path)
    assert not os.path.exists(marker)
    assert "BytesStorageMetadata" in str(e.value) or "refusing" in str(e.value)
    if kind != "bytes-entry":  # the payload is real: a plain unpickling runs it
        _index(path)
        assert os.path.exists(marker)


def test_load_of_a_planted_index_raises_on_every_rank_and_runs_nothing(pools, saved_once, tmp_path):
    path, marker = _copy(saved_once, tmp_path), str(tmp_path / "pwned")
    _planted("top-level", path, marker)
    outcomes = pools(2).run((2, 1, 1, 1), _load, path)
    assert not os.path.exists(marker)
    assert outcomes[0] == outcomes[1], outcomes
    kind, message = outcomes[0]
    assert kind == "CheckpointError" and "system" in message and ".metadata" in message, message


def test_a_planted_shard_is_refused_without_running_it(pools, saved_once, tmp_path):
    path, marker = _copy(saved_once, tmp_path), str(tmp_path / "pwned")
    torch.save(_Payload(marker), os.path.join(path, "evil.distcp"))
    size = os.path.getsize(os.path.join(path, "evil.distcp"))
    md = _index(path)
    for info in md.storage_data.values():  # every tensor now reads the payload (a legal index)
        info.relative_path, info.offset, info.length = "evil.distcp", 0, size
    _plant_index(path, md)
    _record(path, "evil.distcp")
    outcomes = pools(2).run((2, 1, 1, 1), _load, path)
    assert not os.path.exists(marker)
    assert all(kind != "ok" for kind, _ in outcomes) and "weights_only" in outcomes[0][1], outcomes
    torch.load(os.path.join(path, "evil.distcp"), weights_only=False)  # the payload is real
    assert os.path.exists(marker)


def test_a_planted_piece_index_is_refused_without_running_it(pools, saved_once, tmp_path):
    path, marker = _copy(saved_once, tmp_path, legacy=False), str(tmp_path / "pwned")
    with open(os.path.join(path, ckptfiles.CHUNKS), "wb") as f:  # an object array: np.load would unpickle it
        pickle.dump(_Payload(marker), f)
    _record(path, ckptfiles.CHUNKS)
    with pytest.raises(ckptfiles.CheckpointError, match="piece index"):
        ckptindex.PieceIndex(path)
    outcomes = pools(2).run((2, 1, 1, 1), _load, path)
    assert not os.path.exists(marker)
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "CheckpointError", outcomes


def _sums(grid, path):
    """This rank's sum of its loaded parameters and moments, exactly (as a float's hex)."""
    torch.manual_seed(7)
    model = Transformer(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checkpoint.load(path, model, grid, opt)
    total = sum(p.double().sum() for p in model.parameters())
    total += sum(t.double().sum() for st in opt.state.values() for t in st.values())
    return float(total).hex()


def test_a_checkpoint_from_before_the_piece_index_loads_alike(pools, saved_once, tmp_path):
    legacy = _copy(saved_once, tmp_path)
    assert not ckptindex.has_piece_index(legacy) and ckptindex.has_piece_index(saved_once)
    pool = pools(2)
    assert pool.run((1, 2, 1, 1), _sums, legacy) == pool.run((1, 2, 1, 1), _sums, saved_once)


def test_old_checkpoints_are_deleted_in_the_background_and_failures_reported(tmp_path, monkeypatch, caplog):
    for n in (1, 2):
        (tmp_path / f"step_{n}" / "sub").mkdir(parents=True)
        (tmp_path / f"step_{n}" / "meta.json").write_text('{"step": 1}')
    ckptdelete.delete_in_background([ckptfiles._discard(str(tmp_path / "step_1"))])
    assert ckptdelete.wait_deletions() == [] and sorted(os.listdir(tmp_path)) == ["step_2"]

    def refuse(path, *a, **k):
        raise PermissionError(f"read-only: {path}")

    monkeypatch.setattr(shutil, "rmtree", refuse)
    ckptdelete.delete_in_background([ckptfiles._discard(str(tmp_path / "step_2"))])
    failures = ckptdelete.wait_deletions()
    assert len(failures) == 1 and "step_2.deleting" in failures[0] and "read-only" in failures[0], failures
    assert "could not delete the old checkpoint" in caplog.text
    assert checkpoint.list_checkpoints(str(tmp_path)) == []  # out of sight although not deleted


def _shard_checked_by(path, world, rank):
    """A shard file ``load`` gives ``rank`` to verify (meta.json's files, dealt out in name order)."""
    names = sorted(json.load(open(os.path.join(path, "meta.json")))["files"])
    mine = [n for n in names[rank::world] if n.endswith(".distcp")]
    return mine[-1]


def _flip(file, n=4):
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) // 2)
        data = bytearray(f.read(n))
        f.seek(os.path.getsize(file) // 2)
        f.write(bytes(b ^ 0xFF for b in data))


@pytest.mark.parametrize(
    "fault, expected",
    [
        ("flip", r"has sha256 [0-9a-f]{64}, meta.json records [0-9a-f]{64}"),
        ("flip-index", r"pieces\.json has sha256"),
        ("flip-index-legacy", r"\.metadata has sha256"),
        ("truncate", r"truncated: \d+ bytes, its index needs at least \d+|is \d+ bytes, meta.json records \d+"),
        ("truncate-legacy", r"truncated: \d+ bytes, its index needs at least \d+|is \d+ bytes, meta.json records \d+"),
        ("truncate-unrecorded", r"truncated: \d+ bytes, its index needs at least \d+"),
        ("remove", r"is missing"),
    ],
)
def test_a_damaged_checkpoint_is_the_same_clear_error_on_every_rank(pools, tmp_path, fault, expected):
    out = str(tmp_path / "ckpts")
    pools(4).run((2, 2, 1, 1), _save, out, [2])
    path = os.path.join(out, "step_2")
    if fault.endswith("-legacy"):
        _legacy(path)
    victim = os.path.join(path, _shard_checked_by(path, 4, 3))  # only rank 3 hashes it
    if fault == "flip":
        _flip(victim)
    elif fault == "flip-index":
        _flip(os.path.join(path, ckptfiles.PIECES), n=1)
    elif fault == "flip-index-legacy":
        _flip(os.path.join(path, ".metadata"), n=1)
    elif fault.startswith("truncate"):
        if fault == "truncate-unrecorded":  # a checkpoint from before checksums: lengths still checked
            meta = json.load(open(os.path.join(path, "meta.json")))
            del meta["files"]
            json.dump(meta, open(os.path.join(path, "meta.json"), "w"))
        os.truncate(victim, os.path.getsize(victim) // 2)
    else:
        os.remove(victim)
    outcomes = pools(4).run((1, 2, 1, 2), _load, path)  # another grid, as a resume may be
    assert len(set(outcomes)) == 1, outcomes
    kind, message = outcomes[0]
    assert kind == "CheckpointError", outcomes[0]
    assert re.search(expected, message), message
    if not fault.startswith("flip-index"):
        assert victim in message, message


def test_another_models_checkpoint_names_the_field(pools, saved_once, tmp_path):
    other = ModelConfig(n_layers=1, hidden=64, n_heads=4, vocab_size=64, seq_len=16)
    outcomes = pools(2).run((2, 1, 1, 1), _load, saved_once, other)
    assert outcomes[0] == outcomes[1]
    kind, message = outcomes[0]
    assert kind == "ValueError" and "'hidden'" in message and "saved 32" in message and "this run 64" in message


def test_bad_directories_and_meta_json_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        checkpoint.read_meta(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        checkpoint.read_meta(str(tmp_path / "empty"))
    for text, expected in [
        ("{not json", "not valid JSON"),
        ('{"grid": [1, 1, 1, 1]}', "records step None"),
        ('{"step": -3}', "records step -3"),
        ("[2]", "records step None"),
        ('{"step": 2, "files": {"a": 3}}', "records files"),
    ]:
        (tmp_path / "empty" / "meta.json").write_text(text)
        with pytest.raises(ckptfiles.CheckpointError, match=expected):
            checkpoint.read_meta(str(tmp_path / "empty"))


def test_check_compatible_names_the_first_differing_field():
    meta = {"model_config": dict(vars(CFG)), "train_config": {"lr": 1e-3, "steps": 10, "seed": 0}}
    checkpoint.check_compatible(meta, model_config=CFG, train_config={"lr": 1e-3, "steps": 50, "seed": 0})
    with pytest.raises(ValueError, match=r"model configuration differs in 'n_layers': saved 1, this run 2"):
        checkpoint.check_compatible(meta, model_config=ModelConfig(n_layers=2, hidden=32, n_heads=4, vocab_size=64))
    with pytest.raises(
        ValueError, match=r"training configuration differs in 'lr': saved 0.001, this run 0.1.*--out-dir"
    ):
        checkpoint.check_compatible(meta, train_config={"lr": 0.1, "steps": 10, "seed": 0})
    checkpoint.check_compatible(meta, train_config={"lr": 0.1, "seed": 0}, ignore={"lr"})
    with pytest.raises(ValueError, match=r"'seed': saved '<absent>'"):
        checkpoint.check_compatible({"train_config": {}}, train_config={"seed": 0})
    with pytest.raises(ValueError, match="records no training configuration"):
        checkpoint.check_compatible({"step": 1}, train_config={"seed": 0})
    assert {"steps", "keep_last", "out_dir", "grid", "resume"} <= checkpoint.RESUMABLE_CHANGES


def _fail_publishing(grid, out):
    """Save step_4 while the rename that publishes it fails on rank 0; the outcome on this rank."""
    real = os.rename

    def broken(src, dst, *a, **k):
        if str(dst).endswith("step_4"):
            raise OSError(f"disk full while renaming {src}")
        return real(src, dst, *a, **k)

    os.rename = broken if grid.rank == 0 else real
    try:
        return _outcome(lambda: _save(grid, out, [4]))
    finally:
        os.rename = real


def _fail_writing(grid, out):
    """Save step_6 while DCP's write fails on rank 1; the outcome on this rank."""
    real = FileSystemWriter.write_data

    def broken(self, *a, **k):
        raise OSError("the shard could not be written")

    FileSystemWriter.write_data = broken if grid.rank == 1 else real
    try:
        return _outcome(lambda: _save(grid, out, [6]))
    finally:
        FileSystemWriter.write_data = real


def test_a_failed_save_leaves_the_previous_checkpoint_published(pools, tmp_path):
    out = str(tmp_path / "ckpts")
    pool = pools(2)
    pool.run((2, 1, 1, 1), _save, out, [2])
    publishing = pool.run((2, 1, 1, 1), _fail_publishing, out)
    assert publishing[0] == publishing[1] and publishing[0][0] == "OSError" and "disk full" in publishing[0][1]
    assert sorted(os.listdir(out)) == [".step_4.partial", "latest", "step_2"]
    writing = pool.run((2, 1, 1, 1), _fail_writing, out)
    assert all(kind != "ok" for kind, _ in writing) and "could not be written" in writing[0][1], writing
    assert sorted(os.listdir(out)) == [".step_6.partial", "latest", "step_2"]  # step_4's leftovers removed
    for _ in range(2):
        assert checkpoint.latest(out) == os.path.join(out, "step_2")
        assert checkpoint.list_checkpoints(out) == [os.path.join(out, "step_2")]
        assert pool.run((1, 2, 1, 1), _load, checkpoint.latest(out)) == [("ok", 2)] * 2
        with open(os.path.join(out, "latest"), "w") as f:  # and with a pointer to the failed save
            f.write("step_4\n")
    names = pool.run((2, 1, 1, 1), _save, out, [8])[0]
    assert names == ["latest", "step_2", "step_8"], names
    assert checkpoint.latest(out) == os.path.join(out, "step_8")


def test_an_existing_checkpoint_is_replaced_only_when_asked(pools, tmp_path):
    out = str(tmp_path / "ckpts")
    pool = pools(2)
    pool.run((2, 1, 1, 1), _save, out, [3])
    refused = pool.run((2, 1, 1, 1), _save_outcome, out, [3], {})
    assert refused[0] == refused[1] and refused[0][0] == "FileExistsError" and "overwrite=True" in refused[0][1]
    assert sorted(os.listdir(out)) == ["latest", "step_3"]  # refused before anything was written
    assert pool.run((2, 1, 1, 1), _save_outcome, out, [3], {"overwrite": True, "extra": {"note": "new"}})[0][0] == "ok"
    assert checkpoint.read_meta(os.path.join(out, "step_3"))["note"] == "new"
    assert sorted(os.listdir(out)) == ["latest", "step_3"]


def _save_outcome(grid, out, steps, kwargs):
    return _outcome(lambda: _save(grid, out, steps, **kwargs))


def test_keep_last_keeps_the_newest(pools, tmp_path):
    out = str(tmp_path / "ckpts")
    names = pools(2).run((2, 1, 1, 1), _save, out, [1, 2, 3, 4], 2)[0]
    assert names == ["latest", "step_3", "step_4"], names
    assert checkpoint.latest(out) == os.path.join(out, "step_4")


def test_latest_follows_the_pointer_and_ignores_stray_names(pools, tmp_path):
    out = str(tmp_path / "ckpts")
    pools(1).run((1, 1, 1, 1), _save, out, [10, 3])
    for stray in ("step_final", "notes", "step_x", "step_20", "step_-1", ".step_30.partial"):
        os.makedirs(os.path.join(out, stray))
    (tmp_path / "ckpts" / "step_final" / "meta.json").write_text('{"step": 99}')
    (tmp_path / "ckpts" / ".step_30.partial" / "meta.json").write_text('{"step": 30}')
    assert checkpoint.list_checkpoints(out) == [os.path.join(out, "step_3"), os.path.join(out, "step_10")]
    assert checkpoint.latest(out) == os.path.join(out, "step_3")  # the last one published
    for pointer in ("step_20\n", "step_final", "../elsewhere", ""):
        (tmp_path / "ckpts" / "latest").write_text(pointer)
        assert checkpoint.latest(out) == os.path.join(out, "step_10"), pointer
    assert checkpoint.latest(str(tmp_path / "nowhere")) is None


def _save_and_restore(grid, out):
    torch.manual_seed(3)
    rng = devices.rng_state(grid.device)
    expected = torch.rand(4)
    _save(grid, out, [5], data_position={"batches_seen": 40}, rng=rng)
    torch.manual_seed(11)
    model = Transformer(CFG)
    meta = checkpoint.load(os.path.join(out, "step_5"), model, grid)
    devices.restore_rng(meta["rng"], grid.device)
    return meta["data_position"], torch.equal(torch.rand(4), expected), meta["files"]


def test_meta_records_checksums_data_position_and_rng(pools, tmp_path):
    out = str(tmp_path / "ckpts")
    position, same_draws, files = pools(2).run((2, 1, 1, 1), _save_and_restore, out)[1]
    assert position == {"batches_seen": 40} and same_draws
    path = os.path.join(out, "step_5")
    assert set(files) == set(os.listdir(path)) - {"meta.json"}
    for name, rec in files.items():
        assert ckptfiles.digest(os.path.join(path, name)) == (rec["sha256"], rec["bytes"])


def _bad_save(grid, out, kwargs):
    steps = [kwargs.pop("step")] if "step" in kwargs else [2]
    return _save_outcome(grid, out, steps, kwargs)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"step": -1}, "step -1 must be an integer >= 0"),
        ({"keep_last": -1}, "keep_last -1 must be an integer >= 0"),
        ({"extra": {"step": 3}}, r"extra keys \['step'\] are reserved"),
        ({"rng": {"cpu": torch.zeros(2)}}, "rng = dict cannot be written to meta.json"),
    ],
)
def test_bad_save_arguments_are_refused_on_every_rank(pools, tmp_path, kwargs, expected):
    out = str(tmp_path / "ckpts")
    outcomes = pools(2).run((2, 1, 1, 1), _bad_save, out, kwargs)
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "ValueError", outcomes
    assert re.search(expected, outcomes[0][1]), outcomes[0][1]
    assert not os.path.exists(out)
