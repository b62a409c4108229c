"""Files Fledge writes honour the umask: every atomic writer (fledge/atomic.py) gives a file the mode a plain
``open`` would (0666 less the umask) and a directory 0777 less it, the files safetensors and the Hub's writers
create 0600 inside atomic_path included, so an export a vLLM service under another account reads, or a
teammate's report, is as readable as the user's umask says, not 0600."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.cli import ENV

WRITE_ALL = """
import json, stat, sys
from pathlib import Path
from fledge.atomic import atomic_path, write_bytes_atomic, write_json_atomic
d = Path(sys.argv[1])
write_bytes_atomic(d / "bytes.bin", b"x")
write_json_atomic(d / "report.json", {"a": 1})
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import save_file
with atomic_path(d / "shard.safetensors") as tmp:  # a feature store's shard, the draft vocab
    save_file({"a": torch.zeros(2)}, str(tmp))
with atomic_path(d / "export") as tmp:
    tmp.mkdir()
    write_json_atomic(tmp / "config.json", {})
with atomic_path(d / "export") as tmp:  # replacing its own output: an export (serving/export.py), a checkpoint
    tmp.mkdir()
    write_json_atomic(tmp / "config.json", {"again": True})
    save_torch_state_dict({"a": torch.zeros(2)}, tmp)
    (tmp / "sub").mkdir()
    save_file({"a": torch.zeros(2)}, str(tmp / "sub" / "model.safetensors"))
print(json.dumps({str(p.relative_to(d)): [stat.S_IMODE(p.stat().st_mode), p.is_dir()] for p in d.rglob("*")}))
"""


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_every_atomic_writer_honours_the_umask(tmp_path, umask):
    res = subprocess.run([sys.executable, "-c", WRITE_ALL, str(tmp_path)], env=ENV, capture_output=True, text=True,
                         timeout=120, preexec_fn=lambda: os.umask(umask))
    assert res.returncode == 0, res.stderr
    modes = json.loads(res.stdout)
    assert {"bytes.bin", "report.json", "shard.safetensors", "export", "export/config.json",
            "export/model.safetensors", "export/sub/model.safetensors"} <= set(modes)
    wrong = {name: oct(mode) for name, (mode, is_dir) in modes.items()
             if mode != (0o777 if is_dir else 0o666) & ~umask}
    assert wrong == {}, f"umask {umask:04o}: {wrong}"

