"""Deterministic kernels (`[train] deterministic`): what a bit-exact resume needs from torch on GPUs.

Part of a rank's set-up in init() (rank/start.py): `set_environ` before torch (and so CUDA) starts, `apply`
next to the process group, and `explain` turns an operation without a deterministic kernel,
which ends the rank, into one line naming the switch. On CPU almost every kernel is
deterministic already (a few, e.g. index_put with accumulate, switch to a deterministic version);
on GPUs cuDNN's autotuning and atomic-add kernels make two runs differ in the last bits.
"""

from __future__ import annotations

import os
import re
import sys

from ddpjob.errors import DDPJobError
from ddpjob.node.cluster import ClusterEnv

CUBLAS_WORKSPACE = ":4096:8"  # NVIDIA's reproducible setting (":16:8" too: less memory, slower)
_NO_KERNEL = re.compile(r"(\S+) does not have a deterministic implementation, but you set "
                        r"'torch\.use_deterministic_algorithms\(True\)'")
_SWITCH_OFF = ("set train.deterministic = false (--set train.deterministic=false): a resumed run "
               "is then close to, not bit-equal to, the uninterrupted one")


def set_environ(deterministic: bool, env: ClusterEnv) -> None:
    """cuBLAS may pick other internal implementations from run to run when its workspace is
    not fixed by this variable (NVIDIA's cuBLAS docs, "Results reproducibility"); torch reads it
    when it creates its first cuBLAS workspace, and older torch versions refuse every CUDA
    matmul under deterministic algorithms without it. So it must be in the environment
    before the first CUDA matmul: init() runs before any model code and sets it for this
    process and the processes it starts. A value the user exported (e.g. ":16:8") wins."""
    if deterministic and env.cublas_workspace_config is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE


def apply(deterministic: bool) -> None:
    """Set torch's kernel choice for this process, both ways (a later init in the same process,
    e.g. a test, must not inherit the other setting).

    On: cuDNN only deterministic algorithms and no autotuning (benchmark = False: the fastest
    algorithm found by timing can differ between two starts), and every other op on its
    deterministic kernel. warn_only=False, deliberately: a warning in one rank log among many
    is never read, and the run it marks would silently stop being bit-exact at its next
    resume; an error comes at the first step that uses such an op (minutes into the first
    attempt, not at a resume days later) and `explain` turns it into one line naming
    train.deterministic.
    Not torch's fill of uninitialised memory (torch.utils.deterministic.fill_uninitialized_memory,
    on by default under deterministic algorithms): it writes NaN into every tensor torch.empty
    hands out, which only matters to a kernel that reads memory it never wrote (a bug, not a
    source of run-to-run differences in a correct model), and it cost 83 extra fill_ calls
    per step of cnn_tiny on CPU, 13% more operator time (one torch.profiler run).
    Off: cudnn.benchmark = True, which times the convolution algorithms once per input shape
    and keeps the fastest."""
    import torch
    import torch.utils.deterministic

    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic
    native = getattr(torch._C, "_set_deterministic_algorithms", None)
    if "torch._inductor.config" in sys.modules or native is None:
        torch.use_deterministic_algorithms(deterministic, warn_only=False)
    else:
        # torch.use_deterministic_algorithms imports torch._inductor (and with it dynamo and
        # sympy: 2-4 s of every rank's start, so of every restart after a crash) only to set
        # inductor's `deterministic`, which reads TORCHINDUCTOR_DETERMINISTIC when first
        # imported: the same setting, made when (if ever) something compiles.
        os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1" if deterministic else "0"
        native(deterministic, warn_only=False)
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]


def explain(exc: BaseException) -> BaseException:
    """The error to report for an exception that ends the rank: torch's refusal of an
    operation without a deterministic kernel becomes one line with the fix; anything else is
    returned as it is."""
    if not isinstance(exc, RuntimeError):
        return exc
    text = str(exc)
    found = _NO_KERNEL.search(text)
    if found:
        return DDPJobError(f"the operation {found.group(1)} has no deterministic kernel on this device, "
                           "expected only deterministic ones with train.deterministic = true (the "
                           "default, for bit-exact resume)",
                           f"{_SWITCH_OFF}; or replace the operation in the model")
    if "CUBLAS_WORKSPACE_CONFIG" in text and "deterministic" in text.lower():
        return DDPJobError("cuBLAS is not deterministic with the CUBLAS_WORKSPACE_CONFIG this rank "
                           f"inherited, expected {CUBLAS_WORKSPACE} or :16:8 with train.deterministic "
                           "= true", f"unset it (ddpjob then sets {CUBLAS_WORKSPACE}) or export "
                           f"CUBLAS_WORKSPACE_CONFIG=:16:8; or {_SWITCH_OFF}")
    return exc
