"""The compute dtype on CPU: bf16 only where the CPU has native bf16, fp32 everywhere else.

Without native bf16 (AVX2-only and plain AVX-512 CPUs) torch emulates bf16 matmuls: on a 2-core AVX2
EPYC a bf16 matmul ran at 0.7 GFLOP/s against 53 GFLOP/s in fp32, so a bf16 request there is honoured
by computing in fp32 instead. Only the *compute* dtype is decided here; stored dtypes (bf16 / fp8 feature
stores, bf16 exports, a bf16 checkpoint on disk) are the caller's business and do not change. CUDA is
never touched by this rule.

Detection (``cpu_bf16_native``), in order:
1. ``FLEDGE_CPU_BF16=1`` / ``=0`` forces yes / no (tests force "no" to prove no path computes in bf16).
2. Linux: the CPU flags in /proc/cpuinfo: x86 ``avx512_bf16`` or ``amx_bf16``, Arm ``bf16`` (Armv8.6); on x86
   only while the process may use them (``_isa_limit``: not under ``ATEN_CPU_CAPABILITY=avx2`` or an
   ``ONEDNN_MAX_CPU_ISA`` without bf16, which is how an AVX2-only machine is reproduced on a newer one).
3. Anything else (macOS, Windows, an unreadable /proc): no, so fp32 (always correct, never pathological).

Why not torch's own checks: ``torch.backends.cpu.get_cpu_capability()`` stops at ``AVX512`` (it reports
that on an AMX Sapphire Rapids too, and on a Skylake without bf16), torch 2.13 has no
``torch._C._cpu._is_avx512_bf16_supported``, and ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` only
checks AVX512BW/VL/DQ, which Skylake has without native bf16. A timed matmul would tell, but it costs
start-up time and its verdict wobbles on busy shared cores; the flags are exact and free.

The decision is logged once per process, with its reason; each place that falls back to fp32 warns once,
naming the config key that asked for bf16.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV_VAR = "FLEDGE_CPU_BF16"
CPUINFO = Path("/proc/cpuinfo")
# CPU flags that mean bf16 matmuls run in hardware (x86: AVX512-BF16 dot products, AMX tiles; Arm: BFMMLA).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

_announced: set[tuple[bool, str]] = set()
_warned: set[str] = set()


def native_bf16_flags(cpuinfo_text: str) -> list[str]:
    """The native-bf16 flags among the CPU flags of a /proc/cpuinfo text (x86 ``flags``, Arm ``Features``)."""
    flags: set[str] = set()
    for line in cpuinfo_text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return [f for f in NATIVE_BF16_FLAGS if f in flags]


@functools.lru_cache(maxsize=1)
def _detect() -> tuple[bool, str]:
    """What the hardware says (cached: the CPU does not change under a running process)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return False, (f"no {CPUINFO} on {platform.system() or 'this OS'} to read the CPU flags from; "
                       f"assuming no native bf16 ({ENV_VAR}=1 overrides)")
    found = native_bf16_flags(text)
    limit = _isa_limit(found)
    if found and limit:
        return False, f"the CPU has native bf16 ({', '.join(found)} in {CPUINFO}) but {limit}"
    if found:
        return True, f"the CPU has native bf16 ({', '.join(found)} in {CPUINFO})"
    return False, (f"the CPU has no native bf16 (no {' / '.join(NATIVE_BF16_FLAGS)} flag in {CPUINFO}; "
                   f"torch.backends.cpu.get_cpu_capability()={torch.backends.cpu.get_cpu_capability()})")


def _isa_limit(flags: list[str]) -> str | None:
    """Why torch will not use the native-bf16 instructions behind ``flags`` in this process, or None: the ISA
    limits a user (or a test emulating an AVX2-only machine) sets, ``ATEN_CPU_CAPABILITY`` below avx512 for
    torch's own kernels and ``ONEDNN_MAX_CPU_ISA`` without bf16 for oneDNN's matmuls. bf16 then runs emulated,
    as on a CPU without the flags."""
    if any(f in flags for f in ("avx512_bf16", "amx_bf16")):
        cap = torch.backends.cpu.get_cpu_capability()
        if cap != "AVX512":
            return f"torch's CPU capability is {cap} (ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '')})"
        isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
        if isa and isa not in ("ALL", "DEFAULT") and not any(t in isa for t in ("BF16", "AMX", "AVX10")):
            return f"ONEDNN_MAX_CPU_ISA={isa} keeps oneDNN from bf16 instructions"
    return None


def describe_cpu() -> str:
    """One line naming this CPU for timing records: model name, torch's capability, native bf16 flags."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        text = ""
    name = next((line.partition(":")[2].strip() for line in text.splitlines()
                 if line.lower().startswith("model name")), platform.processor() or platform.machine())
    flags = native_bf16_flags(text)
    return (f"{name}, {os.cpu_count()} cores, capability {torch.backends.cpu.get_cpu_capability()}, "
            f"native bf16: {', '.join(flags) if flags else 'none'}")


def cpu_bf16_native() -> tuple[bool, str]:
    """(whether bf16 may be computed on this CPU, why). ``FLEDGE_CPU_BF16`` overrides the detection; it is
    read on every call so a test can flip it. Logs the decision the first time it is made."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced in _TRUE:
        decision = (True, f"forced by {ENV_VAR}={os.environ[ENV_VAR]}")
    elif forced in _FALSE:
        decision = (False, f"forced by {ENV_VAR}={os.environ[ENV_VAR]}")
    elif forced:
        raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: expected 1 (bf16 allowed on CPU) or 0 (fp32 only), "
                         "or unset to detect")
    else:
        decision = _detect()
    if decision not in _announced:
        _announced.add(decision)
        log.info("CPU compute: bf16 %s: %s", "allowed" if decision[0] else "off, bf16 requests compute in float32",
                 decision[1])
    return decision


def compute_dtype(requested: torch.dtype, device: torch.device | str, key: str) -> torch.dtype:
    """The dtype to compute in on ``device`` when ``key`` (the config key or code path asking, named in the
    warning) requests ``requested``: float32 instead of bfloat16 on a CPU without native bf16; otherwise
    ``requested`` unchanged (CUDA, fp32, fp16 and native-bf16 CPUs)."""
    if torch.device(device).type != "cpu" or requested != torch.bfloat16:
        return requested
    native, why = cpu_bf16_native()
    if native:
        return requested
    if key not in _warned:
        _warned.add(key)
        log.warning("%s asks for bfloat16 compute on CPU, but %s: computing in float32 instead (stored dtypes are "
                    "unchanged; %s=1 forces bf16)", key, why, ENV_VAR)
    return torch.float32


def cast_for_compute(model: torch.nn.Module, device: torch.device | str, key: str) -> torch.nn.Module:
    """``model`` (floating parameters of one dtype, on ``device``) cast in place to ``compute_dtype`` of its
    dtype; a bf16 model loaded on a CPU without native bf16 becomes fp32 (lossless: bf16 is a prefix of fp32)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is not None:
        want = compute_dtype(dtype, device, key)
        if want != dtype:
            model.to(want)
    return model
