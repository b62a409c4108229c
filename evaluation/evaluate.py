"""The ``eval`` stage: measured acceptance of the exported drafter, honest baselines, drift, held-out accuracy.

For every prompt set (``eval.sets``: ``default``, ``perturbed`` = the data stage's perturbed templates,
``long`` = prompts grown with more held-out context, and the named public benchmarks of evaluation/eval_sets.py,
such as ``mt_bench`` or ``speed_bench_throughput_16k``; evaluation/prompt_sets.py builds them) it runs, on the
same prompts (evaluation/acceptance.py):

- plain greedy decoding of the target (the reference output and the baseline time);
- speculative decoding with the drafter (greedy: asserted identical to the reference, token for token;
  and with rejection sampling when ``eval.temperature > 0``);
- prompt lookup (n-gram copy from the context, same k): the drafter-free baseline that loops inflate.

It also reports the distinct-3-gram ratio of the target's outputs, the share of their tokens the draft
vocab holds (the drafter can propose no other), and AL restricted to prompts whose
output is not degenerate (ratio >= ``eval.degenerate_threshold``), the teacher-forced held-out per-step
accuracy up to 2K steps (natural text: loops cannot inflate it; evaluation/heldout.py), the attention-drift
curves (evaluation/drift.py) and, with ``eval.context_buckets``, AL vs context length (evaluation/long_context.py).
Outputs: the report (report.json, report.md) and PNG plots (evaluation/report.py), where the stage says.

With ``eval.in_process=false`` (a real target, whose harness is slow on CPU) only the engine measures the sets
(evaluation/engine_eval.py): the harness, drift and the offline-vs-measured comparison are skipped, the held-out
accuracy is still measured.

:class:`Evaluator` runs these steps over the stage's typed inputs (fledge/stage_inputs.py ``EvalInputs``);
:func:`evaluate_run` is the entry the pipeline calls (pipeline/stages.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from fledge.atomic import write_json_atomic
from fledge.conf.schema import TargetConfig, draft_steps
from fledge.data.prepare.build import load_tokenizer
from fledge.data.prepare.chat import ChatRenderer, eot_ids_from_target
from fledge.evaluation import long_context
from fledge.evaluation.acceptance import evaluate_set
from fledge.evaluation.drift import drift_curves
from fledge.evaluation.engine_eval import run_engine_eval
from fledge.evaluation.heldout import heldout_accuracy, offline_vs_measured
from fledge.evaluation.prompt_sets import SET_SPLITS, bucket_prompt_sets, build_prompt_sets, read_conversations
from fledge.evaluation.report import write_report
from fledge.evaluation.speculative import TargetRunner, greedy_decode
from fledge.models.algorithms import DrafterSpec, algorithm_of
from fledge.models.target import FrozenTarget
from fledge.run_layout import EvalDir, PrepareDir
from fledge.serving.engine import check_engine
from fledge.serving.export import load_drafter, spec_from_export
from fledge.stage_inputs import EvalInputs


def load_eval_models(target: TargetConfig, drafter_dir: Path, device: torch.device,
                     served: DrafterSpec) -> tuple[FrozenTarget, nn.Module]:
    """(FrozenTarget, drafter) as eval runs them, the drafter built as ``served`` (the export's spec as an
    engine reads it: ``spec_from_export(..., serving=True)``). The drafter is fp32 everywhere. On CPU the
    target is fp32 too, whatever the CPU: greedy tie gaps (evaluation/acceptance.py TIE_GAP) and the golden AL
    then do not depend on whether the CPU has native bf16 (where it does not, FrozenTarget.load has already made
    it fp32). On CUDA the target keeps ``target.dtype``."""

    frozen = FrozenTarget.load(target, device, served.aux_layer_ids)
    if device.type == "cpu":
        frozen.model.float()
    head = (frozen.model.get_output_embeddings().weight.detach().float().cpu()
            if algorithm_of(served).target_head else None)
    drafter = load_drafter(drafter_dir, embed_weight=frozen.input_embeddings().float().cpu(), head_weight=head,
                           dtype=torch.float32, device=device, spec=served).eval()
    return frozen, drafter


class Evaluator:
    """The eval stage on one exported drafter in ``drafter_dir``, over the prompts of the prepare stage's outputs
    ``prepared``, its report written to ``out``. Constructing it checks the engine (before any work: a missing
    engine fails fast), loads the tokenizer, the target and the drafter; :meth:`run` measures and reports."""

    def __init__(self, inputs: EvalInputs, prepared: PrepareDir, out: EvalDir, drafter_dir: Path,
                 device: torch.device):
        self.inputs, self.ev, self.K = inputs, inputs.eval, draft_steps(inputs)
        self.prepared, self.out, self.drafter_dir, self.device = prepared, out, drafter_dir, device
        self.engine_python = check_engine(self.ev.engine, device.type, self.ev.engine_python, algorithm_of(inputs))
        target = inputs.target
        self.renderer = ChatRenderer(load_tokenizer(target, inputs.chat_template),
                                     extra_eot_ids=eot_ids_from_target(target.name_or_path, target.revision))
        self.eos = sorted(self.renderer.eot_ids)
        self.frozen, self.drafter = self.load_models()
        self.target_model = self.frozen.model
        self.max_pos = int(getattr(self.target_model.config, "max_position_embeddings", 1 << 30))
        self.drift_depth = self.ev.drift_depth or max(self.ev.draft_tokens, 2 * self.K)

    def load_models(self) -> tuple[FrozenTarget, nn.Module]:
        """The target and the drafter an engine serves: the one the export's config.json and weights describe
        (its aux ids, layer settings, flags), not the training record's, so a config.json that disagrees with
        training shows in the AL."""
        served = spec_from_export(self.drafter_dir, serving=True)
        return load_eval_models(self.inputs.target, self.drafter_dir, self.device, served)

    def run(self, metrics_path: Path | None = None, train_al_estimate: float | None = None) -> dict:
        """Everything the stage measures, the report written; returns the stage's summary (:func:`stage_summary`).
        ``metrics_path``: the train stage's log (the report plots it); ``train_al_estimate``: its best AL
        estimate (the report and the engine's collapse check compare the measured AL with it)."""
        named: dict = {}
        sets = self.prompt_sets(named)
        report = self.report_head(named)
        if self.ev.in_process:  # the harness on every set; eval.in_process=false leaves the sets to the engine alone
            self.measure_sets(sets, report)
        self.measure_heldout(report)
        if self.ev.context_buckets:  # AL and drift vs context length (evaluation/long_context.py)
            report["context_buckets"] = self.context_buckets()
        report["train_al_estimate"] = train_al_estimate
        if self.engine_python is not None:  # eval.engine=vllm: the same prompts served by the engine
            report["engine"] = self.engine_eval(sets, report)
        return self.finish(report, metrics_path)

    def prompt_sets(self, named: dict) -> dict[str, list[list[int]]]:
        """The prompt sets (evaluation/prompt_sets.py), each prompt leaving room for the answer and one round of
        drafts; a named set's counts go to ``named``. Engine alone (eval.in_process=false): only the sets it
        serves are built (a named set's earlier turns cost the target's greedy answers)."""
        ev, plain = self.ev, TargetRunner(self.target_model)

        def respond(prompt: list[int]) -> str:  # a multi-turn set's earlier answers: the target's own, greedy
            out, _ = greedy_decode(plain, prompt, ev.max_new_tokens, self.eos)
            return self.renderer.tok.decode([t for t in out if t not in self.renderer.eot_ids],
                                            skip_special_tokens=True)

        built = ev if ev.in_process or not ev.engine_sets else dataclasses.replace(ev, sets=list(ev.engine_sets))
        sets = build_prompt_sets(built, self.renderer, self.prepared, self.max_pos - ev.max_new_tokens
                                 - ev.draft_tokens - 2, respond, named)
        if not sets:
            raise ValueError(f"eval: no prompt set could be built from {self.prepared.root} (eval.sets={ev.sets}); "
                             "run prepare")
        return sets

    def report_head(self, named: dict) -> dict:
        """The report's settings, before any measurement: k, the depth trained, the decoding, the drafter's
        algorithm (its registry name, models/algorithms.py) and flags (``fledge compare`` tells EAGLE-3.1 from
        EAGLE-3 by them)."""
        ev = self.ev
        report: dict = {"drafter": str(self.drafter_dir), "k": ev.draft_tokens, "ttt_steps": self.K,
                        "max_new_tokens": ev.max_new_tokens, "temperature": ev.temperature,
                        "degenerate_threshold": ev.degenerate_threshold, "in_process": ev.in_process,
                        "flags": {f: bool(self.drafter.spec.to_dict()[f]) for f in ("fc_norm", "norm_output")},
                        "algorithm": algorithm_of(self.drafter.spec).name,
                        "sets": {}}
        if named:
            report["named_sets"] = named
        return report

    def measure_sets(self, sets: dict[str, list[list[int]]], report: dict) -> None:
        """The in-process harness on every set (report.partial.json after each, so a cut eval leaves what it
        measured), then the drift curves of a chain drafter (the probe follows a chain's fed-back state; a block
        drafter has none)."""
        for name, prompts in sets.items():
            report["sets"][name] = evaluate_set(name, prompts, self.target_model, self.drafter, self.ev, self.eos,
                                                self.inputs.seed)
            write_json_atomic(self.out.partial_json, report)
        if not algorithm_of(self.drafter.spec).block:
            report["drift"] = {name: self.drift(prompts, f"drift {name}") for name, prompts in sets.items()}

    def drift(self, prompts: list[list[int]], desc: str) -> dict:
        """The attention-drift curves over ``prompts`` (evaluation/drift.py), ``drift_depth`` drafts deep."""
        runner = TargetRunner(self.target_model, self.drafter.spec.aux_layer_ids)
        return drift_curves(self.drafter, runner, prompts, self.drift_depth, desc=desc)

    def measure_heldout(self, report: dict) -> None:
        """The teacher-forced held-out accuracy on the default set's conversations (evaluation/heldout.py) and,
        beside the measured sets, the offline estimate vs the measured acceptance; nothing without them."""
        default = self.prepared.conversations(SET_SPLITS["default"])
        if not default.exists():
            return
        samples = [self.renderer.encode(c, f"{default}:{i + 1}")
                   for i, c in enumerate(read_conversations(default)[:self.ev.num_prompts])]
        report["heldout"] = heldout_accuracy(self.drafter, self.frozen, samples, self.ev.heldout_steps or 2 * self.K,
                                             self.inputs.chunk_tokens)
        if report["sets"]:
            report["offline_vs_measured"] = offline_vs_measured(report)

    def context_buckets(self) -> list[dict]:
        """The set harness and the drift probe on each of ``eval.context_buckets`` (evaluation/long_context.py)."""
        out = []
        for b, ps in bucket_prompt_sets(self.ev, self.renderer, self.prepared, self.max_pos).items():
            res = evaluate_set(f"context {b}", ps, self.target_model, self.drafter, self.ev, self.eos,
                               self.inputs.seed)
            out.append(long_context.summarize(b, res, self.drift(ps, f"drift context {b}")))
        return out

    def engine_eval(self, sets: dict[str, list[list[int]]], report: dict) -> dict:
        """The report's ``engine`` section: the same prompts (those of ``eval.engine_sets``, else all) served by
        the engine and held to the in-process figures (evaluation/engine_eval.py)."""
        engine_sets = {n: p for n, p in sets.items() if not self.ev.engine_sets or n in self.ev.engine_sets}
        return run_engine_eval(self.inputs, engine_sets, report, self.drafter_dir, self.out.engine_work, self.eos,
                               self.max_pos, self.device.type, self.engine_python)

    def finish(self, report: dict, metrics_path: Path | None) -> dict:
        """Write the report and its plots, drop the partial report, then fail on the engine's checks (after the
        report is written, so the numbers can be read); the stage's summary."""
        write_report(report, self.out, metrics_path)
        self.out.partial_json.unlink(missing_ok=True)
        if report.get("engine", {}).get("failures"):
            raise ValueError("\n".join(report["engine"]["failures"]) + f"\n(report: {self.out.report_md})")
        return stage_summary(report, self.out)


def evaluate_run(inputs: EvalInputs, prepared: PrepareDir, out: EvalDir, drafter_dir: Path, device: torch.device,
                 metrics_path: Path | None = None, train_al_estimate: float | None = None) -> dict:
    """Everything the eval stage measures, for an exported drafter in ``drafter_dir``, on the prompts of the
    prepare stage's outputs ``prepared``; the report goes to ``out``. ``metrics_path``: the train stage's log
    (the report plots it); ``train_al_estimate``: its best AL estimate (the report and the engine's collapse
    check compare the measured AL with it). Returns the stage's summary (:func:`stage_summary`)."""
    return Evaluator(inputs, prepared, out, drafter_dir, device).run(metrics_path, train_al_estimate)


def stage_summary(report: dict, out: EvalDir) -> dict:
    """The stage's outputs (its manifest; the model card's table): ``al_<set>`` / ``al_lookup_<set>`` are the
    in-process ALs (the tiny recipes' goldens), absent when eval.in_process=false rather than standing in for the
    engine's, which are ``al_engine_<set>`` / ``al_lookup_engine_<set>`` (vLLM's ngram, per draft)."""
    engine = report.get("engine", {}).get("sets", {})
    return {**{f"al_engine_{n}": s["drafter"]["al"] for n, s in engine.items()},
            **{f"al_lookup_engine_{n}": s["lookup"]["al"] for n, s in engine.items()},
            "report": str(out.report_md), "json": str(out.report_json),
            **{f"al_{n}": s["drafter"]["al"] for n, s in report["sets"].items()},
            **{f"al_lookup_{n}": s["lookup"]["al"] for n, s in report["sets"].items()}}
