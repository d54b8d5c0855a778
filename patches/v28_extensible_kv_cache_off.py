"""v28: build CacheConfig with enable_extensible_kv_cache=False: the workers back every KV block.

vLLM 0.34.0: vllm/config/cache.py adds `CacheConfig.enable_extensible_kv_cache` (None), which
`VllmConfig._resolve_extensible_kv_cache` turns on wherever CUDA or ROCm runs. The worker's
`initialize_from_config` then only reserves address space for the KV cache
(vllm/v1/worker/extensible_kv_cache.py: `ExtensibleKVCache.allocate` commits the null block, which
backs each layer's first 2 MiB granule); vLLM's engine core backs the rest after warm-up
(vllm/v1/engine/core.py: `compile_or_warm_up_model`, `finalize_extensible_kv_cache`,
`extend_kv_cache`). speculators' generator sizes the cache itself and calls only
`initialize_from_config`, so its scheduler hands out block ids the workers never backed: the
first step whose blocks pass the first granule (the tiny Llama's 8 KiB blocks: about 256; a
call of eleven prompts of 900-1000 tokens needs about 650) kills the worker, `CUDA error
(.../hopper/flash_fwd_launch_template.h:200): an illegal memory access was encountered`.
Turned off, the worker allocates all `num_blocks` blocks in `initialize_from_config`, as every
release before 0.34.0 did; the generator's own sizing (a fraction of the free memory) is what
the extensible cache would replace by a measurement after warm-up, a step the generator never runs.
"""

from __future__ import annotations

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod, append_arg, keyword_arg
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import GENERATOR, SPECULATORS_0_3_OR_0_4

CACHE_CONFIG_CALL = m.Call(func=m.Name("CacheConfig"))
KEYWORD = "enable_extensible_kv_cache"

# vLLM 0.34.0: the extensible KV cache, on by default on CUDA and ROCm.
EXTENSIBLE_KV_CACHE_SINCE = {"vllm": ">=0.34.0"}


class CacheConfigExtensibleKvCacheOff(PatchCodemod):
    """CacheConfig(...) -> CacheConfig(..., enable_extensible_kv_cache=False).

    Patched: the keyword is there with False. Any other value (True, None, a variable) leaves
    the blocks past the first granule unbacked, so it is replaced by False.
    """

    ANCHOR = "a call CacheConfig(...)"

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not m.matches(updated, CACHE_CONFIG_CALL):
            return updated
        args = list(updated.args)
        for index, arg in enumerate(args):
            if arg.keyword is not None and arg.keyword.value == KEYWORD:
                if m.matches(arg.value, m.Name("False")):
                    self.found_patched()
                    return updated
                self.rewrote()
                args[index] = arg.with_changes(value=cst.Name("False"))
                return updated.with_changes(args=args)
        self.rewrote()
        return _without_copied_comments(append_arg(updated, keyword_arg(KEYWORD, cst.Name("False"))))


def _without_copied_comments(call: cst.Call) -> cst.Call:
    """append_arg gives the old last argument the separator of the one before it, comment lines
    included (0.4.0's `# disable to prevent cache state leakage`): keep only its line break and
    indentation, so the comment stays once, above the argument it was written for."""
    args = list(call.args)
    if len(args) < 2 or not isinstance(args[-2].comma, cst.Comma):
        return call
    space = args[-2].comma.whitespace_after
    if not isinstance(space, cst.ParenthesizedWhitespace):
        return call
    clean = space.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=[])
    args[-2] = args[-2].with_changes(comma=args[-2].comma.with_changes(whitespace_after=clean))
    return call.with_changes(args=args)


PATCH = Patch(
    id="v28-extensible-kv-cache-off",
    title="CacheConfig(..., enable_extensible_kv_cache=False): the workers back every KV block the scheduler hands out",
    target=GENERATOR,
    requires=SPECULATORS_0_3_OR_0_4,
    edits=(
        Edit(
            CacheConfigExtensibleKvCacheOff,
            when=EXTENSIBLE_KV_CACHE_SINCE,
            answers="CacheConfig.enable_extensible_kv_cache (on by default on CUDA and ROCm): "
            "initialize_from_config backs only the first granule of the KV cache, the engine core "
            "the rest after warm-up",
            fact=Fact("defines", "vllm.config.cache", "CacheConfig", KEYWORD),
        ),
    ),
    examples=(
        # speculators 0.3.0's shape, after v6
        Example(
            before="""
                cache_config = CacheConfig(
                    block_size=VLLM_BLOCK_SIZE,
                    gpu_memory_utilization=gpu_memory_utilization,
                    enable_prefix_caching=False,
                )
            """,
            after="""
                cache_config = CacheConfig(
                    block_size=VLLM_BLOCK_SIZE,
                    gpu_memory_utilization=gpu_memory_utilization,
                    enable_prefix_caching=False,
                    enable_extensible_kv_cache=False,
                )
            """,
        ),
        # speculators 0.4.0's shape
        Example(
            before="""
                cache_config = CacheConfig(
                    block_size=VLLM_BLOCK_SIZE,
                    gpu_memory_utilization=gpu_memory_utilization,
                    # disable to prevent cache state leakage
                    enable_prefix_caching=False,
                )
            """,
            after="""
                cache_config = CacheConfig(
                    block_size=VLLM_BLOCK_SIZE,
                    gpu_memory_utilization=gpu_memory_utilization,
                    # disable to prevent cache state leakage
                    enable_prefix_caching=False,
                    enable_extensible_kv_cache=False,
                )
            """,
        ),
        Example(
            before="""
                cfg = CacheConfig(block_size=16, enable_extensible_kv_cache=True)
            """,
            after="""
                cfg = CacheConfig(block_size=16, enable_extensible_kv_cache=False)
            """,
        ),
    ),
    satisfied=("cfg = CacheConfig(block_size=16, enable_extensible_kv_cache=False)\n",),
    near_misses=(
        # a copy of an existing cache config, no CacheConfig(...) built here
        """
            cfg = dataclasses.replace(cache_config, enable_extensible_kv_cache=True)
        """,
    ),
    upstream="vLLM 0.34.0: vllm/config/cache.py (CacheConfig.enable_extensible_kv_cache), "
    "vllm/config/vllm.py (_resolve_extensible_kv_cache), vllm/v1/worker/extensible_kv_cache.py, "
    "vllm/v1/engine/core.py (extend_kv_cache after compile_or_warm_up_model)",
    without_it="without it on CUDA vLLM 0.34: the first step whose KV blocks pass the first 2 MiB of each "
    "layer's cache kills the worker, `CUDA error (.../flash_fwd_launch_template.h:200): an illegal memory access "
    "was encountered`, and `generate()` fails `RuntimeError: cancelled` (the tiny Llama: generate 3, eleven "
    "prompts of 900-1000 tokens). The CPU build never turns it on",
    # the GPU run on CUDA vLLM 0.34.0: bench/gpu/gpu_run.py --leave-out v28 --leave-out-calls 3
    leave_one_out=(
        LeaveOneOut(
            "0.34.0",
            Symptom("generate 3", "RuntimeError", ("cancelled",), where="shm_broadcast.py"),
            device="cuda",
            calls="3",
            record="bench/gpu/results/0.34.0-h200x1/e2e-without-v28.json",
        ),
    ),
    since="0.34.0",
)
