"""The tiny targets' data, tokenizer, build and checks, on testbed/tiny_tasks.py's chat language.

Under the testbed's root (testbed/tiny_target.py, ``fledge tiny-target``):
    data/train.jsonl           drafter training conversations: the target's mix (tiny_tasks.mixed), default layout only
    data/eval.jsonl            held-out conversations, default layout (the default set)
    data/eval_perturbed.jsonl  held-out conversations under another layout and system prompt (the target saw
                               them in training, a drafter trained on data/train.jsonl did not)
    data/long_eval.jsonl       table questions over 24-40 rows (200-400 tokens: inside the 512-token training windows)
    tokenizer/                 byte-level BPE (2,560 tokens) with the multi-layout chat template
    llama/, moe/, mla/,        the targets (testbed/tiny_families.py has the MoE and MLA shapes; mla_mtp is mla with
    mla_mtp/                   DeepSeek-V3's MTP module, testbed/tiny_mtp.py) + metrics.json (per set: greedy
                               distinct-3, the share of non-degenerate prompts, prompt dependence (distinct
                               outputs, pairs sharing one); held-out loss / top-1)
Each target is trained on answer tokens only (the prompts are random draws), in 512-token windows.
What they can show: acceptance on output that depends on the prompt and does not loop, and a drafter's drift
under a template it was not trained on. What they cannot: natural language or code; a 5 ms target forward makes
wall-clock speed-ups on CPU a measure of the harness as much as of the drafter.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from fledge.atomic import read_json, write_json_atomic
from fledge.models.precision import describe_cpu
from fledge.testbed import tiny_families, tiny_mtp, tiny_target as tt, tiny_tasks

VERSION = 3
MODEL = dict(vocab_size=2560, hidden_size=128, intermediate_size=384, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
             tie_word_embeddings=False)
# 512-token windows hold the long set's tables (LONG_EVAL_ROWS) and the main job's long prompts; the loss is
# on answer tokens only (prompts are random draws: their loss is noise the answers need not learn).
BUDGET = dict(steps=600, seq_len=512, batch_size=4, lr=3e-3, warmup=40)
LONG_EVAL_ROWS = (24, 40)
N_TRAIN, N_EVAL, N_LONG = 2000, 100, 16
N_PROMPTS, GEN_TOKENS = 16, 96  # greedy continuations scored per set
SETS = ("eval", "eval_perturbed", "long_eval")
DEGENERATE_BELOW = 0.5  # distinct-3 under this marks a prompt's greedy output degenerate


# Per target: what fits beside the suite in CI (built at the lowest priority while it runs; an MLA step of 4 x 512
# costs ~2.7x a Llama one here, a MoE step ~1.1x; MLA at 300 x 2 x 512 looped: 25-44% of prompts non-degenerate).
FAMILY_BUDGETS = {"llama": BUDGET, "moe": dict(BUDGET, steps=300), "mla": dict(BUDGET, steps=300),
                  "mla_mtp": dict(BUDGET, steps=300)}


def _dir(root: Path | None) -> Path:
    return Path(root or tt.default_root())


def build_data(root: Path | None = None) -> Path:
    out = _dir(root) / "data"
    key = tt._key(kind="writer_data", version=VERSION, n=[N_TRAIN, N_EVAL, N_LONG], template=tiny_tasks.CHAT_TEMPLATE,
                  rows=LONG_EVAL_ROWS, mix=[tiny_tasks.LONG_SHARE, tiny_tasks.CONTEXT_SHARE, tiny_tasks.LONG_ROWS,
                                            tiny_tasks.CONTEXT_PIECES])

    def build(tmp: Path) -> dict:
        rng = random.Random(tt.SEED + 11)  # apart from the target's stream (seed + 1)
        alt = [lay for lay in tiny_tasks.LAYOUTS if lay != tiny_tasks.DEFAULT_LAYOUT]
        rows = {"train": [tiny_tasks.mixed(rng, tiny_tasks.DEFAULT_LAYOUT) for _ in range(N_TRAIN)],
                "eval": [tiny_tasks.conversation(rng, tiny_tasks.DEFAULT_LAYOUT) for _ in range(N_EVAL)],
                "eval_perturbed": [tiny_tasks.conversation(rng, rng.choice(alt), system=True) for _ in range(N_EVAL)],
                "long_eval": [tiny_tasks.long_conversation(rng, rng.randint(*LONG_EVAL_ROWS)) for _ in range(N_LONG)]}
        for name, convs in rows.items():
            (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in convs))
        return {name: len(convs) for name, convs in rows.items()}

    return tt._cached(out, key, build)


def build_tokenizer(root: Path | None = None) -> Path:
    out = _dir(root) / "tokenizer"
    key = tt._key(kind="writer_tokenizer", version=VERSION, vocab=MODEL["vocab_size"],
                  template=tiny_tasks.CHAT_TEMPLATE)

    def build(tmp: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=MODEL["vocab_size"], special_tokens=tiny_tasks.SPECIAL_TOKENS,
                                      show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(tiny_tasks.tokenizer_texts(tt.SEED + 5), trainer)
        t = tiny_tasks
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=t.BOS, eos_token=t.END, pad_token=t.PAD,
                                chat_template=t.CHAT_TEMPLATE, model_max_length=4096).save_pretrained(tmp)

    return tt._cached(out, key, build)


def _render(tok, conv: dict, prompt_only: bool) -> list[int]:
    msgs = conv["messages"][:-1] if prompt_only else conv["messages"]
    text = tok.apply_chat_template(msgs, add_generation_prompt=prompt_only, tokenize=False,
                                   **(conv.get("template_kwargs") or {}))
    return tok(text, add_special_tokens=False)["input_ids"]


def _batches(tok, stream, seq_len: int, batch_size: int):
    """(ids ``[batch, seq_len + 1]``, answer mask ``[batch, seq_len]``) of conversations packed end to end; the
    mask marks the targets inside assistant turns (their ``<|end|>`` included)."""
    ids: list[int] = []
    mask: list[int] = []
    rows: list[tuple[list[int], list[int]]] = []
    while True:
        for c in [next(stream) for _ in range(64)]:
            enc = tok.apply_chat_template(c["messages"], return_dict=True, return_assistant_tokens_mask=True,
                                          **(c.get("template_kwargs") or {}))
            ids += enc["input_ids"]
            mask += enc["assistant_masks"]
        while len(ids) > seq_len:
            rows.append((ids[: seq_len + 1], mask[1: seq_len + 1]))
            del ids[: seq_len + 1], mask[: seq_len + 1]
            if len(rows) == batch_size:
                yield torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])
                rows = []


def _distinct3(ids: list[int]) -> float:
    grams = list(zip(ids, ids[1:], ids[2:]))
    return len(set(grams)) / max(1, len(grams))


def prompts(tok, data_dir: Path, name: str, n: int = N_PROMPTS) -> list[tuple[list[int], str]]:
    """The first ``n`` (prompt ids, reference answer) of eval set ``name``."""
    rows = [json.loads(line) for line in (data_dir / f"{name}.jsonl").read_text().splitlines()][:n]
    return [(_render(tok, c, True), c["messages"][-1]["content"]) for c in rows]


def _pairs_sharing(texts: list[str]) -> float:
    """The share of prompt pairs whose continuations are equal (0: every prompt writes its own)."""
    pairs = len(texts) * (len(texts) - 1) / 2
    return sum(texts[i] == texts[j] for i in range(len(texts)) for j in range(i)) / max(1, pairs)


@torch.no_grad()
def greedy_stats(model, tok, prompt_ids: list[list[int]], answers: list[str], max_new_tokens: int = GEN_TOKENS) -> dict:
    """Greedy continuations of ``prompt_ids`` (to the end-of-turn token): mean distinct-3, the share of prompts
    >= DEGENERATE_BELOW, prompt dependence (distinct outputs, pairs sharing one), exact answers, samples."""
    ratios, texts = [], []
    for ids in prompt_ids:
        row = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(ids):].tolist()
        row = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
        ratios.append(_distinct3(row))
        texts.append(tok.decode(row, skip_special_tokens=True))
    return {"prompts": len(texts), "distinct3": sum(ratios) / len(ratios),
            "non_degenerate": sum(r >= DEGENERATE_BELOW for r in ratios) / len(ratios),
            "distinct_outputs": len(set(texts)) / len(texts), "pairs_sharing": _pairs_sharing(texts),
            "exact_answers": sum(t.strip() == a.strip() for t, a in zip(texts, answers)) / len(texts),
            "samples": texts[:3]}


@torch.no_grad()
def evaluate(path: Path, data_dir: Path, max_new_tokens: int = GEN_TOKENS, n_prompts: int = N_PROMPTS,
             n_heldout: int | None = None) -> dict:
    """Per set: greedy distinct-3 (mean, share of prompts >= DEGENERATE_BELOW), distinct continuations,
    exact answers; on the default set, held-out loss and top-1 on answer tokens (fp32 from the bf16 weights)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out: dict = {}
    convs = [json.loads(line) for line in (data_dir / "eval.jsonl").read_text().splitlines()][:n_heldout]
    nll, correct, count = 0.0, 0, 0
    for c in convs:
        enc = tok.apply_chat_template(c["messages"], return_dict=True, return_assistant_tokens_mask=True,
                                      return_tensors="pt", **c["template_kwargs"])
        logits = model(input_ids=enc["input_ids"]).logits[0, :-1]
        mask, target = enc["assistant_masks"][0, 1:].bool(), enc["input_ids"][0, 1:]
        nll += F.cross_entropy(logits[mask], target[mask], reduction="sum").item()
        correct += (logits[mask].argmax(-1) == target[mask]).sum().item()
        count += int(mask.sum())
    out.update(heldout_loss=nll / count, heldout_top1=correct / count, heldout_tokens=count, sets=list(SETS))
    for name in SETS:
        items = prompts(tok, data_dir, name, n_prompts)
        out[name] = greedy_stats(model, tok, [i for i, _ in items], [a for _, a in items], max_new_tokens)
    return out


def new_model(name: str, tok, seed: int = tt.SEED):
    """An untrained ``name`` target (llama: MODEL; moe, mla: testbed/tiny_families.py) with ``tok``'s ids (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if name != "llama":
        return tiny_families.new_model(name, tok)
    m = dict(MODEL)
    rope = {"rope_type": "default", "rope_theta": m.pop("rope_theta")}
    return LlamaForCausalLM(LlamaConfig(**m, rope_parameters=rope, bos_token_id=tok.bos_token_id,
                                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))


def save_random_target(out: Path, root: Path | None = None, seed: int = tt.SEED) -> Path:
    """Save an untrained Llama of the tiny target's shape with its tokenizer (seconds; for tests of mechanics
    that do not need a learned target)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_tokenizer(root))
    tt._save_model(new_model("llama", tok, seed), tok, Path(out))
    return Path(out)


def build_target(name: str = "llama", root: Path | None = None, steps: int | None = None,
                 device: str = "cpu") -> Path:
    """Build (once) the ``name`` target (llama, moe, mla, mla_mtp); returns its from_pretrained directory,
    ``<root>/<name>``."""
    from transformers import AutoTokenizer

    settings = dict(FAMILY_BUDGETS[name], **({"steps": steps} if steps else {}))
    data_dir, tok_dir = build_data(root), build_tokenizer(root)
    out = _dir(root) / name
    shape = MODEL if name == "llama" else tiny_families.shape(name)
    key = tt._key(kind="target", name=name, version=VERSION, budget=settings, model=shape, seed=tt.SEED,
                  data=read_json(data_dir / "build.json")["key"], tok=read_json(tok_dir / "build.json")["key"],
                  **({"mtp_loss": tiny_mtp.SCHEDULE} if name == "mla_mtp" else {}))

    def build(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(tok_dir)
        model = new_model(name, tok)
        mtp = name == "mla_mtp"  # trained with its MTP module (testbed/tiny_mtp.py)
        if mtp:
            model = tiny_mtp.TargetWithMTP(model)
        t0, c0 = time.time(), time.process_time()
        batches = _batches(tok, tiny_tasks.stream(tt.SEED + 1), settings["seq_len"], settings["batch_size"])
        model = tt.train_target(model, batches, **settings, device=device,
                                **({"loss_fn": tiny_mtp.TargetWithMTP.training_loss} if mtp else {}))
        train_s, train_cpu = time.time() - t0, time.process_time() - c0
        tt._save_model(model.target if mtp else model, tok, tmp)
        if mtp:
            tiny_mtp.add_mtp_tensors(tmp, model.mtp)
        metrics = evaluate(tmp, data_dir)
        metrics.update(tiny_mtp.mtp_heldout(tmp, data_dir) if mtp else {})
        metrics.update(target=name, **settings, train_seconds=round(train_s, 1),
                       train_cpu_seconds=round(train_cpu, 1), torch_threads=torch.get_num_threads(),
                       compute_dtype="float32", cpu=describe_cpu(),
                       train_device=device if device == "cpu" else torch.cuda.get_device_name(),
                       parameters=sum(p.numel() for p in model.parameters()))
        write_json_atomic(tmp / "metrics.json", metrics)

    return tt._cached(out, key, build)
