"""drafter.init_from: fine-tuning a drafter checkpoint on a run whose draft vocab differs from its own.

The run's vocab maps must survive the load (the teacher head and the loss use them), the loaded lm_head
rows must follow their target ids to their new draft ids, and a drafter built for other aux ids, norm
flags or another target must be refused, not loaded into the wrong places. The trainer reads drafter
checkpoints only (models/drafter_checkpoint.py): an export for serving is refused in one line naming the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fledge.conf import compose
from fledge.data.prepare.vocab import DraftVocab
from fledge.pipeline.stages import train_inputs
from fledge.run_layout import RunLayout
from fledge.serving.export import export_checkpoint, load_target_config
from fledge.train.checkpoint import drafter_checkpoint
from fledge.train.ttt_model import TTTModel, build_ttt_model

VD = 64


def _overrides(target: Path, vd: int = VD, *extra: str) -> list[str]:
    return ["recipe=tiny", f"target.name_or_path={target}", f"drafter.draft_vocab_size={vd}", *extra]


def _build(overrides: list[str], run: Path) -> TTTModel:
    return build_ttt_model(train_inputs(compose(overrides)), RunLayout(run).prepare.vocab, torch.device("cpu"))


def _vocab(run: Path, counts: torch.Tensor, vd: int) -> DraftVocab:
    vocab = DraftVocab.build(counts, vd)
    vocab.save(RunLayout(run).prepare.vocab)
    return vocab


@pytest.fixture(scope="module")
def exported(random_tiny_target, tmp_path_factory):
    """A drafter trained (here: randomised) on vocab A: its checkpoint, and its export in the serving layout."""
    root = tmp_path_factory.mktemp("init_from")
    V = json.loads((Path(random_tiny_target) / "config.json").read_text())["vocab_size"]
    counts = torch.randint(1, 1000, (V,), generator=torch.Generator().manual_seed(0))
    vocab = _vocab(root / "a", counts, VD)
    cfg = compose(_overrides(random_tiny_target))
    model = _build(_overrides(random_tiny_target), root / "a")
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.drafter.parameters():
            if p.requires_grad:
                p.normal_(0, 0.5)  # unlike any initial value, so every carried tensor is recognisable
    ckpt = drafter_checkpoint(train_inputs(cfg), model.drafter.spec).at_step(10).write(root / "ckpt",
                                                                                         model.drafter.state_dict())
    export_checkpoint(ckpt, root / "export", load_target_config(cfg.target))
    return root, counts, vocab, model.drafter


def _other_vocab(counts: torch.Tensor, vocab: DraftVocab, vd: int, swap: int = 8) -> torch.Tensor:
    """Counts whose top ``vd`` share all but ``swap`` of ``vocab``'s ids: drop its 8 rarest, boost 8 others."""
    counts = counts.clone()
    sel = vocab.selected
    counts[sel[torch.argsort(counts[sel])[:swap]]] = 0
    outside = torch.nonzero(~vocab.t2d).flatten()[:swap]
    counts[outside] = 10_000
    return counts


@pytest.mark.parametrize("vd", [VD, 96])
def test_fine_tuning_keeps_the_runs_vocab_and_moves_the_rows(random_tiny_target, exported, tmp_path, vd):
    root, counts, old_vocab, old = exported
    new_vocab = _vocab(tmp_path, _other_vocab(counts, old_vocab, vd), vd)
    assert not torch.equal(new_vocab.t2d, old_vocab.t2d)
    model = _build(_overrides(random_tiny_target, vd, f"drafter.init_from={root / 'ckpt'}"), tmp_path)
    d = model.drafter
    # The old code loaded the export's d2t/t2d over the run's: the teacher head (new vocab) and the
    # drafter's own map disagreed from the first step.
    assert torch.equal(d.d2t, new_vocab.d2t) and torch.equal(d.t2d, new_vocab.t2d)
    old_index = {int(t): i for i, t in enumerate(old_vocab.selected)}
    carried = fresh = 0
    for i, t in enumerate(new_vocab.selected.tolist()):
        if t in old_index:
            torch.testing.assert_close(d.lm_head.weight[i], old.lm_head.weight[old_index[t]], rtol=0, atol=0)
            carried += 1
        else:  # a token the old drafter never drafted starts from the target's own row, like a fresh drafter
            torch.testing.assert_close(d.lm_head.weight[i], model.teacher_head[i], rtol=0, atol=0)
            fresh += 1
    assert carried == VD - 8 and fresh == vd - carried
    torch.testing.assert_close(d.fc.weight, old.fc.weight, rtol=0, atol=0)
    torch.testing.assert_close(d.midlayer.self_attn.q_proj.weight, old.midlayer.self_attn.q_proj.weight, rtol=0, atol=0)


@pytest.mark.parametrize("override, key", [
    ("drafter.norm_output=false", "drafter.norm_output"),
    ("drafter.aux_layer_ids=[2,3,5]", "drafter.aux_layer_ids"),
])
def test_a_drafter_of_another_layout_is_refused_naming_the_key(random_tiny_target, exported, tmp_path, override, key):
    root, counts, _, _ = exported
    _vocab(tmp_path, counts, VD)
    with pytest.raises(ValueError, match=rf"init_from=.* has {key}=.* but this run has {key}="):
        _build(_overrides(random_tiny_target, VD, f"drafter.init_from={root / 'ckpt'}", override), tmp_path)


def test_an_export_or_a_missing_directory_is_refused_in_one_line_naming_the_fix(random_tiny_target, exported,
                                                                               tmp_path):
    """The trainer does not read serving formats: an export names the checkpoint it was exported from."""
    root, counts, _, _ = exported
    _vocab(tmp_path, counts, VD)
    with pytest.raises(ValueError) as e:
        _build(_overrides(random_tiny_target, VD, f"drafter.init_from={root / 'export'}"), tmp_path)
    assert len(str(e.value).splitlines()) == 1 and "an exported (serving) drafter directory" in str(e.value)
    assert "set drafter.init_from to the run's train/best" in str(e.value)
    with pytest.raises(ValueError, match=r"drafter.init_from=.*nowhere: .*not a Fledge drafter checkpoint"):
        _build(_overrides(random_tiny_target, VD, f"drafter.init_from={tmp_path / 'nowhere'}"), tmp_path)


def test_p_eagle_starts_from_a_chain_drafter_and_refuses_one_of_another_mask_token(random_tiny_target, exported,
                                                                                    tmp_path):
    """drafter=p_eagle from the EAGLE-3.1 checkpoint: its layers carry over and it keeps its own mask_hidden (the
    chain drafter has none); from a P-EAGLE checkpoint whose slots were trained on another mask token: refused."""
    root, counts, _, old = exported
    _vocab(tmp_path, counts, VD)
    p_eagle = ["drafter=p_eagle", "drafter.mask_token_id=1"]
    cfg = compose(_overrides(random_tiny_target, VD, f"drafter.init_from={root / 'ckpt'}", *p_eagle))
    d = _build(_overrides(random_tiny_target, VD, f"drafter.init_from={root / 'ckpt'}", *p_eagle), tmp_path).drafter
    torch.testing.assert_close(d.fc.weight, old.fc.weight, rtol=0, atol=0)
    assert d.spec.parallel_drafting and d.mask_hidden.shape == (1, d.spec.fc_in_features)
    drafter_checkpoint(train_inputs(cfg), d.spec).at_step(1).write(tmp_path / "ckpt", d.state_dict())
    with pytest.raises(ValueError, match="trained on mask token 1 but this run has drafter.mask_token_id=2"):
        _build(_overrides(random_tiny_target, VD, f"drafter.init_from={tmp_path / 'ckpt'}", "drafter=p_eagle",
                          "drafter.mask_token_id=2"), tmp_path)
