"""Read back an offline wandb run: the .wandb file is a LevelDB-style log of protobuf Records.

Format (wandb's datastore): a 7-byte header ":W&B", 0xBEE1 (little endian), version 0;
then 32 KiB blocks of chunks, each a 7-byte header (masked crc32c: 4 bytes, length: 2,
type: 1 = full, 2 = first, 3 = middle, 4 = last) followed by its bytes; a block tail
shorter than a header is zero padding.
"""

import glob
import json
import struct
import time

from wandb.proto import wandb_internal_pb2

BLOCK = 32768


def records(path):
    """Every Record in a .wandb file."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, f"{path}: not a wandb log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left  # zero padding
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            yield rec
            pending = b""


def offline_run(run_dir, until_step=None, timeout=120.0):
    """(config dict, list of history dicts) of the single offline wandb run under run_dir.

    ``until_step``: wait (up to ``timeout`` seconds) until the history holds that step: wandb's service
    process may still be writing the file after ``wandb.finish()`` returns in the training process."""
    deadline = time.monotonic() + timeout
    while True:
        config, history = _read(run_dir)
        if until_step is None or any(h.get("_step") == until_step for h in history) or time.monotonic() > deadline:
            return config, history
        time.sleep(0.2)


def _read(run_dir):
    files = glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb")
    assert len(files) == 1, f"expected one offline wandb run under {run_dir}, found {files}"
    config, history = {}, []
    for rec in records(files[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in rec.history.item})
        elif kind in ("config", "run"):
            for it in (rec.config if kind == "config" else rec.run.config).update:
                config[it.key or "/".join(it.nested_key)] = json.loads(it.value_json)
    return config, history
