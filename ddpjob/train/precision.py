"""The built-in trainer's choices of precision and compile mode for the device it runs on
(train/trainer.py asks): train.amp as a dtype, "auto" measured once per run (bf16 or fp32,
whichever steps faster here, kept in the checkpoint), and train.compile_mode "auto".
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Protocol

import torch
import torch.nn as nn

from ddpjob.api import Job
from ddpjob.config import JobConfig
from ddpjob.train import models


class AmpChoice(Protocol):
    """Where the run keeps its precision once chosen (the trainer's Progress, checkpointed)."""

    amp: str | None


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # compile modes that record CUDA graphs


def compile_mode_for(mode: str, device: torch.device) -> str:
    """train.compile_mode = "auto": CUDA graphs on a GPU, where a step of a few hundred small
    kernels waits on their launches (bench P8); torch's default on a CPU, which has no graphs."""
    if mode != "auto":
        return mode
    return "reduce-overhead" if device.type == "cuda" else "default"


AUTO_FP32_MARGIN = 1.10  # amp = "auto" takes fp32 only when it is at least this much faster


def resolve_auto_amp(job: Job, progress: AmpChoice, amp_dtype: torch.dtype | None, loader: Any, *,
                     resumed: bool) -> tuple[torch.dtype | None, str]:
    """train.amp = "auto" on a GPU or CPU that has bf16: bf16 or fp32, whichever trains this model
    at this batch faster on this device (a launch-bound step can run faster in fp32, whose
    convolutions take TF32 tensor cores and launch no casting kernels; on a CPU with AVX512-BF16
    or AMX a small model can still lose in bf16 to the casts). Decided once, when the run begins, and
    kept in the checkpoint (the trainer's Progress.amp, as a train.amp value): a resume computes in the same
    precision, on any GPU. Returns the dtype and a line for the log ("" when nothing was chosen)."""
    cfg = job.config
    t = cfg.train
    if t.amp != "auto" or amp_dtype is None or t.strategy != "ddp":
        return amp_dtype, ""  # fixed by the job file, no bf16 on this device, or FSDP's own policy
    if progress.amp is not None:
        note = "as chosen when the run began (checkpoint)"
    elif resumed:  # a checkpoint from before the choice was measured: auto meant bf16 then
        progress.amp, note = "bf16", "the checkpoint predates the measured choice"
    else:
        ms = time_precisions(cfg, job.device, loader)
        job.all_reduce(ms)  # every rank decides on the same sums: one precision for all
        bf16_ms, fp32_ms = (v / job.world_size for v in ms.tolist())
        progress.amp = "off" if bf16_ms > AUTO_FP32_MARGIN * fp32_ms else "bf16"
        note = (f"a training step measured {bf16_ms:.1f} ms in bf16, {fp32_ms:.1f} ms in fp32; fp32 "
                f"needs to be {AUTO_FP32_MARGIN:.2f}x faster")
    dtype = amp_dtype_for(progress.amp, job.device)
    return dtype, f"amp auto: {'fp32' if dtype is None else 'bf16'} ({note})"


def time_precisions(cfg: JobConfig, device: torch.device, loader: Any) -> torch.Tensor:
    """Milliseconds per forward + backward in bf16 and in fp32, on a fresh copy of the model (the
    trained one keeps its BatchNorm statistics and compiles nothing extra) and the run's first
    micro-batch: the median of 5 turns of 5 steps each, the turns alternating so that a busy
    moment of the host (which launches the kernels) hits both. All RNG states are kept."""
    t = cfg.train
    fmt = torch.channels_last if t.channels_last else torch.contiguous_format
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        copy = models.build_model(t.model, t.num_classes, cifar_stem=t.cifar_stem,
                                  freeze_backbone=t.freeze_backbone).to(device)
        copy.to(memory_format=fmt)  # as the trained model
        x, y = next(iter(loader.batches(0)))[0]
        loss_fn = nn.CrossEntropyLoss(label_smoothing=t.label_smoothing)
        turns: dict[torch.dtype | None, list[float]] = {torch.bfloat16: [], None: []}

        def step(dtype: torch.dtype | None) -> None:
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = loss_fn(copy(x), y)
            loss.backward()
            copy.zero_grad(set_to_none=True)

        for dtype in (torch.bfloat16, None, torch.bfloat16, None):  # warm-up: kernels, workspaces
            step(dtype)

        def sync() -> None:  # a GPU runs ahead of the host; a CPU step is done when it returns
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        for _ in range(5):
            for dtype in (torch.bfloat16, None):
                sync()
                t0 = time.perf_counter()
                for _ in range(5):
                    step(dtype)
                sync()
                turns[dtype].append(200 * (time.perf_counter() - t0))  # ms per step
        del copy
    return torch.tensor([statistics.median(turns[torch.bfloat16]), statistics.median(turns[None])],
                        dtype=torch.float64, device=device)


def amp_dtype_for(amp: str, device: torch.device) -> torch.dtype | None:
    """auto = bf16 where the hardware does bf16 natively (CUDA >= Ampere, CPUs with
    AVX512-BF16/AMX), else full precision; fp16 always means autocast + GradScaler."""
    if amp == "off":
        return None
    if amp == "fp16":
        return torch.float16
    if amp == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if cpu_has_native_bf16() else None


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def dtype_name(d: torch.dtype | None) -> str:
    return {None: "off", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(d, str(d))
