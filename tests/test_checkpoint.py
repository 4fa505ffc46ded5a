"""Checkpoints that survive a crash, without MPI.

Every checkpoint that is not exactly what was written (truncated, a flipped byte, contents
changed under an old checksum, another format version, not a checkpoint at all) is refused with
a ``CheckpointError`` naming the file; a writer killed mid-write leaves the previous checkpoint
as the newest loadable one; only the newest K are kept. A checkpoint carries its run's identity
(a digest of the settings a resume needs to match); a save keeps and deletes only its own run's,
and never writes over another run's file.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from allreduce_kit.train import checkpoint
from allreduce_kit.train.checkpoint import CheckpointError


def _arrays(seed=0, n=1000):
    rng = np.random.default_rng(seed)
    return {"params": rng.standard_normal(n).astype(np.float32), "velocity": rng.standard_normal(n).astype(np.float32)}


def test_round_trip_and_only_the_newest_k_are_kept(tmp_path):
    for step in (10, 20, 30, 40, 50):
        path = checkpoint.save(str(tmp_path), step, _arrays(step), {"ranks": 2}, keep=2)
        assert os.path.basename(path) == checkpoint.name_for(step)
    assert [s for s, _ in checkpoint.listing(str(tmp_path))] == [40, 50]
    assert sorted(os.listdir(tmp_path)) == [checkpoint.name_for(40), checkpoint.name_for(50)]
    arrays, meta = checkpoint.load(checkpoint.latest(str(tmp_path)))
    assert meta["step"] == 50 and meta["ranks"] == 2 and meta["version"] == checkpoint.VERSION
    for name, a in _arrays(50).items():
        assert np.array_equal(arrays[name], a) and arrays[name].dtype == a.dtype


# -- a run's checkpoints among another run's ------------------------------------------------------
def _config(**changed):
    config = {"dataset": "digits", "seed": 0, "test_fraction": 0.2, "hidden": [32], "dtype": "float32",
              "samples": 20000, "features": 64, "classes": 10, "epochs": 3, "lr": 0.05, "batch_size": 16}
    return {**config, **changed}


def _meta(mode="sync", **changed):
    """A checkpoint record as the trainer writes it: the run's identity and settings, and its configuration."""
    settings = checkpoint.run_settings(_config(**changed), mode)
    return {"ranks": 2, "mode": mode, "config": _config(**changed), "run": checkpoint.run_identity(settings),
            "run_settings": settings}


def test_the_identity_is_made_of_the_settings_a_resume_needs_and_of_nothing_else():
    mine = checkpoint.identity_of(_meta())
    for other in (_meta(seed=1), _meta(hidden=[16]), _meta(dtype="float64"), _meta(test_fraction=0.3),
                  _meta(dataset="synthetic"), _meta(mode="async-ps")):
        assert checkpoint.identity_of(other) != mine
    # What may change at --resume does not make another run; nor the synthetic sizes on the digits.
    for same in (_meta(epochs=9), _meta(lr=0.1), _meta(batch_size=64), _meta(samples=600), _meta(classes=3)):
        assert checkpoint.identity_of(same) == mine
    assert (checkpoint.identity_of(_meta(dataset="synthetic", samples=600))
            != checkpoint.identity_of(_meta(dataset="synthetic")))
    assert checkpoint.differences(_meta(seed=1)["run_settings"], _meta()["run_settings"]) == \
        "--seed 1 where this run has --seed 0"
    assert checkpoint.differences(_meta(hidden=[16, 8])["run_settings"], _meta()["run_settings"]) == \
        "--hidden 16,8 where this run has --hidden 32"


def test_a_record_without_an_identity_has_it_from_its_configuration_or_has_none():
    """Checkpoints that record no identity: worked out from the configuration they record, else None."""
    meta = _meta()
    old = {k: v for k, v in meta.items() if k not in ("run", "run_settings")}
    assert checkpoint.identity_of(old) == checkpoint.identity_of(meta)
    assert checkpoint.settings_of(old) == meta["run_settings"]
    assert checkpoint.identity_of({"ranks": 2}) is None and checkpoint.settings_of({"ranks": 2}) is None


def test_a_save_keeps_and_deletes_only_its_own_runs_checkpoints(tmp_path):
    """Another run's newer checkpoint stays, and does not count towards this run's newest K; nor does a
    file whose run cannot be told."""
    directory = str(tmp_path)
    checkpoint.save(directory, 240, _arrays(), _meta(seed=1), keep=3)
    checkpoint.save(directory, 5, _arrays(), {"ranks": 2}, keep=3)              # no identity at all
    for step in (10, 20, 30, 40):
        checkpoint.save(directory, step, _arrays(step), _meta(), keep=3)
    assert [s for s, _ in checkpoint.listing(directory)] == [5, 20, 30, 40, 240]
    runs = {f.step: f.run for f in checkpoint.survey(directory)}
    assert runs[5] is None and runs[240] == checkpoint.identity_of(_meta(seed=1))
    assert {runs[s] for s in (20, 30, 40)} == {checkpoint.identity_of(_meta())}


def test_a_save_never_writes_over_another_runs_checkpoint(tmp_path):
    directory = str(tmp_path)
    theirs = checkpoint.save(directory, 30, _arrays(1), _meta(seed=1))
    before = open(theirs, "rb").read()
    with pytest.raises(CheckpointError, match=f"{theirs} holds a checkpoint of another run; it is not written over"):
        checkpoint.save(directory, 30, _arrays(2), _meta())
    assert open(theirs, "rb").read() == before and not any(n.startswith(".") for n in os.listdir(directory))
    checkpoint.save(directory, 30, _arrays(3), _meta(seed=1))                    # its own run's: replaced
    assert np.array_equal(checkpoint.load(theirs)[0]["params"], _arrays(3)["params"])


@pytest.fixture
def saved(tmp_path):
    return checkpoint.save(str(tmp_path), 7, _arrays(), {"ranks": 2})


def test_a_truncated_checkpoint_is_refused_by_name(saved):
    size = os.path.getsize(saved)
    for keep in (size // 2, size - 10, 0):
        with open(saved, "r+b") as f:
            f.truncate(keep)
        with pytest.raises(CheckpointError, match=f"{saved} is truncated or corrupted"):
            checkpoint.load(saved)


def test_a_flipped_byte_anywhere_in_the_data_is_refused_by_name(saved):
    data = bytearray(open(saved, "rb").read())
    for offset in (len(data) // 3, len(data) // 2):      # inside the arrays' bytes
        bad = bytearray(data)
        bad[offset] ^= 0x40
        with open(saved, "wb") as f:
            f.write(bad)
        with pytest.raises(CheckpointError, match=str(saved)):
            checkpoint.load(saved)


def _rewrite(path, **changes):
    """Rewrite the file as a well-formed npz with some fields changed (the zip CRCs are then valid)."""
    with np.load(path) as data:
        fields = {k: data[k] for k in data.files}
    fields.update(changes)
    with open(path, "wb") as f:
        np.savez(f, **fields)


def test_contents_that_do_not_match_the_checksum_are_refused(saved):
    arrays, _ = checkpoint.load(saved)
    params = arrays["params"].copy()
    params[3] += 1
    _rewrite(saved, params=params)
    with pytest.raises(CheckpointError, match=f"{saved} is corrupted: its checksum does not match"):
        checkpoint.load(saved)


def test_another_format_version_or_a_foreign_file_is_refused(saved, tmp_path):
    with np.load(saved) as data:
        meta = json.loads(str(data["meta"]))
        arrays = {k: data[k] for k in data.files if k not in ("meta", "checksum")}
    record = json.dumps({**meta, "version": checkpoint.VERSION + 1})
    _rewrite(saved, meta=np.array(record), checksum=np.array(checkpoint.checksum(arrays, record)))
    with pytest.raises(CheckpointError, match=f"{saved} has checkpoint format version {checkpoint.VERSION + 1}"):
        checkpoint.load(saved)
    foreign = tmp_path / "checkpoint-000000001.npz"
    np.savez(foreign, params=np.zeros(3))
    with pytest.raises(CheckpointError, match=f"{foreign} is not an allreduce_kit.train checkpoint"):
        checkpoint.load(str(foreign))
    (tmp_path / "checkpoint-000000002.npz").write_text("hello")
    with pytest.raises(CheckpointError, match="checkpoint-000000002.npz is truncated or corrupted"):
        checkpoint.load(str(tmp_path / "checkpoint-000000002.npz"))


# The writer is a separate process, killed with SIGKILL at a chosen point of its second save:
# in the middle of writing the data, or after the fsync but before the rename.
WRITER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from allreduce_kit.train import checkpoint
    directory, where = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(0)
    checkpoint.save(directory, 1, {"params": np.arange(1000, dtype=np.float32)}, {"ranks": 1})

    def stop(point):
        print("stopped", point, flush=True)
        time.sleep(600)                            # killed here

    class Slow:                                    # a file that stops halfway through the data
        def __init__(self, f): self.f, self.written = f, 0
        def write(self, b):
            if self.written > 4_000_000: stop("mid-write")
            self.written += len(b)
            return self.f.write(b)
        def __getattr__(self, name): return getattr(self.f, name)
        def __enter__(self): return self
        def __exit__(self, *a): return self.f.__exit__(*a)

    if where == "mid-write":
        checkpoint.open = lambda *a, **k: Slow(open(*a, **k))
    else:
        checkpoint.os.replace = lambda *a: stop("before-rename")
    checkpoint.save(directory, 2, {"params": rng.standard_normal(4_000_000)}, {"ranks": 1})
""")


@pytest.mark.parametrize("where", ["mid-write", "before-rename"])
def test_killing_the_writer_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, where):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    directory = tmp_path / "ckpt"
    writer = subprocess.Popen([sys.executable, str(script), str(directory), where], stdout=subprocess.PIPE,
                              text=True, cwd=str(tmp_path))
    try:
        line = writer.stdout.readline()
        assert line.strip() == f"stopped {where}", line
        leftovers = [f for f in os.listdir(directory) if f.startswith(checkpoint.TMP_PREFIX)]
        assert len(leftovers) == 1 and os.path.getsize(directory / leftovers[0]) > 0   # a partial new file
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=30)
    assert writer.returncode == -signal.SIGKILL
    newest = checkpoint.latest(str(directory))
    assert os.path.basename(newest) == checkpoint.name_for(1)
    arrays, meta = checkpoint.load(newest)
    assert meta["step"] == 1 and np.array_equal(arrays["params"], np.arange(1000, dtype=np.float32))
    checkpoint.save(str(directory), 3, {"params": np.zeros(2)}, {"ranks": 1})     # the next save tidies up
    assert sorted(os.listdir(directory)) == [checkpoint.name_for(1), checkpoint.name_for(3)]
