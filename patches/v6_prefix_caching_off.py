"""v6: build CacheConfig with enable_prefix_caching=False.

vLLM 0.12.0: vllm/config/cache.py (CacheConfig.enable_prefix_caching defaults to True; it was
None, i.e. off, for a CacheConfig built directly). With prefix caching on, a prompt that shares a
prefix of a full KV block (16 tokens) or more with an earlier prompt, in the same batch or an
earlier call, has that prefix served from the cache: the model computes only the rest, the
capture sees only those rows, and 0.3.0's offset slicing hands back too few rows or rows of
another prompt. No error is raised. Upstream fix (the same line):
https://github.com/vllm-project/speculators/pull/225
"""

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod, append_arg, keyword_arg
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import GENERATOR, SPECULATORS_0_3

CACHE_CONFIG_CALL = m.Call(func=m.Name("CacheConfig"))
KEYWORD = "enable_prefix_caching"

# vLLM 0.12.0: prefix caching on by default.
PREFIX_CACHING_DEFAULT_ON_SINCE = {"vllm": ">=0.12.0"}


class CacheConfigPrefixCachingOff(PatchCodemod):
    """CacheConfig(...) -> CacheConfig(..., enable_prefix_caching=False).

    Patched: the keyword is there with False. Any other value (True, a variable) is what
    produces the silent truncation, so it is replaced by False.
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
        return append_arg(updated, keyword_arg(KEYWORD, cst.Name("False")))


PATCH = Patch(
    id="v6-prefix-caching-off",
    title="CacheConfig(..., enable_prefix_caching=False): every prompt is computed in full",
    target=GENERATOR,
    requires=SPECULATORS_0_3,
    edits=(
        Edit(
            CacheConfigPrefixCachingOff,
            when=PREFIX_CACHING_DEFAULT_ON_SINCE,
            answers="CacheConfig.enable_prefix_caching defaults to True",
            fact=Fact("default-value", "vllm.config.cache", "CacheConfig", "enable_prefix_caching", value="True"),
        ),
    ),
    examples=(
        Example(
            before="""
                cache_config = CacheConfig(
                    block_size=VLLM_BLOCK_SIZE,
                    gpu_memory_utilization=gpu_memory_utilization,
                )
            """,
            after="""
                cache_config = CacheConfig(
                    block_size=VLLM_BLOCK_SIZE,
                    gpu_memory_utilization=gpu_memory_utilization,
                    enable_prefix_caching=False,
                )
            """,
        ),
        Example(
            before="""
                cfg = CacheConfig(block_size=16)
            """,
            after="""
                cfg = CacheConfig(block_size=16, enable_prefix_caching=False)
            """,
        ),
        Example(
            before="""
                cfg = CacheConfig(block_size=16, enable_prefix_caching=True)
            """,
            after="""
                cfg = CacheConfig(block_size=16, enable_prefix_caching=False)
            """,
        ),
    ),
    satisfied=(
        # speculators 0.4.0's shape
        (
            "cache_config = CacheConfig(\n"
            "    block_size=VLLM_BLOCK_SIZE,\n"
            "    gpu_memory_utilization=gpu_memory_utilization,\n"
            "    # disable to prevent cache state leakage\n"
            "    enable_prefix_caching=False,\n"
            ")\n"
        ),
    ),
    near_misses=(
        # a copy of an existing cache config, no CacheConfig(...) built here
        """
            cfg = dataclasses.replace(cache_config, block_size=16)
        """,
    ),
    upstream="vLLM 0.12.0: vllm/config/cache.py (enable_prefix_caching defaults to True); "
    "speculators fix https://github.com/vllm-project/speculators/pull/225",
    fixed_in="speculators 0.4.0",
    without_it="silently wrong data without it: a prompt sharing a prefix of 16 tokens or more with an earlier prompt (in the batch or an earlier call) is computed only past its cached blocks (vLLM 0.16 CPU: a 64-token prompt sharing a 44-token prefix, 32 rows). Without v10/v11 that is silent (too few rows, or rows of another prompt); with them, `RuntimeError: ... captured 32 rows of hidden states, expected 64`",
    leave_one_out=(
        LeaveOneOut(
            "0.16.0",
            Symptom("generate 1", "RuntimeError", ("request req_0_3: captured 32 rows of hidden states, expected 64",)),
            calls="1,2",
        ),
        LeaveOneOut(
            "0.16.0",
            Symptom("generate 1", "RuntimeError", ("request req_0_3: captured 32 rows of hidden states, expected 64",)),
            calls="all",
            tensor_parallel=2,
        ),
    ),
    on_fixed_in="already-satisfied",
)
