"""The rules across a config's keys (``Config.validate`` runs them after each value's own domain,
conf/domains.py): each raises ValueError naming the keys and the fix. The drafter's aux-id and flag rules, shared
with the model, serving and lint code, are conf/drafter_rules.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fledge.conf.drafter_rules import drafter_problems, raise_problems

if TYPE_CHECKING:
    from fledge.conf.schema import Config, DrafterConfig, EvalConfig

BLOCK_DRAFTERS = {"dflash": "DFlash", "dspark": "DSpark"}  # the block drafters, by their display names


def check_rules(cfg: Config) -> None:
    """Every rule across keys, in the order a user meets them."""
    _check_loss(cfg.drafter)
    _check_parallel_drafting(cfg)
    _check_algorithm(cfg)
    _check_mtp(cfg)
    if cfg.capture.engine == "vllm" and cfg.capture.device_map:
        raise ValueError("capture.engine=vllm runs the target with the engine's own parallelism: drop "
                         "capture.device_map (set capture.tensor_parallel_size / expert_parallel instead)")
    if cfg.capture.engine == "vllm" and cfg.capture.mode == "online" and cfg.capture.data_parallel_size > 1:
        raise ValueError("capture.mode=online with capture.engine=vllm streams from one engine per trainer rank: "
                         "set capture.data_parallel_size=1")
    if (cfg.capture.engine_launcher or cfg.capture.ranks_per_engine > 1) and not (
            cfg.capture.mode == "online" and cfg.capture.engine == "vllm"):
        raise ValueError("capture.engine_launcher / capture.ranks_per_engine place the engines of capture.mode="
                         "online with capture.engine=vllm; set those two, or drop these keys")
    _check_capture_slices(cfg)
    _check_optim(cfg)
    unknown = [s for s in cfg.eval.engine_sets if s not in cfg.eval.sets]
    if unknown:
        raise ValueError(f"eval.engine_sets={cfg.eval.engine_sets}: {unknown} not in eval.sets={cfg.eval.sets}")
    _check_context_buckets(cfg.eval)
    _check_engine_only(cfg.eval)
    L, V = cfg.target.num_hidden_layers, cfg.target.vocab_size
    d = cfg.drafter
    raise_problems(drafter_problems(cfg.aux_layer_ids(), L, fc_norm=d.fc_norm, norm_before_fc=d.norm_before_fc,
                                    ttt_steps=d.ttt_steps, draft_vocab_size=d.draft_vocab_size,
                                    vocab_size=V or None))
    if cfg.export.push_to_hub and not cfg.export.repo_id:
        raise ValueError("export.push_to_hub=true needs export.repo_id (e.g. my-org/llama3-eagle3.1)")


def _check_parallel_drafting(cfg: Config) -> None:
    """P-EAGLE's keys: a mask token only for a parallel drafter, and an export only vLLM's HF layout serves so."""
    d = cfg.drafter
    if d.mask_token_id is not None and not d.parallel_drafting and d.algorithm not in BLOCK_DRAFTERS:
        raise ValueError(f"drafter.mask_token_id={d.mask_token_id} is set but drafter.parallel_drafting=false: it "
                         "names the token P-EAGLE's parallel slots (or a DFlash block) are fed; use drafter=p_eagle or "
                         "drafter=dflash, or drop the key")
    if d.parallel_drafting and cfg.export.format != "hf":
        raise ValueError(f"drafter.parallel_drafting with export.format={cfg.export.format}: only the hf export is "
                         "served with parallel drafting (vLLM's parallel_drafting; SGLang has none, and the "
                         "speculators layout is run without it); use export.format=hf")
    if d.parallel_drafting and cfg.eval.engine == "sglang":
        raise ValueError("drafter.parallel_drafting with eval.engine=sglang: SGLang has no parallel drafting for "
                         "EAGLE drafters; use eval.engine=vllm or hf")


def _check_algorithm(cfg: Config) -> None:
    """drafter.algorithm and the block drafter's keys."""
    d = cfg.drafter
    if d.algorithm not in BLOCK_DRAFTERS:
        return
    a, name = d.algorithm, BLOCK_DRAFTERS[d.algorithm]
    if d.parallel_drafting or d.fc_norm or d.norm_output or d.norm_before_fc:
        raise ValueError(f"drafter.algorithm={a} has none of EAGLE's flags (vLLM's {name} drafter applies fc alone, "
                         f"drafts in one forward and feeds nothing back): use drafter={a}, which sets "
                         "parallel_drafting, fc_norm, norm_output and norm_before_fc false")
    if cfg.export.format != "hf":
        raise ValueError(f"drafter.algorithm={a} with export.format={cfg.export.format}: vLLM loads {name} drafters "
                         f"from the hf layout only ({'DFlashDraftModel' if a == 'dflash' else 'Qwen3DSparkModel'}); "
                         "use export.format=hf")
    if a == "dspark" and cfg.eval.draft_tokens != d.block_size:
        raise ValueError(f"eval.draft_tokens={cfg.eval.draft_tokens} with drafter.block_size={d.block_size}: a DSpark "
                         "block drafts exactly block_size tokens (vLLM drafts num_speculative_tokens slots, and a "
                         "block of another length is not the one trained); set drafter.block_size="
                         f"{cfg.eval.draft_tokens} or eval.draft_tokens={d.block_size}")
    if a == "dflash" and cfg.eval.draft_tokens > d.block_size - 1:
        raise ValueError(f"eval.draft_tokens={cfg.eval.draft_tokens} with drafter.block_size={d.block_size}: a block "
                         f"drafts at most block_size - 1 = {d.block_size - 1} tokens (offsets past it were never "
                         f"trained); set drafter.block_size={cfg.eval.draft_tokens + 1} or lower eval.draft_tokens")
    if cfg.eval.engine == "sglang":
        raise ValueError(f"drafter.algorithm={a} with eval.engine=sglang: Fledge serves {name} drafters with vLLM's "
                         f"method {a}; use eval.engine=vllm or hf")
    if cfg.train.sequence_parallel > 1:
        raise ValueError(f"drafter.algorithm={a} with train.sequence_parallel={cfg.train.sequence_parallel}: block "
                         "anchors see the whole row; set train.sequence_parallel=1")
    if d.init_from:
        raise ValueError(f"drafter.init_from with drafter.algorithm={a}: fine-tuning starts from an EAGLE drafter "
                         "only; drop drafter.init_from")


def _check_mtp(cfg: Config) -> None:
    """drafter=mtp: the target's own MTP module, fine-tuned and served by vLLM's method mtp (models/mtp_drafter.py)."""
    d = cfg.drafter
    if d.algorithm != "mtp":
        return
    if d.fc_norm or d.norm_before_fc or d.parallel_drafting:
        raise ValueError("drafter.algorithm=mtp takes none of fc_norm, norm_before_fc, parallel_drafting: the MTP "
                         "module's hnorm and enorm already normalise every state entering it, and vLLM chains its "
                         "drafts; use drafter=mtp, which sets them false (drafter.norm_output: the fed-back state)")
    if cfg.export.format != "hf" or cfg.eval.engine == "sglang":
        raise ValueError(f"drafter.algorithm=mtp with export.format={cfg.export.format}, eval.engine={cfg.eval.engine}:"
                         " Fledge exports the module in the layout vLLM's method mtp loads and serves it with vLLM; "
                         "use export.format=hf and eval.engine=vllm or hf")
    if cfg.train.sequence_parallel > 1 or d.init_from:
        raise ValueError("drafter.algorithm=mtp starts from the target's own MTP module and trains on whole rows: set "
                         "train.sequence_parallel=1 and drop drafter.init_from")


def _check_loss(d: DrafterConfig) -> None:
    """The mix and its weights (the loss names are train/losses', checked by train/main.py; each weight's
    domain is the schema's)."""
    example = "on the command line: drafter.loss=mix '+drafter.loss_mix={ttt_ce: 0.5, tv: 0.5}'"
    if d.loss != "mix":
        if d.loss_mix:
            raise ValueError(f"drafter.loss_mix={dict(d.loss_mix)} is set but drafter.loss={d.loss}: set "
                             "drafter.loss=mix to train on the mix, or drop drafter.loss_mix")
        return
    if not d.loss_mix:
        raise ValueError(f"drafter.loss=mix needs the losses to mix and their weights in drafter.loss_mix ({example})")
    if not sum(d.loss_mix.values()) > 0 or "mix" in d.loss_mix:
        raise ValueError(f"drafter.loss_mix={dict(d.loss_mix)}: the weights must be >= 0 and not all 0, and 'mix' "
                         f"cannot be a part ({example})")


def _check_optim(cfg: Config) -> None:
    """Muon orthogonalizes whole matrices from ZeRO-1/2's flat partitions (train/optimizers.py); ZeRO-3 partitions
    each parameter on its own and an offloaded optimizer steps on the host, where neither mapping is kept."""
    if cfg.train.optim.name != "muon":
        return
    ds = cfg.deepspeed
    if ds.zero_stage == 3:
        raise ValueError("train.optim.name=muon runs under deepspeed.zero_stage 0, 1 or 2, not 3 (ZeRO-3 "
                         "partitions each matrix Muon orthogonalizes whole): use deepspeed=zero2, or "
                         "train.optim.name=adamw with ZeRO-3")
    if ds.offload_optimizer:
        raise ValueError("train.optim.name=muon steps on the device: drop deepspeed.offload_optimizer (e.g. "
                         "deepspeed=zero2), or use train.optim.name=adamw with it")


def _check_capture_slices(cfg: Config) -> None:
    c = cfg.capture
    if c.num_slices > 1 and "capture" in cfg.run.force:
        raise ValueError(f"capture.num_slices={c.num_slices} with run.force=[capture]: forcing would clear the "
                         "slices of the array capture; delete <run>/capture once before submitting the array instead")
    if c.slice_index is None:
        return
    if not c.slice_index < c.num_slices:
        raise ValueError(f"capture.slice_index={c.slice_index}: must be in [0, capture.num_slices={c.num_slices})")
    if list(cfg.run.stages) != ["capture"]:
        raise ValueError(f"capture.slice_index={c.slice_index} with run.stages={list(cfg.run.stages)}: a slice task "
                         "runs the capture stage alone (run.stages=[capture]); prepare runs once before the "
                         "array, later stages after the merge (capture.num_slices=N without slice_index)")
    if c.mode != "offline":
        raise ValueError(f"capture.slice_index with capture.mode={c.mode}: slices exist only for the offline store")


def _check_engine_only(ev: EvalConfig) -> None:
    """eval.in_process=false: an engine measures every set, and nothing asks for what only the harness measures."""
    if ev.in_process:
        return
    if ev.engine == "hf":
        raise ValueError("eval.in_process=false measures the prompt sets with the serving engine alone, and "
                         "eval.engine=hf is none: set eval.engine=vllm (or eval.in_process=true)")
    if ev.context_buckets:
        raise ValueError(f"eval.context_buckets={list(ev.context_buckets)}: AL vs context length is measured by the "
                         "in-process harness, which eval.in_process=false skips: drop eval.context_buckets (or set "
                         "eval.in_process=true)")


def _check_context_buckets(ev: EvalConfig) -> None:
    b = list(ev.context_buckets)
    if b != sorted(set(b)):
        raise ValueError(f"eval.context_buckets={b}: prompt lengths in tokens, ascending, distinct, each >= 16 "
                         "(e.g. [512,2048,8192,32768])")

