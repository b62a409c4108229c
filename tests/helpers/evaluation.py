"""The eval stage's test run: a random tiny target with its tokenizer, a random export of it, a prepared run
directory (tests/unit/evaluation/conftest.py makes it once per module), and the config the tests evaluate with."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i * i)\n",
         "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
         "import os\npath = os.path.join('a', 'b')\n", "while True:\n    break\n"]


def conversations(n):
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Continue this code:\n{TEXTS[i % 5]}"},
                {"role": "assistant", "content": TEXTS[(i + 1) % 5] * 2}]
        out.append({"messages": msgs, "source": "t", "index": i})
    return out


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from fledge.testbed.tiny_tasks import BOS, CHAT_TEMPLATE, END, PAD, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=END, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE, model_max_length=512)


def make_eval_run(root: Path) -> Path:
    """A random tiny target with its tokenizer, a random export of it and a prepared run dir (under ``root``)
    for the eval stage's tests: returns ``root``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fledge.models.drafter_checkpoint import DrafterCheckpoint
    from fledge.models.families import text_config_dict
    from fledge.serving.export import write_drafter
    from fledge.serving.serving_config import serving_config
    from tests.helpers.models import random_drafter

    tok = tokenizer()
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                                          max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    (root / "target").mkdir()
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    drafter = random_drafter(target, vd=200)
    spec = drafter.spec.to_dict()
    config = serving_config(text_config_dict(target.config), spec, spec["aux_layer_ids"], spec["draft_vocab_size"])
    write_drafter(root / "run/export/drafter", drafter.state_dict(), config, DrafterCheckpoint(drafter.spec))
    prep = root / "run/prepare"
    prep.mkdir(parents=True)
    convs = conversations(6)
    for name, cs in (("eval", convs), ("eval_perturbed", [{**c, "messages": [{"role": "system", "content": "Be brief."}]
                                                            + c["messages"]} for c in convs])):
        (prep / f"{name}_conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cs))
    (root / "run/train").mkdir()
    (root / "run/train/metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss_0": 3.0 / s, "loss_1": 3.5 / s, "acc_0": 0.1 * s, "acc_1": 0.05 * s,
                    "full_acc_0": 0.1 * s, "full_acc_1": 0.04 * s, "al_estimate": 1 + 0.14 * s}) + "\n"
        for s in range(1, 5)) + json.dumps({"step": 4, "eval/acc_0": 0.3, "eval/acc_1": 0.2}) + "\n")
    return root


def eval_cfg(run):
    from fledge.conf.schema import Config

    cfg = Config()
    cfg.target.name_or_path = str(run / "target")
    cfg.target.num_hidden_layers = 6
    cfg.drafter.aux_layer_ids = [2, 3, 4]
    cfg.drafter.ttt_steps = 2
    cfg.eval.num_prompts = 3
    cfg.eval.draft_tokens = 3
    cfg.eval.max_new_tokens = 12
    cfg.eval.long_prompt_tokens = 120
    cfg.eval.temperature = 0.8
    return cfg
