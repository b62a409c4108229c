"""Chat conversations and a byte-level BPE tokenizer built from the Python standard library's source.

The tiny recipe needs a target that has learned something real, on text that ships with every Python
install. Files are listed sorted from ``sysconfig``'s stdlib directory, so the same Python 3.11 yields the
same corpus everywhere. Modules are split by a hash of their path: held-out modules only ever appear in
eval conversations (cut from the middle of files), so eval prompts are natural code, not file headers.

The same generator feeds both the target's own training (rendered with its chat template, so the
template's scaffolding is in its distribution) and the recipe's train / eval jsonl files.
"""

from __future__ import annotations

import hashlib
import random
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Roughly 3 characters per token for code under a 4096-token BPE: 1100 chars ~ 350-400 tokens.
MAX_ANSWER_CHARS = 1100
MAX_SNIPPET_CHARS = 500
EVAL_PERCENT = 8  # share of modules held out for eval

# Folders / files that are data tables, generated blobs or tests rather than ordinary source.
_SKIP_PARTS = {"site-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "encodings",
               "pydoc_data", "__pycache__", "turtledemo"}
_SKIP_PREFIXES = ("_sysconfigdata", "config-3", "this.py")

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PAD, BOS, END = "<|pad|>", "<|bos|>", "<|end|>"

# Assistant content and the end-of-turn token sit inside {% generation %} so that
# apply_chat_template(return_assistant_tokens_mask=True) marks exactly the tokens a drafter learns.
# Content sits directly between special tokens (no newline after the role token): BPE cannot merge
# across a special token, so the mask's token boundary equals the content's character boundary.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}\n"
    "{% elif message['role'] in ['system', 'user'] %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SYSTEM_PROMPTS = [
    "You are a helpful coding assistant.",
    "You answer with Python source code only.",
    "You are an expert on the Python standard library. Quote source exactly.",
    "Reply with code, no commentary.",
]
_ASK_FILE = [
    "Show me the source of `{mod}`.",
    "Print the beginning of {path}.",
    "What does the top of the `{mod}` module look like?",
    "Can you paste the start of {path} from the standard library?",
]
_ASK_AT = [
    "Show me {path} from line {line}.",
    "Print lines {line}-{end} of {path}.",
    "What does {path} look like around line {line}?",
    "Give me the code of `{mod}` starting at line {line}.",
]
_ASK_DEF = [
    "How is `{name}` implemented in `{mod}`?",
    "Show me the definition of `{name}` in {path}.",
    "Paste the source of {mod}.{name}.",
]
_ASK_CONTINUE = [
    "continue this code:\n{snippet}",
    "Continue this code:\n\n{snippet}",
    "What comes next?\n{snippet}",
    "Finish this Python snippet:\n{snippet}",
]
_ASK_MORE = ["Continue.", "go on", "And what comes after that?", "Show me the next part."]


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib dir, '/'-separated
    module: str
    lines: tuple[str, ...]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path | None = None) -> list[SourceFile]:
    """The stdlib's ordinary .py files (sorted; tests, codec tables and generated data left out)."""
    root = root or stdlib_dir()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if (_SKIP_PARTS & set(rel.parts[:-1]) or rel.name.startswith(_SKIP_PREFIXES)
                or rel.parts[0].startswith(_SKIP_PREFIXES)):
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        lines = tuple(line.rstrip() for line in text.splitlines())
        if len(lines) < 30:
            continue
        mod = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        out.append(SourceFile(rel.as_posix(), mod, lines))
    return out


def is_eval_module(path: str) -> bool:
    return int(hashlib.sha256(path.encode()).hexdigest(), 16) % 100 < EVAL_PERCENT


def split_sources(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, eval) by module: a module is entirely in one or the other."""
    train = [f for f in files if not is_eval_module(f.path)]
    held = [f for f in files if is_eval_module(f.path)]
    return train, held


def _take(lines: tuple[str, ...], start: int, max_chars: int) -> tuple[str, int]:
    """Whole lines from ``start`` up to ``max_chars``; returns (text, next line index)."""
    out, size, i = [], 0, start
    while i < len(lines) and (size + len(lines[i]) + 1 <= max_chars or not out):
        out.append(lines[i][:max_chars])
        size += len(out[-1]) + 1
        i += 1
    return "\n".join(out).strip("\n"), i


def _middle_start(rng: random.Random, f: SourceFile) -> int:
    n = len(f.lines)
    i = rng.randrange(n // 5, max(n // 5 + 1, 4 * n // 5))
    # Start on a non-blank line so the snippet does not open with empty space.
    while i < n - 1 and not f.lines[i].strip():
        i += 1
    return i


def continuation(rng: random.Random, f: SourceFile) -> list[dict]:
    """User: a snippet cut from the middle of a file; assistant: what follows it."""
    start = _middle_start(rng, f)
    snippet, nxt = _take(f.lines, start, rng.randint(150, MAX_SNIPPET_CHARS))
    answer, _ = _take(f.lines, nxt, MAX_ANSWER_CHARS)
    return [{"role": "user", "content": rng.choice(_ASK_CONTINUE).format(snippet=snippet)},
            {"role": "assistant", "content": answer or "pass"}]


def conversation(rng: random.Random, files: list[SourceFile]) -> dict:
    """One training conversation of a random kind, optionally with a system turn or a second turn."""
    f = rng.choice(files)
    kind = rng.random()
    if kind < 0.3:
        msgs = continuation(rng, f)
        start, nxt = None, None
    else:
        if kind < 0.45:
            start, ask = 0, rng.choice(_ASK_FILE)
        elif kind < 0.7:
            defs = [i for i, line in enumerate(f.lines) if line.lstrip().startswith(("def ", "class "))]
            start = rng.choice(defs) if defs else 0
            ask = rng.choice(_ASK_DEF) if defs else rng.choice(_ASK_FILE)
        else:
            start, ask = _middle_start(rng, f), rng.choice(_ASK_AT)
        answer, nxt = _take(f.lines, start, MAX_ANSWER_CHARS if rng.random() < 0.7 else MAX_ANSWER_CHARS // 2)
        named = re.match(r"\s*(?:def|class)\s+(\w+)", f.lines[start])
        name = named.group(1) if named else f.module
        user = ask.format(mod=f.module, path=f.path, line=start + 1, end=nxt, name=name)
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    if nxt is not None and nxt < len(f.lines) and rng.random() < 0.25:
        more, _ = _take(f.lines, nxt, MAX_ANSWER_CHARS // 2)
        msgs += [{"role": "user", "content": rng.choice(_ASK_MORE)}, {"role": "assistant", "content": more}]
    if rng.random() < 0.35:
        msgs.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return {"messages": msgs}


def conversation_stream(files: list[SourceFile], seed: int) -> Iterator[dict]:
    """An endless, seeded stream of training conversations over ``files``."""
    rng = random.Random(seed)
    while True:
        yield conversation(rng, files)


def eval_conversations(files: list[SourceFile], n: int, seed: int) -> list[dict]:
    """``n`` continuation conversations over held-out ``files``, spread round-robin over modules."""
    rng = random.Random(seed)
    big = [f for f in files if len(f.lines) >= 60]
    return [{"messages": continuation(rng, big[i % len(big)])} for i in range(n)]


def tokenizer_texts(files: list[SourceFile], max_chars_per_file: int = 6000) -> Iterator[str]:
    """Text for BPE training: the head of each train file (bounded so training takes seconds) plus the
    prompt phrasings, so English request words get merges too."""
    for f in files:
        yield "\n".join(f.lines)[:max_chars_per_file]
    for _ in range(20):
        yield "\n".join(SYSTEM_PROMPTS + _ASK_FILE + _ASK_AT + _ASK_DEF + _ASK_CONTINUE + _ASK_MORE)


def train_tokenizer(files: list[SourceFile], vocab_size: int = 4096):
    """A byte-level BPE over ``files`` wrapped as a PreTrainedTokenizerFast with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(tokenizer_texts(files), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=END, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE, model_max_length=2048)
