"""The CPU compute-dtype rule (models/precision.py).

With native bf16 forced off (FLEDGE_CPU_BF16=0, what an AVX2-only CPU gets), no CPU path may compute in
bf16: the tiny target's build, FrozenTarget.load with target.dtype auto / bfloat16 (capture and eval),
eval's drafter and target, the in-process regenerate backend, DeepSpeed's bf16. Forced on, bf16 is allowed
where it is asked for, except the tiny target build and eval, which compute fp32 on every CPU so their
numbers do not depend on the CPU. "Computes in" is measured, not read off the config: every nn.Linear's
output dtype is recorded (under autocast, fp32 weights give bf16 outputs, so autocast shows too)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest
import torch

from fledge.conf import compose
from fledge.distributed import World
from fledge.models import precision

CPU = World(0, 1, 0, torch.device("cpu"))
SPR = "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile\nmodel name\t: Xeon\n"
SKYLAKE = "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512dq avx512vl\n"  # AVX-512 but bf16 is emulated
EPYC_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"
GRAVITON3 = "Features\t: fp asimd sve bf16 i8mm\n"


@pytest.fixture
def force(monkeypatch):
    """force("0") / force("1"): what the capability check says, with the log-once memory cleared."""
    monkeypatch.setattr(precision, "_warned", set())
    monkeypatch.setattr(precision, "_announced", set())

    def set_(value: str) -> None:
        monkeypatch.setenv(precision.ENV_VAR, value)
    return set_


@contextlib.contextmanager
def linear_compute_dtypes():
    """Record the dtype every nn.Linear call produced (and whether autocast was on): what was computed."""
    seen: list[tuple[torch.dtype, bool]] = []
    orig = torch.nn.Linear.forward

    def spy(self, x):
        out = orig(self, x)
        seen.append((out.dtype, torch.is_autocast_enabled("cpu")))
        return out

    torch.nn.Linear.forward = spy
    try:
        yield seen
    finally:
        torch.nn.Linear.forward = orig


def assert_fp32(seen):
    assert seen, "no nn.Linear ran: the spy saw nothing"
    assert {d for d, _ in seen} == {torch.float32} and not any(a for _, a in seen), set(seen)


def tiny_cfg(path, *overrides):
    return compose(["recipe=tiny", f"target.name_or_path={path}", *overrides])


# ------------------------------------------------------------------------------------------ the rule
def test_native_bf16_is_read_from_the_cpu_flags():
    assert precision.native_bf16_flags(SPR) == ["avx512_bf16", "amx_bf16"]
    assert precision.native_bf16_flags(GRAVITON3) == ["bf16"]
    assert precision.native_bf16_flags(SKYLAKE) == [] and precision.native_bf16_flags(EPYC_AVX2) == []
    assert precision.native_bf16_flags("") == []


def test_detection_without_override(force, monkeypatch, tmp_path):
    monkeypatch.delenv(precision.ENV_VAR, raising=False)
    monkeypatch.setattr(precision, "_isa_limit", lambda flags: None)  # this process's ISA limits: next test
    for text, want in ((SPR, True), (EPYC_AVX2, False), (SKYLAKE, False)):
        (tmp_path / "cpuinfo").write_text(text)
        monkeypatch.setattr(precision, "CPUINFO", tmp_path / "cpuinfo")
        precision._detect.cache_clear()
        assert precision.cpu_bf16_native()[0] is want
    monkeypatch.setattr(precision, "CPUINFO", tmp_path / "missing")  # macOS, Windows: no /proc -> fp32
    precision._detect.cache_clear()
    native, why = precision.cpu_bf16_native()
    assert native is False and precision.ENV_VAR in why
    precision._detect.cache_clear()  # the real CPU again for later tests


def test_isa_limits_turn_native_bf16_off(force, monkeypatch, tmp_path):
    """ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 on a CPU with avx512_bf16 (how the AVX2-only machine is
    reproduced on a newer one): torch and oneDNN emulate bf16 there, so bf16 requests compute in fp32."""
    monkeypatch.delenv(precision.ENV_VAR, raising=False)
    (tmp_path / "cpuinfo").write_text(SPR)
    monkeypatch.setattr(precision, "CPUINFO", tmp_path / "cpuinfo")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    for cap, isa, want in (("AVX512", None, True), ("AVX2", None, False), ("AVX512", "AVX2", False),
                           ("AVX512", "AVX512_CORE_AMX", True), ("AVX512", "avx512_core_bf16", True),
                           ("DEFAULT", "ALL", False)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda cap=cap: cap)
        if isa:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        else:
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        precision._detect.cache_clear()
        native, why = precision.cpu_bf16_native()
        assert native is want, (cap, isa, why)
        if not want:
            assert "but" in why and (cap in why or isa.upper() in why), why
    assert precision._isa_limit(["bf16"]) is None  # Arm's flag: torch's x86 capability says nothing of it
    precision._detect.cache_clear()  # the real CPU again for later tests


def test_override_and_rule(force, caplog):
    force("0")
    bf, f32 = torch.bfloat16, torch.float32
    with caplog.at_level(logging.INFO, logger="fledge.models.precision"):
        assert precision.compute_dtype(bf, "cpu", "some.key=bfloat16") == f32
        assert precision.compute_dtype(bf, "cpu", "some.key=bfloat16") == f32
    assert sum("some.key=bfloat16" in r.message for r in caplog.records) == 1  # warned once, naming the key
    assert sum("CPU compute: bf16 off" in r.message for r in caplog.records) == 1  # the choice, logged once
    assert precision.compute_dtype(f32, "cpu", "k") == f32
    assert precision.compute_dtype(torch.float16, "cpu", "k") == torch.float16  # the rule is about bf16
    assert precision.compute_dtype(bf, torch.device("cuda", 0), "k") == bf  # CUDA untouched
    force("1")
    assert precision.compute_dtype(bf, "cpu", "k") == bf
    force("maybe")
    with pytest.raises(ValueError, match=precision.ENV_VAR):
        precision.compute_dtype(bf, "cpu", "k")


# ------------------------------------------------------------------------------------------ the paths
@pytest.mark.parametrize("native", ["0", "1"])
def test_tiny_target_build_computes_fp32_on_every_cpu(force, native, random_tiny_target, tiny_data):
    """train_target and the builder's evaluate (the whole build but its save) are fp32 whatever the CPU."""
    from transformers import AutoTokenizer

    from fledge.testbed import tiny_target, tiny_tasks, tiny_writer

    force(native)
    tok = AutoTokenizer.from_pretrained(random_tiny_target)
    batches = tiny_writer._batches(tok, tiny_tasks.stream(1), 32, 1)
    with linear_compute_dtypes() as seen:
        model = tiny_target.train_target(tiny_writer.new_model("llama", tok), batches, steps=2, lr=1e-3, warmup=1)
    assert_fp32(seen)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with linear_compute_dtypes() as seen:
        metrics = tiny_writer.evaluate(Path(random_tiny_target), tiny_data, max_new_tokens=4, n_prompts=1, n_heldout=4)
    assert_fp32(seen)
    assert metrics["heldout_tokens"] > 0


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_frozen_target_follows_the_rule_on_cpu(force, dtype, random_tiny_target):
    """Capture's (and eval's) target load: the tiny target is bf16 on disk, so both settings ask for bf16."""
    from fledge.models.target import FrozenTarget

    tcfg = tiny_cfg(random_tiny_target, f"target.dtype={dtype}").target
    x = torch.randint(0, 2560, (1, 9), generator=torch.Generator().manual_seed(0))
    force("0")
    target = FrozenTarget.load(tcfg, torch.device("cpu"), [2, 4, 5])
    with linear_compute_dtypes() as seen:
        aux, final, _ = target.capture(x)
    assert_fp32(seen)
    assert aux.dtype == final.dtype == torch.float32
    force("1")
    target = FrozenTarget.load(tcfg, torch.device("cpu"), [2, 4, 5])
    aux, final, _ = target.capture(x)
    assert target.model.dtype == aux.dtype == final.dtype == torch.bfloat16
    float_target = FrozenTarget.load(tiny_cfg(random_tiny_target, "target.dtype=float32").target,
                                     torch.device("cpu"), [2, 4, 5])
    assert float_target.model.dtype == torch.float32  # an explicit fp32 is fp32 on every CPU


@pytest.mark.parametrize("native", ["0", "1"])
def test_eval_computes_fp32_on_cpu(force, native, random_tiny_target, tmp_path):
    from transformers import AutoModelForCausalLM

    from fledge.evaluation.evaluate import load_eval_models
    from fledge.evaluation.speculative import DrafterProposer, TargetRunner, speculative_decode
    from fledge.models.drafter_checkpoint import DrafterCheckpoint
    from fledge.models.families import text_config_dict as target_config_dict
    from fledge.serving.export import write_drafter
    from fledge.serving.serving_config import serving_config
    from tests.helpers.models import random_drafter

    target = AutoModelForCausalLM.from_pretrained(random_tiny_target, dtype=torch.float32)
    drafter = random_drafter(target, vd=256)
    spec = drafter.spec.to_dict()
    write_drafter(tmp_path / "drafter", drafter.state_dict(),
                  serving_config(target_config_dict(target.config), spec, spec["aux_layer_ids"], 256),
                  DrafterCheckpoint(drafter.spec))
    force(native)
    frozen, loaded = load_eval_models(tiny_cfg(random_tiny_target, "target.dtype=auto").target, tmp_path / "drafter",
                                      torch.device("cpu"), drafter.spec)
    runner = TargetRunner(frozen.model, spec["aux_layer_ids"])
    with linear_compute_dtypes() as seen:
        res = speculative_decode(runner, DrafterProposer(loaded), [1, 5, 9, 14], 3, 6, [])
    assert_fp32(seen)
    assert res.tokens


def test_regenerate_in_process_follows_the_rule(force, random_tiny_target):
    from fledge.data.prepare.regenerate import TransformersBackend

    force("0")
    assert TransformersBackend.from_pretrained(str(random_tiny_target)).model.dtype == torch.float32
    force("1")
    assert TransformersBackend.from_pretrained(str(random_tiny_target)).model.dtype == torch.bfloat16


def test_deepspeed_bf16_true_on_cpu_follows_the_rule(force, caplog):
    from fledge.pipeline.stages import train_inputs
    from fledge.train.deepspeed_setup import deepspeed_config, use_bf16

    cfg = compose(["recipe=tiny", "deepspeed.bf16=true"])
    force("0")
    with caplog.at_level(logging.WARNING, logger="fledge.models.precision"):
        assert use_bf16(cfg.deepspeed, CPU) is False
    assert any("deepspeed.bf16=true" in r.message for r in caplog.records)
    assert deepspeed_config(train_inputs(cfg), CPU)["bf16"]["enabled"] is False
    force("1")
    assert use_bf16(cfg.deepspeed, CPU) is True and deepspeed_config(train_inputs(cfg), CPU)["bf16"]["enabled"] is True
    cuda = World(0, 1, 0, torch.device("cuda", 0))
    force("0")
    assert use_bf16(cfg.deepspeed, cuda) is True  # CUDA keeps what it is told
    tiny = compose(["recipe=tiny"]).deepspeed
    assert use_bf16(tiny, CPU) is False and use_bf16(tiny, cuda) is True
