"""v15: on vLLM's CPU platform, a KV cache block size of 32 instead of speculators' fixed 16.

vLLM 0.29.0 (CPU build; check-upstream found it there, the symptom was first seen on 0.32.0):
vllm/v1/attention/backends/cpu_attn.py's `CPUAttentionBackend.get_supported_kernel_block_sizes()`
returns `[MultipleOf(32)]` (earlier releases only preferred multiples of 32, with a warning), and vllm/v1/worker/utils.py
`select_common_block_size` then refuses speculators 0.3.0's `VLLM_BLOCK_SIZE = 16`:
`ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)])`. Other platforms keep 16
(CUDA backends accept it; a CPU MLA model is forced back to 16 by vLLM's CPU platform itself).
The constant is what CacheConfig(block_size=...) and v3's Scheduler(block_size=...) both read.
"""

from __future__ import annotations

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod, import_after_last_vllm_import, imported_names
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import GENERATOR, SPECULATORS_0_3_OR_0_4

CONSTANT = "VLLM_BLOCK_SIZE"
CPU_BLOCK_SIZE = 32
PLATFORMS = "vllm.platforms"

# The first vLLM whose CPU attention takes only multiples of 32 (check-upstream's gate).
CPU_BLOCK_SIZE_SINCE = {"vllm": ">=0.29.0"}

CONSTANT_ASSIGNMENT = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name(CONSTANT))])])
# Ours, not any conditional: speculators 0.4.0 has `128 if is_npu_available() else 16` (16 on CPU).
IS_CPU_TEST = m.Call(func=m.Attribute(value=m.Name("current_platform"), attr=m.Name("is_cpu")))
PATCHED_ASSIGNMENT = m.SimpleStatementLine(
    body=[m.Assign(targets=[m.AssignTarget(target=m.Name(CONSTANT))], value=m.IfExp(test=IS_CPU_TEST))]
)


class CpuBlockSize(PatchCodemod):
    """Top-level `VLLM_BLOCK_SIZE = X` -> `VLLM_BLOCK_SIZE = 32 if current_platform.is_cpu() else X`,
    importing current_platform from vllm.platforms. Patched: the constant already asks is_cpu()."""

    ANCHOR = f"a top-level assignment {CONSTANT} = ..."

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        body = list(updated.body)
        if any(m.matches(s, PATCHED_ASSIGNMENT) for s in body):
            self.found_patched()
            return updated
        index = next((i for i, s in enumerate(body) if m.matches(s, CONSTANT_ASSIGNMENT)), None)
        if index is None:
            return updated
        self.rewrote()
        statement = body[index]
        value = cst.Module([]).code_for_node(statement.body[0].value)
        conditional = cst.parse_expression(f"{CPU_BLOCK_SIZE} if current_platform.is_cpu() else {value}")
        body[index] = statement.with_changes(body=[statement.body[0].with_changes(value=conditional)])
        if (PLATFORMS, "current_platform") not in imported_names(body):
            body = import_after_last_vllm_import(
                body, cst.parse_statement(f"from {PLATFORMS} import current_platform\n")
            )
        return updated.with_changes(body=body)


PATCH = Patch(
    id="v15-cpu-block-size",
    title="KV cache block size 32 on vLLM's CPU platform (its attention takes multiples of 32 only)",
    target=GENERATOR,
    requires=SPECULATORS_0_3_OR_0_4,
    edits=(
        Edit(
            CpuBlockSize,
            when=CPU_BLOCK_SIZE_SINCE,
            answers="CPUAttentionBackend.get_supported_kernel_block_sizes returns [MultipleOf(32)]",
            fact=Fact(
                "returns-value",
                "vllm.v1.attention.backends.cpu_attn",
                "CPUAttentionBackend.get_supported_kernel_block_sizes",
                value="[MultipleOf(32)]",
                needs=(Fact("defines", "vllm.platforms.interface", "Platform", "is_cpu"),),
            ),
        ),
    ),
    examples=(
        Example(
            before="""
                from vllm.v1.request import Request, RequestStatus

                from .logging_utils import PipelineLogger

                VLLM_BLOCK_SIZE = 16  # Block size for KV cache
            """,
            after="""
                from vllm.v1.request import Request, RequestStatus
                from vllm.platforms import current_platform

                from .logging_utils import PipelineLogger

                VLLM_BLOCK_SIZE = 32 if current_platform.is_cpu() else 16  # Block size for KV cache
            """,
        ),
        # speculators 0.4.0's own conditional (16 on CPU) is kept for the other platforms
        Example(
            before="""
                VLLM_BLOCK_SIZE = 128 if is_npu_available() else 16  # Block size for KV cache
            """,
            after="""
                from vllm.platforms import current_platform
                VLLM_BLOCK_SIZE = 32 if current_platform.is_cpu() else 128 if is_npu_available() else 16  # Block size for KV cache
            """,
        ),
        # current_platform already imported: only the constant changes
        Example(
            before="""
                from vllm.platforms import current_platform
                VLLM_BLOCK_SIZE = 64
            """,
            after="""
                from vllm.platforms import current_platform
                VLLM_BLOCK_SIZE = 32 if current_platform.is_cpu() else 64
            """,
        ),
    ),
    satisfied=(
        "from vllm.platforms import current_platform\nVLLM_BLOCK_SIZE = 32 if current_platform.is_cpu() else 16\n",
    ),
    near_misses=(
        # VLLM_BLOCK_SIZE imported, not assigned at the top of this module
        """
            from speculators.data_generation.config import VLLM_BLOCK_SIZE
        """,
    ),
    upstream="vLLM 0.29.0: vllm/v1/attention/backends/cpu_attn.py (get_supported_kernel_block_sizes "
    "returns [MultipleOf(32)]), vllm/v1/worker/utils.py (select_common_block_size)",
    without_it="without it on vLLM's CPU build from 0.29: `No common block size for 16 (CPU_ATTN: [MultipleOf(32)])` while the workers start (block size 32 on the CPU platform, 16 elsewhere)",
    leave_one_out=(
        LeaveOneOut("0.32.0", Symptom("init", messages=("No common block size for 16",))),
        LeaveOneOut("0.29.0", Symptom("init", "RuntimeError", ("No common block size for 16",))),
        LeaveOneOut("0.32.0", Symptom("init", "RuntimeError", ("No common block size for 16",)), speculators="0.4.0.1"),
    ),
)
