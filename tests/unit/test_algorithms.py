"""A drafter algorithm is one module per layer (models/algorithms.py): a fourth algorithm, its three modules written
here and registered from here alone, is built, trained a step, checkpointed, exported, read back and served by the
pipeline's own functions; and no module compares an algorithm's name outside that algorithm's own modules.
(tests/unit/serving/test_dflash_layout.py::test_every_algorithm_has_its_entry_in_each_layer holds the registered
ones equal across the layers.)"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fledge.conf import compose
from fledge.models.algorithms import ALGORITHMS, Algorithm, DrafterSpec, build_drafter
from fledge.models.drafter_checkpoint import DrafterCheckpoint
from fledge.models.weights import read_tensors
from fledge.pipeline.stages import train_inputs
from fledge.run_layout import RunLayout
from fledge.serving.engine import speculative_config
from fledge.serving.export import export_checkpoint, load_drafter, load_target_config, spec_from_export
from fledge.serving.layouts import LAYOUTS
from fledge.train.losses import TTTResult
from fledge.train.objectives import OBJECTIVES, Trainable
from fledge.train.ttt_model import build_ttt_model
from tests.helpers.models import packed_batch
from tests.helpers.paths import REPO

# ---- the toy algorithm's models module: its spec class, drafter and registry entry ---------------------------------


@dataclass
class ToySpec(DrafterSpec):
    """One linear map from the aux states to the target's whole vocab, its logits scaled by ``scale``."""

    algorithm: ClassVar[str] = "toy"

    scale: float = 1.0

    @classmethod
    def config_fields(cls, drafter: Any, hf_config: Any, vocab_size: int) -> dict[str, Any]:
        return {"draft_vocab_size": vocab_size, "scale": 2.0}


class ToyDrafter(nn.Module):
    def __init__(self, spec: ToySpec) -> None:
        super().__init__()
        self.spec = spec
        self.proj = nn.Linear(spec.fc_in_features, spec.vocab_size, bias=False)

    def forward(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        return self.spec.scale * self.proj(aux_hidden)


TOY = Algorithm("toy", ToySpec, lambda spec, attention="auto", norm_impl="torch": ToyDrafter(spec),
                vllm_method="toy", block=True)

# ---- its train module: the drafter built for training and its objective over the shared feature batch --------------


class ToyObjective:
    """Cross-entropy against the target's argmax at every trained position (train/objectives/base.py ``Objective``)."""

    def __call__(self, drafter, batch, teacher_head, shard=None, denominators=None) -> TTTResult:
        rows = batch.loss_mask & (batch.document_ids >= 0)
        return TTTResult(loss=F.cross_entropy(drafter(batch.aux_hidden)[rows], batch.target_argmax[rows]), metrics={})

    def counted_rows(self, drafter, batch, shard=None) -> torch.Tensor:
        return (batch.loss_mask & (batch.document_ids >= 0)).sum().reshape(1)


def build_toy(inputs, hf_config, loss, vocab_path) -> Trainable:
    spec = DrafterSpec.from_target_config(hf_config, inputs.drafter, list(inputs.aux_layer_ids))
    return Trainable(build_drafter(spec), torch.zeros(0), ToyObjective())


# ---- its serving module: the layout serving/layouts.py finds for its specs and exports -----------------------------


class ToyLayout:
    def owns(self, config) -> bool:
        return config.get("architectures") == ["ToyDrafter"]

    def build_config(self, layer, spec, aux_layer_ids, target_hidden_size, target_num_layers) -> dict:
        return {"architectures": ["ToyDrafter"], "vocab_size": spec.vocab_size, "aux_layer_ids": aux_layer_ids,
                "target_hidden_size": target_hidden_size, "scale": spec.scale}

    def serving_tensors(self, state_dict):
        return {name: t.to(torch.bfloat16) for name, t in state_dict.items()}

    def load(self, d, spec, embed_weight, head_weight, target, dtype) -> nn.Module:
        model = build_drafter(spec)
        model.load_state_dict({name: t.to(dtype) for name, t in read_tensors(d).items()})
        return model

    def speculative_config(self, config, model, k) -> dict:
        return {"method": "toy", "model": model, "num_speculative_tokens": k}


@contextlib.contextmanager
def toy_registered():
    with ALGORITHMS.temporary("toy", TOY), OBJECTIVES.temporary("toy", build_toy), \
            LAYOUTS.temporary("toy", ToyLayout()):
        yield


def test_a_fourth_algorithm_is_one_module_per_layer(random_tiny_target, tmp_path):
    cfg = compose(["recipe=tiny", f"target.name_or_path={random_tiny_target}"])
    inputs = train_inputs(cfg)  # the schema accepts the shipped names: the toy one is set past it
    inputs = dataclasses.replace(inputs, drafter=dataclasses.replace(inputs.drafter, algorithm="toy"))
    Ht = json.loads((Path(random_tiny_target) / "config.json").read_text())["hidden_size"]
    with toy_registered():
        model = build_ttt_model(inputs, RunLayout(tmp_path).prepare.vocab, torch.device("cpu"))  # train's entry
        spec = model.drafter.spec
        assert isinstance(model.drafter, ToyDrafter) and isinstance(spec, ToySpec) and spec.scale == 2.0
        batch = packed_batch(H=Ht)
        trained = batch.loss_mask & (batch.document_ids >= 0)
        assert model.step_denominators([batch], 1.0).tolist() == [float(trained.sum())]  # the trainer's row count
        model(batch).loss.backward()
        assert model.drafter.proj.weight.grad.abs().sum() > 0

        ckpt = DrafterCheckpoint(spec, step=1).write(tmp_path / "ckpt", model.drafter.state_dict())
        assert DrafterCheckpoint.read(ckpt).spec == spec  # the flat JSON, read back to its class
        config = export_checkpoint(ckpt, tmp_path / "out", load_target_config(cfg.target))
        assert config["architectures"] == ["ToyDrafter"] and config["scale"] == 2.0
        assert spec_from_export(tmp_path / "out") == spec
        loaded = load_drafter(tmp_path / "out")
        assert isinstance(loaded, ToyDrafter)
        assert torch.equal(loaded.proj.weight, model.drafter.proj.weight.detach().bfloat16().float())
        served = speculative_config("toy", 3, tmp_path / "out")  # the eval stage's request
        assert served == {"method": "toy", "model": str((tmp_path / "out").resolve()), "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="drafter.algorithm='toy'"):  # gone with its registration
        DrafterSpec.from_dict(spec.to_dict())


# An algorithm's name compared (==, !=, in) outside its own modules: modules whose file name carries the name are its.
_LIBRARY = ("fledge", "conf", "data", "models", "train", "evaluation", "serving", "pipeline", "testbed")
_EXCEPT = {
    "conf/config_rules.py": "the config's own rules for the drafter.algorithm values it accepts "
                            "(it cannot import models)",
    "serving/dialects.py": "speculators' own model type peagle, a value of its format",
}


def test_no_module_compares_an_algorithm_name_outside_its_own():
    names = sorted({*ALGORITHMS.names(), *(a.spec.algorithm for a in ALGORITHMS.values())})
    alt = "|".join(names)
    compared = re.compile(rf"""(==|!=)\s*["']({alt})["']|["']({alt})["']\s*(==|!=)"""
                          rf"""|\bin\s*[(\[{{][^)\]}}]*["']({alt})""")
    offenders = []
    for top in _LIBRARY:
        for path in sorted((REPO / top).rglob("*.py")):
            where = str(path.relative_to(REPO))
            for i, line in enumerate(path.read_text().splitlines(), 1):
                hit = compared.search(line)
                name = hit and next(g for g in hit.groups() if g in names)
                if hit and where not in _EXCEPT and name not in path.stem:
                    offenders.append(f"{where}:{i}: {line.strip()}")
    assert not offenders, "ask the algorithm's registry entry (models/algorithms.py) instead:\n" + "\n".join(offenders)
