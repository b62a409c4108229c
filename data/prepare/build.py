"""The ``prepare`` stage: chat data -> tokenized conversations with assistant-only loss masks + draft vocab.

Output in the prepare stage's directory (fledge/run_layout.py ``PrepareDir``; built in its staging
directory and renamed into place, so a failure leaves nothing half-written under a final name):

* ``train/``, ``eval/``, ``eval_perturbed/`` (when perturbation is on): ``datasets`` Arrow datasets with
  ``input_ids`` (int32), ``loss_mask`` (int8 0/1), ``source`` (the source path as configured) and
  ``index`` (the row in that source);
* ``eval_conversations.jsonl`` / ``eval_perturbed_conversations.jsonl``: the eval rows' normalised
  conversations, one ``{"messages", "tools"?, "template_kwargs"?, "perturbation"?, "source", "index"}``
  per line (pass ``template_kwargs`` to the chat template when building prompts);
* ``vocab.safetensors`` + ``vocab.json``: the draft vocab (data/prepare/vocab.py), counted over ``train/``.

Sources are mixed by ``weight`` as a repeat factor (2.0 = every row twice, 0.5 = a seeded half). Without
``eval_sources`` a seeded ``eval_fraction`` of the rows is held out before weighting, so no eval row
leaks into training.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
from pathlib import Path

import numpy as np

from fledge.atomic import write_json_atomic
from fledge.conf.schema import DataConfig, SourceConfig, TargetConfig
from fledge.data.prepare.chat import ChatRenderer, describe, eot_ids_from_target
from fledge.data.prepare.perturb import chosen, perturb
from fledge.data.prepare.sources import DataError, iter_rows, normalize
from fledge.data.prepare.vocab import (
    DraftVocab,
    count_masked,
    load_cached,
    save_with_key,
    tokenizer_fingerprint,
    vocab_key,
)
from fledge.run_layout import PrepareDir

log = logging.getLogger(__name__)
SHOW_ERRORS = 5


class ErrorLog:
    """Bad rows under ``data.on_error``: raise at once (``error``) or count and keep the first few (``skip``)."""

    def __init__(self, policy: str):
        self.policy, self.count, self.first = policy, 0, []
        self.sources: dict[str, dict] = {}  # per source: rows read (and, for a cut .json list, the bytes left)

    def add(self, err: DataError) -> None:
        if self.policy == "error":
            raise ValueError(f"{err} (set data.on_error=skip to skip such rows)") from None
        self.count += 1
        if len(self.first) < SHOW_ERRORS:
            self.first.append(str(err))


def load_tokenizer(target: TargetConfig, chat_template: str | None = None):
    """The ``target``'s tokenizer, with ``chat_template`` (data.chat_template: a file or a string) when set."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target.name_or_path, revision=target.revision,
                                        trust_remote_code=target.trust_remote_code)
    if chat_template:
        p = Path(chat_template)
        tok.chat_template = p.read_text() if p.is_file() else chat_template
    return tok


def load_conversations(sources: list[SourceConfig], errors: ErrorLog, key: str = "data.sources") -> list[dict]:
    """Normalised conversations of ``sources`` in order, each tagged with ``source`` and ``index``. A source
    with no rows at all (an empty file, a wrong split) is an error naming it: a mix silently missing one
    of its sources trains a different drafter than the recipe says."""
    out = []
    for i, src in enumerate(sources):
        n_rows, notes = 0, {}
        for row in iter_rows(src.path, src.split, src.max_samples, notes):
            n_rows += 1
            try:
                if row.error:
                    raise DataError(row.where, row.error)
                conv = normalize(row.record, row.where)
            except DataError as e:
                errors.add(e)
                continue
            out.append({**conv, "source": src.path, "index": row.index, "where": row.where})
        errors.sources[src.path] = {"rows": n_rows, **notes}
        if n_rows == 0:
            raise ValueError(f"{src.path}: no rows (split {src.split!r}); an empty file or a wrong split? "
                             f"fix {key}[{i}] or remove it")
    return out


def split_and_mix(data: DataConfig, errors: ErrorLog, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, eval) conversations: eval from ``eval_sources`` or a seeded hold-out; train weighted."""
    train = load_conversations(data.sources, errors)
    if data.eval_sources:
        evals = load_conversations(data.eval_sources, errors, key="data.eval_sources")
    else:
        order = list(range(len(train)))
        random.Random(seed).shuffle(order)
        n_eval = min(len(train) - 1, max(1, round(data.eval_fraction * len(train)))) if data.eval_fraction else 0
        held = set(order[:n_eval])
        evals = [c for i, c in enumerate(train) if i in held]
        train = [c for i, c in enumerate(train) if i not in held]
    weights = {s.path: s.weight for s in data.sources}
    rng = random.Random(seed + 1)
    mixed = []
    for conv in train:
        w = weights[conv["source"]]
        copies = int(math.floor(w)) + (rng.random() < w - math.floor(w))
        mixed += [{**conv, "copy": k} for k in range(copies)]
    return mixed, evals


def _tokenize(row: dict, renderer: ChatRenderer, max_length: int, policy: str) -> dict:
    conv = json.loads(row["conversation"])
    try:
        ids, mask = renderer.encode(conv, row["where"])
    except DataError as e:
        return {"input_ids": [], "loss_mask": [], "status": "error", "problem": e.problem}
    status, problem = "ok", ""
    if len(ids) > max_length:
        if policy == "drop":
            return {"input_ids": [], "loss_mask": [], "status": "dropped", "problem": "longer than max_length"}
        ids, mask, status = ids[:max_length], mask[:max_length], "truncated"
    if not any(mask):
        return {"input_ids": [], "loss_mask": [], "status": "dropped",
                "problem": "no assistant token within max_length"}
    return {"input_ids": ids, "loss_mask": mask, "status": status, "problem": problem}


def tokenize_split(convs: list[dict], renderer: ChatRenderer, data: DataConfig, errors: ErrorLog, build: Path,
                   name: str):
    """Tokenize ``convs`` with ``data.num_proc`` processes; returns (dataset, kept conversations, counts)."""
    import datasets

    raw = datasets.Dataset.from_dict({
        "conversation": [json.dumps({k: c[k] for k in ("messages", "tools", "template_kwargs") if k in c})
                         for c in convs],
        "source": [c["source"] for c in convs], "index": [c["index"] for c in convs],
        "where": [c["where"] for c in convs]})
    raw_dir = build / f".raw_{name}"
    raw.save_to_disk(str(raw_dir))  # map's worker caches then live in the build dir
    raw = datasets.load_from_disk(str(raw_dir))
    features = datasets.Features({
        "conversation": datasets.Value("string"), "source": datasets.Value("string"),
        "index": datasets.Value("int64"), "where": datasets.Value("string"),
        "input_ids": datasets.List(datasets.Value("int32")), "loss_mask": datasets.List(datasets.Value("int8")),
        "status": datasets.Value("string"), "problem": datasets.Value("string")})
    done = raw.map(_tokenize, fn_kwargs={"renderer": renderer, "max_length": data.max_length,
                                         "policy": data.length_policy},
                   num_proc=data.num_proc if data.num_proc > 1 and len(raw) > 1 else None,
                   features=features, new_fingerprint=f"fledge-{name}", desc=f"prepare {name}")
    status = done["status"]
    counts = {s: status.count(s) for s in ("ok", "truncated", "dropped", "error")}
    for i in (i for i, s in enumerate(status) if s == "error"):
        errors.add(DataError(done[i]["where"], done[i]["problem"]))
    keep = [i for i, s in enumerate(status) if s in ("ok", "truncated")]
    out = done.select(keep).select_columns(["input_ids", "loss_mask", "source", "index"])
    return out, [convs[i] for i in keep], counts


def prepare(data: DataConfig, target: TargetConfig, draft_vocab_size: int, run_seed: int, out: PrepareDir) -> dict:
    """Build the prepare outputs (see the module docstring) of ``data`` for ``target`` in ``out``, with a
    draft vocab of ``draft_vocab_size`` ids; returns the summary. ``run_seed`` (run.seed) is added to
    ``data.seed``. One process does this (the pipeline runs it on rank 0)."""
    seed = data.seed + run_seed
    build = out.staging()
    shutil.rmtree(build.root, ignore_errors=True)
    build.root.mkdir(parents=True)
    try:
        summary = _build(data, target, draft_vocab_size, seed, out, build)
        for name in sorted(os.listdir(build.root)):
            if not name.startswith("."):
                dest = out.root / name
                shutil.rmtree(dest, ignore_errors=True) if dest.is_dir() else dest.unlink(missing_ok=True)
                os.replace(build.root / name, dest)
    finally:
        shutil.rmtree(build.root, ignore_errors=True)
    return summary


def _build(data: DataConfig, target: TargetConfig, draft_vocab_size: int, seed: int, out: PrepareDir,
           build: PrepareDir) -> dict:
    tok = load_tokenizer(target, data.chat_template)
    renderer = ChatRenderer(tok, data.last_turn_only, data.thinking_in_mask,
                            eot_ids_from_target(target.name_or_path, target.revision))
    errors = ErrorLog(data.on_error)
    train, evals = split_and_mix(data, errors, seed)
    if not train:
        raise ValueError(f"data.sources gave no usable training conversations ({errors.count} bad rows: "
                         f"{errors.first[:2]})")
    pert = data.perturb
    if pert.fraction > 0 or pert.eval_split:
        unused = [k for k in (["date_string"] if pert.vary_date else []) + sorted(pert.template_vars)
                  if k not in renderer.template]
        if unused:
            log.warning("data.perturb: the chat template never reads %s; varying it has no effect", unused)
    train = [perturb(c, pert, f"{c['source']}:{c['index']}:{c['copy']}")
             if chosen(pert, f"{c['source']}:{c['index']}:{c['copy']}") else c for c in train]
    splits = {"train": train, "eval": evals}
    if pert.eval_split and (pert.fraction > 0 or pert.system_prompts) and evals:
        splits["eval_perturbed"] = [perturb(c, pert, f"eval:{c['source']}:{c['index']}") for c in evals]
    counts, stats = {}, {}
    for name, convs in splits.items():
        if not convs:
            continue
        ds, kept, counts[name] = tokenize_split(convs, renderer, data, errors, build.root, name)
        ds.save_to_disk(str(build.split(name)))
        if name != "train":
            _write_jsonl(build.conversations(name), kept)
        lengths = np.fromiter((len(x) for x in ds["input_ids"]), dtype=np.int64, count=len(ds))
        stats[name] = {"conversations": len(ds), "tokens": int(lengths.sum())}
        if name == "train":
            V = max(target.vocab_size, len(tok))
            vc = np.zeros(V, dtype=np.int64)
            for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
                count_masked(ids, mask, V, vc)
            stats[name]["masked_tokens"] = int(vc.sum())
    vocab_meta = _draft_vocab(vc, draft_vocab_size, tok, out, build)
    tc = counts["train"]
    summary = {
        "kept": tc["ok"] + tc["truncated"], "truncated": tc["truncated"], "dropped": tc["dropped"],
        "skipped": errors.count, "tokens": stats["train"]["tokens"], "masked_tokens": stats["train"]["masked_tokens"],
        "draft_vocab_coverage": vocab_meta["coverage"], "splits": stats, "status_counts": counts,
        "errors_first": errors.first, "sources": errors.sources, **describe(renderer),
        "paths": {name: str(out.root / name) for name in sorted(os.listdir(build.root)) if not name.startswith(".")},
    }
    log.info("prepare: kept %d, truncated %d, dropped %d, skipped %d bad rows; %d tokens, %d masked; draft vocab "
             "%d covers %.2f%% of masked tokens", summary["kept"], summary["truncated"], summary["dropped"],
             summary["skipped"], summary["tokens"], summary["masked_tokens"], vocab_meta["draft_vocab_size"],
             100 * vocab_meta["coverage"])
    for e in errors.first:
        log.warning("prepare: skipped %s", e)
    write_json_atomic(build.summary, summary)
    return summary


def _draft_vocab(counts: np.ndarray, Vd: int, tok, out: PrepareDir, build: PrepareDir) -> dict:
    """Build (or reuse, when the key matches) the draft vocab of ``Vd`` ids over the training counts."""
    import hashlib

    if Vd > len(counts):
        raise ValueError(f"drafter.draft_vocab_size={Vd} exceeds the target's vocab ({len(counts)})")
    key = vocab_key(hashlib.sha256(counts.tobytes()).hexdigest(), tokenizer_fingerprint(tok), Vd)
    vocab = load_cached(out.vocab, out.vocab_meta, key)
    reused = vocab is not None
    if vocab is None:
        vocab = DraftVocab.build(counts, Vd)
    return save_with_key(vocab, build.vocab, build.vocab_meta, key, {"reused": reused})


def _write_jsonl(path: Path, convs: list[dict]) -> None:
    keys = ("messages", "tools", "template_kwargs", "perturbation", "source", "index")
    with open(path, "w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps({k: c[k] for k in keys if k in c}, ensure_ascii=False) + "\n")
