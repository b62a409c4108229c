"""Typed configuration schema.

Hydra composes ``conf/`` over these dataclasses (registered in the ConfigStore as the root schema),
so an unknown key or a value of the wrong type fails at composition time with the key's full path.
``main.py`` converts the result to these objects once; nothing below it sees a DictConfig.
Cross-field checks live in ``validate()`` and raise ``ValueError`` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Optional

from fledge.conf.config_rules import check_rules
from fledge.conf.domains import ByteSize, DirName, Elsewhere, Free, Location, OneOf, Range, check_domains

STAGES = ("prepare", "capture", "train", "export", "eval", "publish")  # publish: export.push_to_hub
ALGORITHMS = ("eagle", "dflash", "dspark", "mtp")  # models/algorithms.py registers each (the schema cannot import it)


@dataclass
class RunConfig:
    # the run directory is <output_root>/<name>: never the clock (ranks must agree)
    name: Annotated[str, DirName("run.output_root")] = "tiny"
    output_root: Annotated[str, Location("a directory")] = "outputs"
    stages: Annotated[list[str], OneOf(*STAGES)] = field(default_factory=lambda: list(STAGES))
    seed: Annotated[int, Range(ge=0)] = 0
    # stages to re-run even when their manifest matches
    force: Annotated[list[str], OneOf(*STAGES)] = field(default_factory=list)


@dataclass
class TargetConfig:
    # hub id or local directory, loaded with from_pretrained
    name_or_path: Annotated[str, Location("a hub id or a local directory")] = "???"
    revision: Annotated[Optional[str], Free("a hub branch, tag or commit; the Hub resolves it")] = None
    # auto (from the target's config) | bfloat16 | float16 | float32
    dtype: Annotated[str, OneOf("auto", "bfloat16", "float16", "float32")] = "auto"
    trust_remote_code: bool = False
    # Written in the recipe so it validates without downloading; checked against the real config at load.
    num_hidden_layers: Annotated[int, Range(ge=1, why="the target's layer count, written in the recipe")] = 0
    hidden_size: Annotated[int, Range(ge=0, why="0: not written; read from the target's config")] = 0
    vocab_size: Annotated[int, Range(ge=0, why="0: not written; read from the target's config")] = 0
    # Optional: the target's config.json fields written inline (for export tests without a download).
    config_overrides: Annotated[dict[str, Any], Free("the target's own config.json fields, any model type's")] = \
        field(default_factory=dict)


@dataclass
class LossOptions:
    """The parameters some registered losses take (train/losses/divergences.py says what each one does)."""

    # jsd: the teacher's weight in the mixture and its KL term; 0.5 symmetric
    jsd_beta: Annotated[float, Range(gt=0, lt=1, why="0.5: the symmetric JSD")] = 0.5
    # lk_lambda: the KL weight of a row is exp(-lk_eta * its acceptance)
    lk_eta: Annotated[float, Range(ge=0, why="0: the lk_lambda loss is forward KL")] = 3.0


@dataclass
class DrafterConfig:
    # The drafter algorithm (models/algorithms.py): eagle (EAGLE-3 / EAGLE-3.1, and P-EAGLE with parallel_drafting)
    # | dflash (a block drafter: one non-causal forward over [bonus token, block_size - 1 mask tokens], the target's
    # states injected as every layer's context keys and values; vLLM's method "dflash") | dspark (DFlash whose anchor
    # slot drafts too, so a block drafts block_size tokens, plus a Markov bias head; vLLM's method "dspark") | mtp (the
    # target's own MTP module fine-tuned as a chain drafter, norm_output its fed-back state; vLLM's method "mtp").
    algorithm: Annotated[str, OneOf(*ALGORITHMS)] = "eagle"
    # boundary convention; None -> (2, L//2, L-3)
    aux_layer_ids: Annotated[Optional[list[int]], Elsewhere("conf/drafter_rules.py", [0, 2, 3], [4, 2, 5])] = None
    fc_norm: bool = True  # EAGLE-3.1: per-aux-state RMSNorm before fc
    norm_output: bool = True  # EAGLE-3.1: post-norm feedback across draft steps
    norm_before_fc: bool = False  # older option (one norm over the concat); never with fc_norm
    # P-EAGLE (drafter=p_eagle; vLLM's speculative_config.parallel_drafting): the draft steps after the first take
    # the mask token and a learned state (mask_hidden) instead of the draft before them, so the engine proposes all
    # K tokens in one forward. mask_token_id: a target-vocab id (None: the target's pad id, else its eos id).
    parallel_drafting: bool = False
    mask_token_id: Annotated[Optional[int], Range(ge=0, why="a target-vocab id")] = None
    # <= the target's vocab_size (conf/drafter_rules.py)
    draft_vocab_size: Annotated[int, Range(ge=1, why="draft-vocab tokens")] = 32000
    ttt_steps: Annotated[int, Range(ge=1, why="draft steps trained, K")] = 7
    # w: total loss = sum_k w^k L_k (negative: the odd steps' losses maximised)
    step_weight: Annotated[float, Range(gt=0, le=1, why="step k's loss weighs w^k; 1 weighs every step alike")] = 0.8
    # A loss registered in train/losses (the schema cannot import it: train/main.py checks the name at start).
    loss: Annotated[str, Elsewhere("train/losses (pipeline/preflight.py CONFIG_REGISTRIES)", "no_such_loss")] = \
        "ttt_ce"
    loss_options: LossOptions = field(default_factory=LossOptions)
    # drafter.loss=mix: the losses summed and their weights (as given, not normalised), e.g. {ttt_ce: 0.5, tv: 0.5}
    # (a dict: set it with a leading + on the command line, '+drafter.loss_mix={ttt_ce: 0.5, tv: 0.5}')
    loss_mix: Annotated[dict[str, float], Range(ge=0, why="a loss's weight in the mix")] = \
        field(default_factory=dict)
    attention: Annotated[str, OneOf("auto", "flex", "sdpa", "dense")] = "auto"  # dense: the reference
    # Drafter layer kind (models/layers/): auto (the target family's: llama for Llama/Qwen, mla for
    # DeepSeek-V3/Kimi-K2) | llama | qwen3 (per-head q/k norms) | mla (DeepSeek multi-head latent attention).
    layer: Annotated[str, Elsewhere("models/layers (pipeline/preflight.py CONFIG_REGISTRIES)", "no_such_layer")] = \
        "auto"
    loss_chunk_size: Annotated[int, Range(ge=1, why="rows per chunk of the teacher/draft logits")] = 1024
    # ttt_ce's shared-teacher path: auto (its Triton kernel on CUDA, torch elsewhere) | torch. Every other loss
    # runs torch GEMMs whatever this says (the fp32-head path, or ZeRO-3's generic one: train/losses).
    loss_impl: Annotated[str, OneOf("auto", "torch")] = "auto"
    # torch (F.rms_norm: torch's fused kernel on CUDA) | triton (ours, CUDA only)
    norm_impl: Annotated[str, OneOf("torch", "triton")] = "torch"
    # a drafter to fine-tune: a checkpoint (a run's train/best or train/checkpoints/step_<N>/drafter) or an exported
    # drafter directory (the train stage reads it into train/init_from: pipeline/stages.py)
    init_from: Annotated[Optional[str], Location("a drafter checkpoint or exported drafter directory")] = None
    # dflash only: tokens per block (the bonus token and block_size - 1 drafts; vLLM then serves k = block_size - 1),
    # drafter layers, block anchors drawn per packed row, and gamma of the loss weight exp(-(k - 1) / gamma) of block
    # offset k (the DFlash paper's Eq. 4: 7 for blocks of 16, 5 for 10, 4 for 8). It drafts over draft_vocab_size
    # ids with the target's lm_head rows, frozen (the target's whole vocab when draft_vocab_size is its size) and
    # fills its block with mask_token_id (None: the target's pad id, else its eos id). dspark: the same keys, its
    # block of block_size tokens drafting them all (vLLM serves k = block_size: eval.draft_tokens), weighed
    # exp(-k / gamma) from the first (speculators' gamma 4).
    block_size: Annotated[int, Range(ge=2, why="a DFlash block holds the bonus token and at least one draft; 16 "
                                               "in the paper")] = 16
    num_draft_layers: Annotated[int, Range(ge=1, why="DFlash drafter layers")] = 1
    num_anchors: Annotated[int, Range(ge=1, why="DFlash block anchors per packed row")] = 512
    position_decay: Annotated[float, Range(gt=0, why="gamma of the DFlash loss weight exp(-(k - 1) / gamma)")] = 7.0
    # dspark only: the rank r of its Markov head (markov_w1 and markov_w2, both [V, r]; speculators' default 256)
    markov_rank: Annotated[int, Range(ge=1, why="the DSpark Markov head's rank")] = 256

    def draft_steps(self) -> int:
        return draft_steps(self)


def draft_steps(drafter) -> int:
    """Draft positions one round of ``drafter`` (a DrafterConfig, or a stage's view of it) trains and scores:
    ttt_steps (eagle), block_size - 1 (dflash), block_size (dspark: its anchor drafts too). A function, so that a
    stage's declared reads see the three keys."""
    return {"dflash": drafter.block_size - 1, "dspark": drafter.block_size}.get(drafter.algorithm, drafter.ttt_steps)


@dataclass
class SourceConfig:
    path: Annotated[str, Location("a jsonl / json / parquet file, a local datasets dir or a hub dataset id")] = "???"
    weight: Annotated[float, Range(gt=0, why="the source's share of the mix; drop a source to leave it out")] = 1.0
    split: Annotated[str, Free("a split name of the source's own (a hub dataset's or a datasets dir's)")] = "train"
    max_samples: Annotated[Optional[int], Range(ge=1, why="rows read from the source; null: all")] = None


@dataclass
class PerturbConfig:
    fraction: Annotated[float, Range(ge=0, le=1, why="of training conversations")] = 0.0
    system_prompts: Annotated[list[str], Free("system prompts: any text")] = field(default_factory=list)
    eval_split: bool = True  # also write a perturbed copy of the eval split
    seed: Annotated[int, Range(ge=0)] = 0
    # data/prepare/perturb.py SYSTEM_MODES
    system_modes: Annotated[list[str], OneOf("none", "default", "list")] = \
        field(default_factory=lambda: ["none", "default", "list"])
    vary_date: bool = True  # draw a date_string template variable (Llama-3.1's date line)
    # other template variables to draw
    template_vars: Annotated[dict[str, list[str]], Free("a chat template's own variables and values")] = \
        field(default_factory=dict)


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    eval_sources: list[SourceConfig] = field(default_factory=list)  # empty -> split from sources
    eval_fraction: Annotated[float, Range(ge=0, lt=1, why="of the conversations held out for eval")] = 0.02
    max_length: Annotated[int, Range(ge=1, why="tokens per training row")] = 2048
    length_policy: Annotated[str, OneOf("truncate", "drop")] = "truncate"
    last_turn_only: bool = False
    thinking_in_mask: bool = True
    on_error: Annotated[str, OneOf("error", "skip")] = "error"
    num_proc: Annotated[int, Range(ge=1, why="tokenizer processes; 1: this one")] = 1
    seed: Annotated[int, Range(ge=0)] = 0
    perturb: PerturbConfig = field(default_factory=PerturbConfig)
    # a jinja file or string overriding the target tokenizer's template
    chat_template: Annotated[Optional[str], Location("a jinja file or template")] = None


@dataclass
class CaptureConfig:
    mode: Annotated[str, OneOf("offline", "online")] = "offline"  # feature store | target beside the drafter
    dtype: Annotated[str, OneOf("bf16", "fp8")] = "bf16"  # fp8: e4m3 with per-token scales; aux states only
    # per shard file (tests use fractions of a MiB)
    shard_size_mb: Annotated[float, Range(gt=0, why="MiB per shard file")] = 1024
    batch_tokens: Annotated[int, Range(ge=1, why="tokens per target forward")] = 16384
    # Rows longer than this are read in pieces of this many tokens through the target's own KV cache (states
    # equal to one forward; attention memory [chunk, T] instead of [T, T]); 0 = one forward per row.
    chunk_tokens: Annotated[int, Range(ge=0, why="tokens per piece of a long row; 0: one forward per row")] = 8192
    # e.g. "auto" to spread a big target over a node's GPUs (from_pretrained's strategies)
    device_map: Annotated[Optional[str], OneOf("auto", "balanced", "balanced_low_0", "sequential")] = None
    # Array-job capture (pipeline/slurm/capture_array.sbatch, `fledge submit capture --array N`): task i runs with
    # slice_index=i and captures samples [i*n/N, (i+1)*n/N) of each split; a later run with num_slices=N and no
    # slice_index merges the slices into one store. Neither is in the stage's inputs hash (the tasks share one stage
    # dir).
    num_slices: Annotated[int, Range(ge=1, why="slices of an array capture; 1: none")] = 1
    # < num_slices
    slice_index: Annotated[Optional[int], Range(ge=0, why="the slice this array task captures")] = None
    # Which engine computes the states (docs/serving.md, data/capture/engine.py): hf (an in-process transformers
    # forward) | vllm (vLLM's extract_hidden_states in its own environment, prefill only, same store).
    engine: Annotated[str, OneOf("hf", "vllm")] = "hf"
    # vllm: its python (default $FLEDGE_ENGINE_PYTHON, .engine/venv)
    engine_python: Annotated[Optional[str], Location("the engine's python")] = None
    # vllm: longest wait for one batch (engine start-up included)
    engine_timeout_s: Annotated[int, Range(ge=1, why="seconds to wait for one batch, the engine's start-up "
                                                     "included")] = 1800
    # vllm: GPUs per engine (one engine per Fledge rank)
    tensor_parallel_size: Annotated[int, Range(ge=1, why="GPUs per engine; 1: no tensor parallelism")] = 1
    expert_parallel: bool = False  # vllm: enable_expert_parallel (MoE experts over the TP x DP GPUs)
    # vllm: 1 = independent engine per rank; world size = one vLLM DP group
    data_parallel_size: Annotated[int, Range(ge=1, why="vLLM data-parallel ranks; 1: an engine per rank")] = 1
    # vllm + mode=online (data/capture/stream.py): global batches each rank's engine may run ahead of its trainer
    # (the stream buffer under <run>/train/stream/, at most this many batches of states on disk), and how often a
    # dead engine is started again from the trainer's data position before the run fails.
    buffer_batches: Annotated[int, Range(ge=1, why="batches the engine may run ahead of the trainer")] = 4
    engine_restarts: Annotated[int, Range(ge=0, why="restarts of a dead engine before the run fails; 0: none")] = 1
    # vllm + mode=online on a cluster (docs/slurm.md): the command prefix each engine's driver starts under, e.g.
    # srun into the engine nodes of a heterogeneous job ([] = a local process beside its trainer rank), and how
    # many consecutive trainer ranks share one engine (its leader, the group's first rank, starts it).
    engine_launcher: Annotated[list[str], Free("a command prefix: any program and its arguments")] = \
        field(default_factory=list)
    ranks_per_engine: Annotated[int, Range(ge=1, why="trainer ranks one engine serves")] = 1


@dataclass
class DeepSpeedConfig:
    zero_stage: Annotated[int, OneOf(0, 1, 2, 3)] = 2
    offload_optimizer: bool = False
    offload_param: bool = False
    # auto (bf16 on GPU, fp32 on CPU) | true | false (train/deepspeed_setup.py reads it in lower case)
    bf16: Annotated[str, OneOf("auto", "true", "false", casefold=True)] = "auto"
    # merged into the DeepSpeed json last
    extra: Annotated[dict[str, Any], Free("DeepSpeed's own json keys; DeepSpeed checks them")] = \
        field(default_factory=dict)


@dataclass
class OptimConfig:
    lr: Annotated[float, Range(gt=0, why="the peak learning rate")] = 1e-4
    betas: Annotated[list[float], Range(ge=0, lt=1, why="AdamW's decay rates")] = \
        field(default_factory=lambda: [0.9, 0.95])
    weight_decay: Annotated[float, Range(ge=0)] = 0.0
    grad_clip: Annotated[float, Range(ge=0, why="the gradient norm clipped to; 0: no clipping")] = 0.5
    warmup_steps: Annotated[int, Range(ge=0, why="steps of linear warmup; 0: none")] = 100
    schedule: Annotated[str, OneOf("cosine", "linear", "constant")] = "cosine"
    # the lr decays to min_lr_ratio x lr
    min_lr_ratio: Annotated[float, Range(ge=0, le=1, why="the final lr as a fraction of train.optim.lr")] = 0.0
    # adamw: AdamW on every parameter. muon: Muon on the drafter's hidden 2-D matrices (its Linear weights but the
    # lm_head), AdamW (the keys above) on the rest (train/optimizers.py); needs deepspeed.zero_stage <= 2 and no
    # deepspeed.offload_optimizer. Muon's update is scaled to AdamW's RMS (match_rms_adamw), so its lr is in
    # AdamW's units; both follow the lr schedule.
    name: Annotated[str, OneOf("adamw", "muon")] = "adamw"
    muon_lr: Annotated[Optional[float], Range(gt=0, why="Muon's peak lr; null: train.optim.lr")] = None
    muon_momentum: Annotated[float, Range(ge=0, lt=1, why="Muon's (Nesterov) momentum")] = 0.95
    muon_weight_decay: Annotated[float, Range(ge=0, why="Muon's decoupled weight decay")] = 0.1


@dataclass
class TrainConfig:
    max_steps: Annotated[int, Range(ge=0, why="optimizer steps; 0: train.epochs decides")] = 0
    epochs: Annotated[int, Range(ge=1, why="passes over the data when train.max_steps=0")] = 1
    micro_batch_tokens: Annotated[int, Range(ge=1, why="tokens per packed row")] = 8192
    micro_batch_size: Annotated[int, Range(ge=1, why="packed rows per micro-batch per rank")] = 1
    grad_accum: Annotated[int, Range(ge=1, why="micro-batches per optimizer step; 1: none accumulated")] = 1
    save_every: Annotated[int, Range(ge=1, why="steps between checkpoints; the last step always saves")] = 1000
    keep_last: Annotated[int, Range(ge=1, why="checkpoints kept")] = 2
    eval_every: Annotated[int, Range(ge=1, why="steps between held-out evals; the last step always evaluates, so "
                                               "train.eval_every=train.max_steps evaluates once at the end")] = 500
    # split over the data-parallel ranks (50 each on 8)
    eval_batches: Annotated[int, Range(ge=1, why="held-out global batches per eval")] = 400
    log_every: Annotated[int, Range(ge=1, why="steps between log lines")] = 10
    # consecutive optimizer steps skipped for a non-finite loss before aborting
    max_nonfinite: Annotated[int, Range(ge=1, why="non-finite steps in a row before the run stops")] = 5
    # Ranks that split each packed row (DeepSpeed-Ulysses; train/sequence_parallel.py): world = data parallel x
    # this; must divide the world and the drafter's num_key_value_heads. 1 = off.
    sequence_parallel: Annotated[int, Range(ge=1, why="1: off")] = 1
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class LoggingConfig:
    wandb_project: Annotated[Optional[str], Free("a W&B project name; W&B checks it")] = None
    wandb_run_name: Annotated[Optional[str], Free("a W&B display name: any text")] = None
    wandb_tags: Annotated[list[str], Free("W&B tags: any text")] = field(default_factory=list)
    # auto (online with credentials, else offline) | online | offline | disabled
    wandb_mode: Annotated[str, OneOf("auto", "online", "offline", "disabled")] = "auto"


@dataclass
class ExportConfig:
    checkpoint: Annotated[str, Location("best, last or a checkpoint directory")] = "best"
    # an export dialect (fledge/serving/dialects.py): hf | speculators | sglang
    format: Annotated[str, Elsewhere("serving/dialects.py (pipeline/preflight.py CONFIG_REGISTRIES)",
                                     "no_such_format")] = "hf"
    max_shard_size: Annotated[str, ByteSize()] = "5GB"
    # The publish stage (after eval) pushes the export with a card of that eval; token from HF_TOKEN only.
    push_to_hub: bool = False
    repo_id: Annotated[Optional[str], Free("a Hub repo id (org/name); the Hub checks it")] = None
    private: bool = True
    lint: bool = True


@dataclass
class EvalConfig:
    num_prompts: Annotated[int, Range(ge=1, why="prompts per eval set")] = 64
    draft_tokens: Annotated[int, Range(ge=1, why="draft tokens per speculative round, k")] = 5  # k, chain length
    max_new_tokens: Annotated[int, Range(ge=1, why="tokens generated per prompt")] = 128
    temperature: Annotated[float, Range(ge=0, why="0: greedy")] = 0.0
    sets: Annotated[list[str], Elsewhere("evaluation/eval_sets.py (pipeline/preflight.py CONFIG_REGISTRIES)",
                                         ["no_such_set"])] = \
        field(default_factory=lambda: ["default", "perturbed", "long"])
    # held-out per-step accuracy up to this many steps (0 -> 2K; a block drafter: its trained block at most)
    heldout_steps: Annotated[int, Range(ge=0, why="held-out draft steps scored; 0: 2 x drafter.ttt_steps")] = 0
    # the "long" set: prompts grown to about this many tokens with held-out context
    long_prompt_tokens: Annotated[int, Range(ge=1, why="tokens of a long-set prompt")] = 1024
    # outputs with a distinct-3-gram ratio below this count as degenerate (loops)
    degenerate_threshold: Annotated[float, Range(ge=0, le=1, why="a distinct-3-gram ratio")] = 0.5
    # draft depth of the attention-drift diagnostics (0 -> max(draft_tokens, 2K))
    drift_depth: Annotated[int, Range(ge=0, why="draft depth of the drift diagnostics; 0: max(k, 2K)")] = 0
    # prompt-lookup baseline: longest n-gram matched in the context
    lookup_max_ngram: Annotated[int, Range(ge=1, why="the lookup baseline's longest n-gram")] = 3
    # Acceptance vs context length (evaluation/long_context.py): prompt lengths in tokens, ascending (empty: off); the
    # same conversations cut to each, bucket_prompts of them, from long_context_source (a jsonl of
    # conversations with a long first user turn) or else the eval conversations grown with held-out context.
    context_buckets: Annotated[list[int], Range(ge=16, why="a prompt length in tokens")] = field(default_factory=list)
    bucket_prompts: Annotated[int, Range(ge=1, why="prompts per context bucket")] = 8
    long_context_source: Annotated[Optional[str], Location("a jsonl of long conversations")] = None
    # The serving engine in the loop (evaluation/engine_eval.py): hf = Fledge's in-process harness only; vllm also
    # serves the export with real vLLM (scripts/setup_engine.sh) and holds its AL to the in-process AL;
    # sglang runs only on CUDA GPUs.
    engine: Annotated[str, OneOf("hf", "vllm", "sglang")] = "hf"
    # max |engine AL - in-process AL| per set before the eval stage fails
    engine_al_tolerance: Annotated[float, Range(gt=0, why="an AL gap")] = 0.15
    # the engine's python (default $FLEDGE_ENGINE_PYTHON, .engine/venv)
    engine_python: Annotated[Optional[str], Location("the engine's python")] = None
    # prompts per engine generate call (0: the whole set at once)
    engine_batch_size: Annotated[int, Range(ge=0, why="prompts per engine call; 0: the whole set")] = 0
    engine_timeout_s: Annotated[int, Range(ge=1, why="seconds for the whole engine run")] = 1800
    # the eval.sets vLLM serves (empty: every set)
    engine_sets: Annotated[list[str], Elsewhere("Config.validate: a subset of eval.sets", ["no_such_set"])] = \
        field(default_factory=list)
    # false: the engine alone measures the prompt sets (a real target, whose in-process harness costs ~36 s a prompt
    # on 2 CPU cores); no in-process AL, drift or context buckets, and no engine-vs-in-process AL check
    in_process: bool = True
    # Named eval sets (evaluation/eval_sets.py): eval.sets may also name public benchmarks (mt_bench, gsm8k, humaneval,
    # alpaca, cnn_dm, math500, speed_bench_<category>, speed_bench_throughput_<n>k, longbench_v2), loaded by hub id
    # with `datasets` and rendered through the target's chat template; eval.num_prompts bounds each set's prompts.
    # <set name> -> local file/dir or org/name[@revision]
    set_paths: Annotated[dict[str, str], Location("a local file or directory, or org/name[@revision]")] = \
        field(default_factory=dict)
    # named sets: longest prompt (0: the target's max positions minus the generation)
    max_prompt_tokens: Annotated[int, Range(ge=0, why="0: the target's limit")] = 0
    # named sets, a longer prompt: truncate (cut its middle) | skip
    prompt_length_policy: Annotated[str, OneOf("truncate", "skip")] = "truncate"


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
    # set by the selected conf/recipe/<name>.yaml
    recipe: Annotated[str, Elsewhere("Hydra's recipe group (conf/recipe/<name>.yaml)", "no_such_recipe")] = "???"

    def validate(self) -> Config:
        """Each value in its field's domain (conf/domains.py), then the rules across keys; raises ValueError
        naming the key."""
        check_domains(self)
        check_rules(self)
        return self

    def aux_layer_ids(self) -> list[int]:
        """Boundary-convention ids of the captured target states (docs/architecture.md, Aux layer ids)."""
        if self.drafter.aux_layer_ids is not None:
            return list(self.drafter.aux_layer_ids)
        return default_aux_layer_ids(self.target.num_hidden_layers)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """(2, L//2, L-3): hidden_states[k] of a Hugging Face forward, k = layers applied so far."""
    return [2, num_layers // 2, num_layers - 3]
