"""A cut or garbled GGUF file is one line naming the file, that it is truncated or corrupt, the field and byte
where it breaks and how to get it again (models/gguf_file.py, checked by `fledge import-gguf` before loading),
never a ``struct.error`` from the loader. Cut in each section: the header, the key-values, the tensor infos,
the tensor data."""

import struct
import subprocess
import sys

import pytest

from fledge.models import gguf_import
from tests.helpers.cli import ENV
from tests.helpers.gguf import write_gguf

KV = {"general.architecture": "llama", "general.name": "tiny", "tokenizer.chat_template": "{{ messages }}"}
TENSORS = {"token_embd.weight": [0.5] * 24, "output.weight": [1.5] * 40}


@pytest.fixture
def whole(tmp_path):
    path = tmp_path / "model.gguf"
    return path, write_gguf(path, KV, TENSORS)


# where to cut (a byte from the section's start, or from the end when negative) -> what the message names
CUTS = {
    "in the magic": ("kv", -22, "the magic number at byte 0"),
    "in the header's counts": ("kv", -4, "the key-value count at byte 16"),
    "in a key": ("kv", 20, "key 0 at byte 32"),
    "in a value": ("tensor_infos", -10, "the value of tokenizer.chat_template"),
    "in a tensor's name": ("tensor_infos", 12, "tensor 0's name at byte 203"),
    "in a tensor's offset": ("data", -35, "tensor output.weight's offset at byte 281"),
    "in the first tensor's data": ("data", 50, "tensor token_embd.weight's data ends at byte"),
    "in the last tensor's data": ("size", -4, "tensor output.weight's data ends at byte"),
}


@pytest.mark.parametrize("cut", CUTS, ids=list(CUTS))
def test_a_cut_gguf_is_one_line_naming_the_file_and_where(whole, tmp_path, cut):
    path, at = whole
    section, delta, names = CUTS[cut]
    keep = at[section] + delta
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ValueError) as e:
        gguf_import.import_gguf(str(path), tmp_path / "out", log=lambda *a: None)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}: truncated or corrupt GGUF file: "), message
    assert names in message and "download or copy model.gguf again" in message, message
    assert not (tmp_path / "out").exists()


def test_a_garbled_gguf_is_one_line_too(whole, tmp_path):
    path, at = whole
    data = bytearray(path.read_bytes())
    data[at["kv"] + 8 + len("general.alignment")] = 77  # the first value's type
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"^{path}: corrupt GGUF file: unknown value type 77 in the value of "
                                         r"general.alignment at byte \d+"):
        gguf_import.import_gguf(str(path), tmp_path / "out", log=lambda *a: None)
    path.write_bytes(b"GGML" + bytes(data[4:]))
    with pytest.raises(ValueError, match=rf"^{path}: corrupt GGUF file: it does not start with GGUF"):
        gguf_import.import_gguf(str(path), tmp_path / "out", log=lambda *a: None)


def test_a_whole_gguf_passes_the_check(whole, tmp_path, monkeypatch):
    path, _ = whole
    from fledge.models.gguf_file import check_gguf

    check_gguf(path)  # no error: every section and every tensor's bytes are there
    data = path.read_bytes()
    assert struct.unpack("<Q", data[8:16])[0] == len(TENSORS)


def test_the_cli_says_it_in_one_line(whole, tmp_path):
    path, at = whole
    path.write_bytes(path.read_bytes()[: at["tensor_infos"] + 12])
    res = subprocess.run([sys.executable, "-m", "fledge", "import-gguf", str(path), "--out", str(tmp_path / "o")],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"fledge import-gguf: {path}: truncated or corrupt GGUF file: tensor 0's name at byte {at['tensor_infos'] + 8} "
        f"runs past its end ({at['tensor_infos'] + 12} bytes); download or copy model.gguf again"]
