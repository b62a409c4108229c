"""Typed configuration schema.

Hydra composes ``conf/`` over these dataclasses (registered in the ConfigStore as the root schema),
so an unknown key or a value of the wrong type fails at composition time with the key's full path.
``main.py`` converts the result to these objects once; nothing below it sees a DictConfig.
Cross-field checks live in ``validate()`` and raise ``ValueError`` naming the key.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from fledge.conf.drafter_rules import drafter_problems, raise_problems

STAGES = ("prepare", "capture", "train", "export", "eval", "publish")  # publish: export.push_to_hub


@dataclass
class RunConfig:
    name: str = "tiny"  # the run directory is <output_root>/<name>: never the clock (ranks must agree)
    output_root: str = "outputs"
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    seed: int = 0
    force: list[str] = field(default_factory=list)  # stages to re-run even when their manifest matches


@dataclass
class TargetConfig:
    name_or_path: str = "???"  # hub id or local directory, loaded with from_pretrained
    revision: Optional[str] = None
    dtype: str = "auto"  # auto (from the target's config) | bfloat16 | float16 | float32
    trust_remote_code: bool = False
    # Written in the recipe so it validates without downloading; checked against the real config at load.
    num_hidden_layers: int = 0
    hidden_size: int = 0
    vocab_size: int = 0
    # Optional: the target's config.json fields written inline (for export tests without a download).
    config_overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class LossOptions:
    """The parameters some registered losses take (train/losses/divergences.py says what each one does)."""

    jsd_beta: float = 0.5  # jsd: the teacher's weight in the mixture and its KL term, in (0, 1); 0.5 symmetric
    lk_eta: float = 3.0  # lk_lambda: the KL weight of a row is exp(-lk_eta * its acceptance), >= 0


@dataclass
class DrafterConfig:
    # The drafter algorithm (models/algorithms.py): eagle (EAGLE-3 / EAGLE-3.1, and P-EAGLE with parallel_drafting)
    # | dflash (a block drafter: one non-causal forward over [bonus token, block_size - 1 mask tokens], the target's
    # states injected as every layer's context keys and values; vLLM's method "dflash").
    algorithm: str = "eagle"
    aux_layer_ids: Optional[list[int]] = None  # boundary convention; None -> (2, L//2, L-3)
    fc_norm: bool = True  # EAGLE-3.1: per-aux-state RMSNorm before fc
    norm_output: bool = True  # EAGLE-3.1: post-norm feedback across draft steps
    norm_before_fc: bool = False  # older option (one norm over the concat); never with fc_norm
    # P-EAGLE (drafter=p_eagle; vLLM's speculative_config.parallel_drafting): the draft steps after the first take
    # the mask token and a learned state (mask_hidden) instead of the draft before them, so the engine proposes all
    # K tokens in one forward. mask_token_id: a target-vocab id (None: the target's pad id, else its eos id).
    parallel_drafting: bool = False
    mask_token_id: Optional[int] = None
    draft_vocab_size: int = 32000
    ttt_steps: int = 7  # K
    step_weight: float = 0.8  # w: total loss = sum_k w^k L_k
    # A loss registered in train/losses (the schema cannot import it: train/main.py checks the name at start).
    loss: str = "ttt_ce"
    loss_options: LossOptions = field(default_factory=LossOptions)
    # drafter.loss=mix: the losses summed and their weights (as given, not normalised), e.g. {ttt_ce: 0.5, tv: 0.5}
    # (a dict: set it with a leading + on the command line, '+drafter.loss_mix={ttt_ce: 0.5, tv: 0.5}')
    loss_mix: dict[str, float] = field(default_factory=dict)
    attention: str = "auto"  # auto | flex | sdpa | dense (reference)
    # Drafter layer kind (models/layers/): auto (the target family's: llama for Llama/Qwen, mla for
    # DeepSeek-V3/Kimi-K2) | llama | qwen3 (per-head q/k norms) | mla (DeepSeek multi-head latent attention).
    layer: str = "auto"
    loss_chunk_size: int = 1024  # rows per chunk of the teacher/draft logits
    # ttt_ce's shared-teacher path: auto (its Triton kernel on CUDA, torch elsewhere) | torch. Every other loss
    # runs torch GEMMs whatever this says (the fp32-head path, or ZeRO-3's generic one: train/losses).
    loss_impl: str = "auto"
    norm_impl: str = "torch"  # torch (F.rms_norm: torch's fused kernel on CUDA) | triton (ours, CUDA only)
    init_from: Optional[str] = None  # an exported drafter directory to fine-tune
    # dflash only: tokens per block (the bonus token and block_size - 1 drafts; vLLM then serves k = block_size - 1),
    # drafter layers, block anchors drawn per packed row, and gamma of the loss weight exp(-(k - 1) / gamma) of block
    # offset k (the DFlash paper's Eq. 4: 7 for blocks of 16, 5 for 10, 4 for 8). It drafts over the target's whole
    # vocab with the target's lm_head (draft_vocab_size is unused) and fills its block with mask_token_id (None:
    # the target's pad id, else its eos id).
    block_size: int = 16
    num_draft_layers: int = 1
    num_anchors: int = 512
    position_decay: float = 7.0

    def draft_steps(self) -> int:
        return draft_steps(self)


def draft_steps(drafter) -> int:
    """Draft positions one round of ``drafter`` (a DrafterConfig, or a stage's view of it) trains and scores:
    ttt_steps (eagle), block_size - 1 (dflash). A function, so that a stage's declared reads see the three keys."""
    return drafter.block_size - 1 if drafter.algorithm == "dflash" else drafter.ttt_steps


@dataclass
class SourceConfig:
    path: str = "???"  # jsonl / json / parquet file, local datasets dir, or hub dataset id
    weight: float = 1.0
    split: str = "train"
    max_samples: Optional[int] = None


@dataclass
class PerturbConfig:
    fraction: float = 0.0  # of training conversations
    system_prompts: list[str] = field(default_factory=list)
    eval_split: bool = True  # also write a perturbed copy of the eval split
    seed: int = 0
    system_modes: list[str] = field(default_factory=lambda: ["none", "default", "list"])  # data/prepare/perturb.py
    vary_date: bool = True  # draw a date_string template variable (Llama-3.1's date line)
    template_vars: dict[str, list[str]] = field(default_factory=dict)  # other template variables to draw


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    eval_sources: list[SourceConfig] = field(default_factory=list)  # empty -> split from sources
    eval_fraction: float = 0.02
    max_length: int = 2048
    length_policy: str = "truncate"  # truncate | drop
    last_turn_only: bool = False
    thinking_in_mask: bool = True
    on_error: str = "error"  # error | skip
    num_proc: int = 1
    seed: int = 0
    perturb: PerturbConfig = field(default_factory=PerturbConfig)
    chat_template: Optional[str] = None  # a jinja file or string overriding the target tokenizer's template


@dataclass
class CaptureConfig:
    mode: str = "offline"  # offline (feature store) | online (target beside the drafter)
    dtype: str = "bf16"  # bf16 | fp8 (e4m3 with per-token scales; aux states only)
    shard_size_mb: float = 1024  # per shard file (tests use fractions of a MiB)
    batch_tokens: int = 16384  # tokens per target forward
    # Rows longer than this are read in pieces of this many tokens through the target's own KV cache (states
    # equal to one forward; attention memory [chunk, T] instead of [T, T]); 0 = one forward per row.
    chunk_tokens: int = 8192
    device_map: Optional[str] = None  # e.g. "auto" to spread a big target over a node's GPUs
    # Array-job capture (pipeline/slurm/capture_array.sbatch, `fledge submit capture --array N`): task i runs with
    # slice_index=i and captures samples [i*n/N, (i+1)*n/N) of each split; a later run with num_slices=N and no
    # slice_index merges the slices into one store. Neither is in the stage's inputs hash (the tasks share one stage
    # dir).
    num_slices: int = 1
    slice_index: Optional[int] = None
    # Which engine computes the states (docs/serving.md, data/capture/engine.py): hf (an in-process transformers
    # forward) | vllm (vLLM's extract_hidden_states in its own environment, prefill only, same store).
    engine: str = "hf"
    engine_python: Optional[str] = None  # vllm: its python (default $FLEDGE_ENGINE_PYTHON, .engine/venv)
    engine_timeout_s: int = 1800  # vllm: longest wait for one batch (engine start-up included)
    tensor_parallel_size: int = 1  # vllm: GPUs per engine (one engine per Fledge rank)
    expert_parallel: bool = False  # vllm: enable_expert_parallel (MoE experts over the TP x DP GPUs)
    data_parallel_size: int = 1  # vllm: 1 = independent engine per rank; world size = one vLLM DP group
    # vllm + mode=online (data/capture/stream.py): global batches each rank's engine may run ahead of its trainer
    # (the stream buffer under <run>/train/stream/, at most this many batches of states on disk), and how often a
    # dead engine is started again from the trainer's data position before the run fails.
    buffer_batches: int = 4
    engine_restarts: int = 1
    # vllm + mode=online on a cluster (docs/slurm.md): the command prefix each engine's driver starts under, e.g.
    # srun into the engine nodes of a heterogeneous job ([] = a local process beside its trainer rank), and how
    # many consecutive trainer ranks share one engine (its leader, the group's first rank, starts it).
    engine_launcher: list[str] = field(default_factory=list)
    ranks_per_engine: int = 1


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 2
    offload_optimizer: bool = False
    offload_param: bool = False
    bf16: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | true | false
    extra: dict[str, Any] = field(default_factory=dict)  # merged into the DeepSpeed json last


@dataclass
class OptimConfig:
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    warmup_steps: int = 100
    schedule: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.0


@dataclass
class TrainConfig:
    max_steps: int = 0  # 0 -> epochs decide
    epochs: int = 1
    micro_batch_tokens: int = 8192  # packed row length per micro-batch
    micro_batch_size: int = 1  # packed rows per micro-batch per rank
    grad_accum: int = 1
    save_every: int = 1000
    keep_last: int = 2
    eval_every: int = 500
    eval_batches: int = 400  # held-out global batches per eval, split over the data-parallel ranks (50 each on 8)
    log_every: int = 10
    max_nonfinite: int = 5  # consecutive optimizer steps skipped for a non-finite loss before aborting
    # Ranks that split each packed row (DeepSpeed-Ulysses; train/sequence_parallel.py): world = data parallel x
    # this; must divide the world and the drafter's num_key_value_heads. 1 = off.
    sequence_parallel: int = 1
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class LoggingConfig:
    wandb_project: Optional[str] = None
    wandb_run_name: Optional[str] = None
    wandb_tags: list[str] = field(default_factory=list)
    wandb_mode: str = "auto"  # auto (online with credentials, else offline) | online | offline | disabled


@dataclass
class ExportConfig:
    checkpoint: str = "best"  # best | last | a path
    format: str = "hf"  # an export dialect (fledge/serving/dialects.py): hf | speculators | sglang
    max_shard_size: str = "5GB"
    # The publish stage (after eval) pushes the export with a card of that eval; token from HF_TOKEN only.
    push_to_hub: bool = False
    repo_id: Optional[str] = None
    private: bool = True
    lint: bool = True


@dataclass
class EvalConfig:
    num_prompts: int = 64
    draft_tokens: int = 5  # k, chain length
    max_new_tokens: int = 128
    temperature: float = 0.0
    sets: list[str] = field(default_factory=lambda: ["default", "perturbed", "long"])
    heldout_steps: int = 0  # held-out per-step accuracy up to this many steps (0 -> 2K)
    long_prompt_tokens: int = 1024  # the "long" set: prompts grown to about this many tokens with held-out context
    degenerate_threshold: float = 0.5  # outputs with a distinct-3-gram ratio below this count as degenerate (loops)
    drift_depth: int = 0  # draft depth of the attention-drift diagnostics (0 -> max(draft_tokens, 2K))
    lookup_max_ngram: int = 3  # prompt-lookup baseline: longest n-gram matched in the context
    # Acceptance vs context length (evaluation/long_context.py): prompt lengths in tokens, ascending (empty: off); the
    # same conversations cut to each, bucket_prompts of them, from long_context_source (a jsonl of
    # conversations with a long first user turn) or else the eval conversations grown with held-out context.
    context_buckets: list[int] = field(default_factory=list)
    bucket_prompts: int = 8
    long_context_source: Optional[str] = None
    # The serving engine in the loop (evaluation/engine_eval.py): hf = Fledge's in-process harness only; vllm also
    # serves the export with real vLLM (scripts/setup_engine.sh) and holds its AL to the in-process AL;
    # sglang runs only on CUDA GPUs.
    engine: str = "hf"  # hf | vllm | sglang
    engine_al_tolerance: float = 0.15  # max |engine AL - in-process AL| per set before the eval stage fails
    engine_python: Optional[str] = None  # the engine's python (default $FLEDGE_ENGINE_PYTHON, .engine/venv)
    engine_batch_size: int = 0  # prompts per engine generate call (0: the whole set at once)
    engine_timeout_s: int = 1800  # the whole engine run, all three configurations
    engine_sets: list[str] = field(default_factory=list)  # the eval.sets vLLM serves (empty: every set)
    # false: the engine alone measures the prompt sets (a real target, whose in-process harness costs ~36 s a prompt
    # on 2 CPU cores); no in-process AL, drift or context buckets, and no engine-vs-in-process AL check
    in_process: bool = True
    # Named eval sets (evaluation/eval_sets.py): eval.sets may also name public benchmarks (mt_bench, gsm8k, humaneval,
    # alpaca, cnn_dm, math500, speed_bench_<category>, speed_bench_throughput_<n>k, longbench_v2), loaded by hub id
    # with `datasets` and rendered through the target's chat template; eval.num_prompts bounds each set's prompts.
    set_paths: dict[str, str] = field(default_factory=dict)  # <set name> -> local file/dir or org/name[@revision]
    max_prompt_tokens: int = 0  # named sets: longest prompt (0: the target's max positions minus the generation)
    prompt_length_policy: str = "truncate"  # named sets, a longer prompt: truncate (cut its middle) | skip


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    recipe: str = "???"  # set by the selected conf/recipe/<name>.yaml

    def validate(self) -> Config:
        """Cross-field checks that types alone cannot express; raises ValueError naming the key."""
        _check_bounds(self)
        _one_of("run.stages", self.run.stages, STAGES, many=True)
        _one_of("run.force", self.run.force, STAGES, many=True)
        _one_of("target.dtype", self.target.dtype, ("auto", "bfloat16", "float16", "float32"))
        _one_of("drafter.attention", self.drafter.attention, ("auto", "flex", "sdpa", "dense"))
        _one_of("drafter.loss_impl", self.drafter.loss_impl, ("auto", "torch"))
        _check_loss(self.drafter)
        _check_parallel_drafting(self)
        _check_algorithm(self)
        _one_of("drafter.norm_impl", self.drafter.norm_impl, ("torch", "triton"))
        _one_of("data.length_policy", self.data.length_policy, ("truncate", "drop"))
        _one_of("data.on_error", self.data.on_error, ("error", "skip"))
        _one_of("capture.mode", self.capture.mode, ("offline", "online"))
        _one_of("capture.dtype", self.capture.dtype, ("bf16", "fp8"))
        _one_of("capture.engine", self.capture.engine, ("hf", "vllm"))
        if self.capture.engine == "vllm" and self.capture.device_map:
            raise ValueError("capture.engine=vllm runs the target with the engine's own parallelism: drop "
                             "capture.device_map (set capture.tensor_parallel_size / expert_parallel instead)")
        if self.capture.engine == "vllm" and self.capture.mode == "online" and self.capture.data_parallel_size > 1:
            raise ValueError("capture.mode=online with capture.engine=vllm streams from one engine per trainer rank: "
                             "set capture.data_parallel_size=1")
        if self.capture.buffer_batches < 1:
            raise ValueError(f"capture.buffer_batches={self.capture.buffer_batches}: must be >= 1 (batches the "
                             "engine may run ahead of the trainer)")
        if self.capture.ranks_per_engine < 1:
            raise ValueError(f"capture.ranks_per_engine={self.capture.ranks_per_engine}: must be >= 1 (trainer ranks "
                             "one engine serves)")
        if (self.capture.engine_launcher or self.capture.ranks_per_engine > 1) and not (
                self.capture.mode == "online" and self.capture.engine == "vllm"):
            raise ValueError("capture.engine_launcher / capture.ranks_per_engine place the engines of capture.mode="
                             "online with capture.engine=vllm; set those two, or drop these keys")
        _check_capture_slices(self)
        _one_of("deepspeed.zero_stage", self.deepspeed.zero_stage, (0, 1, 2, 3))
        _one_of("train.optim.schedule", self.train.optim.schedule, ("cosine", "linear", "constant"))
        _one_of("eval.engine", self.eval.engine, ("hf", "vllm", "sglang"))
        _one_of("eval.prompt_length_policy", self.eval.prompt_length_policy, ("truncate", "skip"))
        if self.eval.max_prompt_tokens < 0:
            raise ValueError(f"eval.max_prompt_tokens={self.eval.max_prompt_tokens}: must be >= 0 "
                             "(0: the target's limit)")
        unknown = [s for s in self.eval.engine_sets if s not in self.eval.sets]
        if unknown:
            raise ValueError(f"eval.engine_sets={self.eval.engine_sets}: {unknown} not in eval.sets={self.eval.sets}")
        if not self.eval.engine_al_tolerance > 0:
            raise ValueError(f"eval.engine_al_tolerance={self.eval.engine_al_tolerance}: must be > 0 (an AL gap)")
        _check_context_buckets(self.eval)
        _check_engine_only(self.eval)
        _one_of("logging.wandb_mode", self.logging.wandb_mode, ("auto", "online", "offline", "disabled"))
        if self.train.sequence_parallel < 1:
            raise ValueError(f"train.sequence_parallel={self.train.sequence_parallel}: must be >= 1 (1 = off)")
        if not 0.0 <= self.data.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction={self.data.eval_fraction}: must be in [0, 1)")
        if not 0.0 <= self.data.perturb.fraction <= 1.0:
            raise ValueError(f"data.perturb.fraction={self.data.perturb.fraction}: must be in [0, 1]")
        L, V = self.target.num_hidden_layers, self.target.vocab_size
        if L <= 0:
            raise ValueError("target.num_hidden_layers must be written in the recipe (the target's layer count)")
        d = self.drafter
        raise_problems(drafter_problems(self.aux_layer_ids(), L, fc_norm=d.fc_norm, norm_before_fc=d.norm_before_fc,
                                        ttt_steps=d.ttt_steps, draft_vocab_size=d.draft_vocab_size,
                                        vocab_size=V or None))
        if self.export.push_to_hub and not self.export.repo_id:
            raise ValueError("export.push_to_hub=true needs export.repo_id (e.g. my-org/llama3-eagle3.1)")
        return self

    def aux_layer_ids(self) -> list[int]:
        """Boundary-convention ids of the captured target states (docs/architecture.md, Aux layer ids)."""
        if self.drafter.aux_layer_ids is not None:
            return list(self.drafter.aux_layer_ids)
        return default_aux_layer_ids(self.target.num_hidden_layers)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """(2, L//2, L-3): hidden_states[k] of a Hugging Face forward, k = layers applied so far."""
    return [2, num_layers // 2, num_layers - 3]


def _check_parallel_drafting(cfg: Config) -> None:
    """P-EAGLE's keys: a mask token only for a parallel drafter, and an export only vLLM's HF layout serves so."""
    d = cfg.drafter
    if d.mask_token_id is not None and not d.parallel_drafting and d.algorithm != "dflash":
        raise ValueError(f"drafter.mask_token_id={d.mask_token_id} is set but drafter.parallel_drafting=false: it "
                         "names the token P-EAGLE's parallel slots (or a DFlash block) are fed; use drafter=p_eagle or "
                         "drafter=dflash, or drop the key")
    if d.mask_token_id is not None and d.mask_token_id < 0:
        raise ValueError(f"drafter.mask_token_id={d.mask_token_id}: must be a target-vocab id (>= 0)")
    if d.parallel_drafting and cfg.export.format != "hf":
        raise ValueError(f"drafter.parallel_drafting with export.format={cfg.export.format}: only the hf export is "
                         "served with parallel drafting (vLLM's parallel_drafting; SGLang has none, and the "
                         "speculators layout is run without it); use export.format=hf")
    if d.parallel_drafting and cfg.eval.engine == "sglang":
        raise ValueError("drafter.parallel_drafting with eval.engine=sglang: SGLang has no parallel drafting for "
                         "EAGLE drafters; use eval.engine=vllm or hf")


ALGORITHMS = ("eagle", "dflash")  # models/algorithms.py registers each (the schema cannot import it)


def _check_algorithm(cfg: Config) -> None:
    """drafter.algorithm and the block drafter's keys."""
    d = cfg.drafter
    _one_of("drafter.algorithm", d.algorithm, ALGORITHMS)
    if d.algorithm != "dflash":
        return
    if d.block_size < 2:
        raise ValueError(f"drafter.block_size={d.block_size}: a DFlash block holds the bonus token and at least one "
                         "draft (>= 2; 16 in the paper)")
    if d.num_draft_layers < 1 or d.num_anchors < 1 or not d.position_decay > 0:
        raise ValueError(f"drafter.num_draft_layers={d.num_draft_layers}, drafter.num_anchors={d.num_anchors}, "
                         f"drafter.position_decay={d.position_decay}: each must be > 0")
    if d.parallel_drafting or d.fc_norm or d.norm_output or d.norm_before_fc:
        raise ValueError("drafter.algorithm=dflash has none of EAGLE's flags (vLLM's DFlash drafter applies fc alone, "
                         "drafts in one forward and feeds nothing back): use drafter=dflash, which sets "
                         "parallel_drafting, fc_norm, norm_output and norm_before_fc false")
    if cfg.export.format != "hf":
        raise ValueError(f"drafter.algorithm=dflash with export.format={cfg.export.format}: vLLM loads DFlash drafters "
                         "from the hf layout only (DFlashDraftModel); use export.format=hf")
    if cfg.eval.draft_tokens > d.block_size - 1:
        raise ValueError(f"eval.draft_tokens={cfg.eval.draft_tokens} with drafter.block_size={d.block_size}: a block "
                         f"drafts at most block_size - 1 = {d.block_size - 1} tokens (offsets past it were never "
                         f"trained); set drafter.block_size={cfg.eval.draft_tokens + 1} or lower eval.draft_tokens")
    if cfg.eval.engine == "sglang":
        raise ValueError("drafter.algorithm=dflash with eval.engine=sglang: Fledge serves DFlash drafters with vLLM's "
                         "method dflash; use eval.engine=vllm or hf")
    if cfg.train.sequence_parallel > 1:
        raise ValueError(f"drafter.algorithm=dflash with train.sequence_parallel={cfg.train.sequence_parallel}: block "
                         "anchors see the whole row; set train.sequence_parallel=1")
    if d.init_from:
        raise ValueError("drafter.init_from with drafter.algorithm=dflash: fine-tuning starts from an EAGLE drafter "
                         "only; drop drafter.init_from")


def _check_loss(d: DrafterConfig) -> None:
    """The loss's options and mix weights (the loss names are train/losses', checked by train/main.py)."""
    o = d.loss_options
    if not 0 < o.jsd_beta < 1:
        raise ValueError(f"drafter.loss_options.jsd_beta={o.jsd_beta}: must be in (0, 1) (0.5: the symmetric JSD)")
    if not o.lk_eta >= 0:
        raise ValueError(f"drafter.loss_options.lk_eta={o.lk_eta}: must be >= 0 (0: the lk_lambda loss is forward KL)")
    example = "on the command line: drafter.loss=mix '+drafter.loss_mix={ttt_ce: 0.5, tv: 0.5}'"
    if d.loss != "mix":
        if d.loss_mix:
            raise ValueError(f"drafter.loss_mix={dict(d.loss_mix)} is set but drafter.loss={d.loss}: set "
                             "drafter.loss=mix to train on the mix, or drop drafter.loss_mix")
        return
    if not d.loss_mix:
        raise ValueError(f"drafter.loss=mix needs the losses to mix and their weights in drafter.loss_mix ({example})")
    bad = {k: w for k, w in d.loss_mix.items() if not (math.isfinite(w) and w >= 0)}
    if bad or not sum(d.loss_mix.values()) > 0 or "mix" in d.loss_mix:
        raise ValueError(f"drafter.loss_mix={dict(d.loss_mix)}: the weights must be finite, >= 0 and not all 0, "
                         f"and 'mix' cannot be a part ({example})")


def _check_capture_slices(cfg: Config) -> None:
    c = cfg.capture
    if c.num_slices < 1:
        raise ValueError(f"capture.num_slices={c.num_slices}: must be >= 1")
    if c.num_slices > 1 and "capture" in cfg.run.force:
        raise ValueError(f"capture.num_slices={c.num_slices} with run.force=[capture]: forcing would clear the "
                         "slices of the array capture; delete <run>/capture once before submitting the array instead")
    if c.slice_index is None:
        return
    if not 0 <= c.slice_index < c.num_slices:
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
    if any(x < 16 for x in b) or b != sorted(set(b)):
        raise ValueError(f"eval.context_buckets={b}: prompt lengths in tokens, ascending, distinct, each >= 16 "
                         "(e.g. [512,2048,8192,32768])")
    if b and ev.bucket_prompts < 1:
        raise ValueError(f"eval.bucket_prompts={ev.bucket_prompts}: must be >= 1 with eval.context_buckets set")


# Counts the code divides by, loops over or waits for, and their least value: below it a value composes but fails
# after the model is built (a modulo by 0), or runs nothing. Each with what it counts, for the message.
AT_LEAST: dict[str, tuple[int, str]] = {
    "train.max_steps": (0, "optimizer steps; 0: train.epochs decides"),
    "train.epochs": (1, "passes over the data when train.max_steps=0"),
    "train.micro_batch_tokens": (1, "tokens per packed row"),
    "train.micro_batch_size": (1, "packed rows per micro-batch per rank"),
    "train.grad_accum": (1, "micro-batches per optimizer step; 1: none accumulated"),
    "train.save_every": (1, "steps between checkpoints; the last step always saves"),
    "train.keep_last": (1, "checkpoints kept"),
    "train.eval_every": (1, "steps between held-out evals; the last step always evaluates, so "
                            "train.eval_every=train.max_steps evaluates once at the end"),
    "train.eval_batches": (1, "held-out global batches per eval"),
    "train.log_every": (1, "steps between log lines"),
    "train.max_nonfinite": (1, "non-finite steps in a row before the run stops"),
    "train.optim.warmup_steps": (0, "steps of linear warmup; 0: none"),
    "capture.batch_tokens": (1, "tokens per target forward"),
    "capture.tensor_parallel_size": (1, "GPUs per engine; 1: no tensor parallelism"),
    "capture.data_parallel_size": (1, "vLLM data-parallel ranks; 1: an engine per rank"),
    "capture.engine_timeout_s": (1, "seconds to wait for one batch, the engine's start-up included"),
    "capture.engine_restarts": (0, "restarts of a dead engine before the run fails; 0: none"),
    "eval.num_prompts": (1, "prompts per eval set"),
    "eval.draft_tokens": (1, "draft tokens per speculative round, k"),
    "eval.max_new_tokens": (1, "tokens generated per prompt"),
    "eval.engine_timeout_s": (1, "seconds for the whole engine run"),
}


def _check_bounds(cfg: Config) -> None:
    for key, (low, meaning) in AT_LEAST.items():
        value = functools.reduce(getattr, key.split("."), cfg)
        if value < low:
            raise ValueError(f"{key}={value}: must be >= {low} ({meaning})")


def _one_of(key: str, value: Any, allowed: tuple, many: bool = False) -> None:
    for v in value if many else [value]:
        if v not in allowed:
            raise ValueError(f"{key}={v!r}: expected one of {list(allowed)}")
