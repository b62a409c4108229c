"""An untrained DeepSeek-V3-shaped target carrying an MTP module (the tiny ``mla_mtp`` shape, testbed/tiny_families.py)
and MTP drafters of it, for the tests of mechanics that do not need a learned target (seconds)."""

from __future__ import annotations

from pathlib import Path

import torch

from fledge.models.mtp import MTPModule, checkpoint_tensors
from fledge.models.mtp_drafter import MtpDrafter, MtpSpec
from fledge.testbed import tiny_families, tiny_writer

SEED = 0


def save_random_mtp_target(out: Path, layers: int = 8) -> Path:
    """An untrained ``mla_mtp``-shaped target with ``layers`` decoder layers and its MTP layer at index ``layers``
    (norm weights drawn around 1, so that the pre-norm and post-norm states differ), fp32, with the tiny tokenizer."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_writer.build_tokenizer())
    shape = {k: v for k, v in tiny_families.SHAPES["mla"].items() if k != "model_type"}
    shape.update(num_hidden_layers=layers, num_nextn_predict_layers=1, bos_token_id=tok.bos_token_id,
                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**shape))
    mtp = MTPModule(model.config, model.model.embed_tokens, model.lm_head)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    weights = Path(out) / "model.safetensors"
    tensors = {**load_file(weights), **{n: t.contiguous() for n, t in checkpoint_tensors(mtp).items()}}
    save_file(tensors, weights, metadata={"format": "pt"})
    return Path(out)


def target_config(target: Path) -> dict:
    import json

    return json.loads((Path(target) / "config.json").read_text())


def mtp_target_config(layers: int = 4) -> dict:
    """The config.json of an ``mla_mtp``-shaped target of ``layers`` layers (no files: for specs and exports)."""
    from transformers import DeepseekV3Config

    shape = {k: v for k, v in tiny_families.SHAPES["mla"].items() if k != "model_type"}
    return DeepseekV3Config(**{**shape, "num_hidden_layers": layers, "num_nextn_predict_layers": 1},
                            architectures=["DeepseekV3ForCausalLM"]).to_dict()


def random_mtp_drafter(target: Path | dict, norm_output: bool = True, attention: str = "sdpa") -> MtpDrafter:
    """An MTP drafter of ``target``'s config (a directory or the config itself) with random weights (norms around 1),
    the target's tables random too."""
    config = target if isinstance(target, dict) else target_config(target)
    spec = MtpSpec.from_target_config(config, {"algorithm": "mtp", "norm_output": norm_output})
    torch.manual_seed(SEED + 1)
    drafter = MtpDrafter(spec, attention=attention)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.normal_(1.0, 0.2) if name.endswith("norm.weight") else p.normal_(0.0, 0.05)
    return drafter


def mtp_export(out: Path, layers: int = 4) -> Path:
    """A random MTP drafter's checkpoint and export under ``out`` (``out/ckpt``, ``out/out``); returns the export."""
    from fledge.models.drafter_checkpoint import DrafterCheckpoint
    from fledge.serving.export import export_checkpoint

    config = mtp_target_config(layers)
    drafter = random_mtp_drafter(config)
    ckpt = DrafterCheckpoint(drafter.spec, target={"name_or_path": "org/target"})
    export_checkpoint(ckpt.write(Path(out) / "ckpt", drafter.state_dict()), Path(out) / "out", config)
    return Path(out) / "out"
