"""v3: bring three vLLM constructor/helper calls of the generator to their newer signatures.

vLLM 0.11.1: vllm/v1/core/sched/scheduler.py (Scheduler.__init__ requires block_size);
vLLM 0.12.0: vllm/config/scheduler.py (SchedulerConfig init-only field is_encoder_decoder required)
and vllm/v1/core/kv_cache_utils.py (get_kv_cache_config_from_groups drops kv_cache_specs; since
vLLM 0.33.0 it lives in vllm/v1/core/kv_cache_planning.py, still without it: see v12).
Upstream fix: https://github.com/vllm-project/speculators/pull/225
"""

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod, append_arg, has_keyword, keyword_arg, remove_keyword
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import GENERATOR, SPECULATORS_0_3

# Scheduler(vllm_config, kv_cache_config, structured_output_manager, block_size, ...):
# block_size is the fourth positional parameter.
SCHEDULER_CALL = m.Call(func=m.Name("Scheduler"))
SCHEDULER_BLOCK_SIZE_POSITION = 4
BLOCK_SIZE_CONSTANT = "VLLM_BLOCK_SIZE"
DEFINES_BLOCK_SIZE_CONSTANT = m.SimpleStatementLine(
    body=[m.Assign(targets=[m.AssignTarget(target=m.Name(BLOCK_SIZE_CONSTANT))])]
)

# vLLM 0.11.1 made Scheduler.__init__'s block_size a required parameter.
SCHEDULER_BLOCK_SIZE_SINCE = {"vllm": ">=0.11.1"}


class SchedulerBlockSize(PatchCodemod):
    """Scheduler(...) -> Scheduler(..., block_size=VLLM_BLOCK_SIZE).

    Only where the module itself defines VLLM_BLOCK_SIZE (speculators 0.3.0 does, at top
    level): writing the name anywhere else would trade a TypeError for a NameError.
    """

    ANCHOR = f"a call Scheduler(...) in a module that defines {BLOCK_SIZE_CONSTANT} at top level"

    def visit_Module(self, node: cst.Module) -> bool:
        self.has_constant = any(m.matches(stmt, DEFINES_BLOCK_SIZE_CONSTANT) for stmt in node.body)
        return True

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not m.matches(updated, SCHEDULER_CALL):
            return updated
        positional = [a for a in updated.args if a.keyword is None and not a.star]
        if has_keyword(updated, "block_size") or len(positional) >= SCHEDULER_BLOCK_SIZE_POSITION:
            self.found_patched()
            return updated
        if not self.has_constant:
            return updated
        self.rewrote()
        return append_arg(updated, keyword_arg("block_size", cst.Name(BLOCK_SIZE_CONSTANT)))


SCHEDULER_CONFIG_CALL = m.Call(func=m.Name("SchedulerConfig"))

# vLLM 0.12.0: SchedulerConfig's init-only field is_encoder_decoder lost its default
# (optional, = False, in 0.11.1 and 0.11.2).
SCHEDULER_CONFIG_ENCODER_DECODER_SINCE = {"vllm": ">=0.12.0"}


class SchedulerConfigEncoderDecoder(PatchCodemod):
    """SchedulerConfig(...) -> SchedulerConfig(..., is_encoder_decoder=False)."""

    ANCHOR = "a call SchedulerConfig(...)"

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not m.matches(updated, SCHEDULER_CONFIG_CALL):
            return updated
        if has_keyword(updated, "is_encoder_decoder"):
            self.found_patched()
            return updated
        self.rewrote()
        return append_arg(updated, keyword_arg("is_encoder_decoder", cst.Name("False")))


KV_CACHE_CONFIG_CALL = m.Call(func=m.Name("get_kv_cache_config_from_groups"))

# vLLM 0.12.0: get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, available_memory),
# in kv_cache_utils; the same signature in kv_cache_planning since 0.33.0 (v12 moves the import).
KV_CACHE_CONFIG_NO_SPECS_SINCE = {"vllm": ">=0.12.0"}
KV_CACHE_CONFIG_MODULES = ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning")


class KvCacheConfigWithoutSpecs(PatchCodemod):
    """get_kv_cache_config_from_groups(..., kv_cache_specs=..., ...) loses that argument."""

    ANCHOR = "a call get_kv_cache_config_from_groups(...)"

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not m.matches(updated, KV_CACHE_CONFIG_CALL):
            return updated
        if not has_keyword(updated, "kv_cache_specs"):
            self.found_patched()
            return updated
        self.rewrote()
        return remove_keyword(updated, "kv_cache_specs")


PATCH = Patch(
    id="v3-signatures",
    title="Scheduler gains block_size, SchedulerConfig is_encoder_decoder, "
    "get_kv_cache_config_from_groups loses kv_cache_specs",
    target=GENERATOR,
    requires=SPECULATORS_0_3,
    edits=(
        Edit(
            SchedulerBlockSize,
            when=SCHEDULER_BLOCK_SIZE_SINCE,
            answers="Scheduler.__init__ requires block_size",
            fact=Fact("required-param", "vllm.v1.core.sched.scheduler", "Scheduler.__init__", "block_size"),
        ),
        Edit(
            SchedulerConfigEncoderDecoder,
            when=SCHEDULER_CONFIG_ENCODER_DECODER_SINCE,
            answers="SchedulerConfig requires the init-only field is_encoder_decoder",
            fact=Fact("field-required", "vllm.config.scheduler", "SchedulerConfig", "is_encoder_decoder"),
        ),
        Edit(
            KvCacheConfigWithoutSpecs,
            when=KV_CACHE_CONFIG_NO_SPECS_SINCE,
            answers="get_kv_cache_config_from_groups has no parameter kv_cache_specs",
            fact=Fact("lacks-param", KV_CACHE_CONFIG_MODULES, "get_kv_cache_config_from_groups", "kv_cache_specs"),
        ),
    ),
    examples=(
        Example(
            before="""
                VLLM_BLOCK_SIZE = 16

                kv_cache_config = get_kv_cache_config_from_groups(
                    vllm_config=vllm_config,
                    kv_cache_groups=kv_cache_groups,
                    kv_cache_specs=kv_cache_spec,
                    available_memory=cache_memory,
                )
                scheduler = Scheduler(
                    vllm_config=vllm_config,
                    kv_cache_config=kv_cache_config,
                    structured_output_manager=structured_output_manager,
                )
                scheduler_config = SchedulerConfig(
                    max_num_seqs=32,
                    max_model_len=2048,
                )
            """,
            after="""
                VLLM_BLOCK_SIZE = 16

                kv_cache_config = get_kv_cache_config_from_groups(
                    vllm_config=vllm_config,
                    kv_cache_groups=kv_cache_groups,
                    available_memory=cache_memory,
                )
                scheduler = Scheduler(
                    vllm_config=vllm_config,
                    kv_cache_config=kv_cache_config,
                    structured_output_manager=structured_output_manager,
                    block_size=VLLM_BLOCK_SIZE,
                )
                scheduler_config = SchedulerConfig(
                    max_num_seqs=32,
                    max_model_len=2048,
                    is_encoder_decoder=False,
                )
            """,
        ),
        Example(
            before="""
                VLLM_BLOCK_SIZE = 16
                cfg = get_kv_cache_config_from_groups(vllm_config=c, kv_cache_specs=s, available_memory=m)
                sched = Scheduler(vllm_config=c, kv_cache_config=cfg, structured_output_manager=o)
                sc = SchedulerConfig(max_num_seqs=1, max_model_len=2)
            """,
            after="""
                VLLM_BLOCK_SIZE = 16
                cfg = get_kv_cache_config_from_groups(vllm_config=c, available_memory=m)
                sched = Scheduler(vllm_config=c, kv_cache_config=cfg, structured_output_manager=o, block_size=VLLM_BLOCK_SIZE)
                sc = SchedulerConfig(max_num_seqs=1, max_model_len=2, is_encoder_decoder=False)
            """,
        ),
    ),
    satisfied=(
        # speculators 0.4.0's shape
        (
            "VLLM_BLOCK_SIZE = 16\n"
            "cfg = get_kv_cache_config_from_groups(\n"
            "    vllm_config=c, kv_cache_groups=g, available_memory=m\n"
            ")\n"
            "sched = Scheduler(vllm_config=c, kv_cache_config=cfg, structured_output_manager=o, "
            "block_size=VLLM_BLOCK_SIZE)\n"
            "sc = SchedulerConfig(max_num_seqs=1, is_encoder_decoder=False)\n"
        ),
        # block_size passed positionally counts as given
        (
            "VLLM_BLOCK_SIZE = 16\n"
            "cfg = get_kv_cache_config_from_groups(c, g, m)\n"
            "sched = Scheduler(c, cfg, o, 16)\n"
            "sc = SchedulerConfig(is_encoder_decoder=False)\n"
        ),
    ),
    near_misses=(
        # VLLM_BLOCK_SIZE imported, not defined at the top of this module: not the generator's own
        """
            from speculators.data_generation.config import VLLM_BLOCK_SIZE

            sched = Scheduler(vllm_config=c, kv_cache_config=cfg, structured_output_manager=o)
        """,
    ),
    upstream="vLLM 0.11.1: vllm/v1/core/sched/scheduler.py (Scheduler block_size); vLLM 0.12.0: "
    "vllm/config/scheduler.py (is_encoder_decoder), vllm/v1/core/kv_cache_utils.py "
    "(kv_cache_specs removed); speculators fix https://github.com/vllm-project/speculators/pull/225",
    fixed_in="speculators 0.4.0",
    without_it="without it the generator cannot be constructed: `Scheduler` misses its required `block_size` (vLLM 0.11.1); pydantic `ValidationError` at `SchedulerConfig(...)`, `is_encoder_decoder` Field required, and `get_kv_cache_config_from_groups()` gets an unexpected keyword argument `kv_cache_specs` (0.12.0)",
    leave_one_out=(
        LeaveOneOut("0.16.0", Symptom("init", "ValidationError", ("is_encoder_decoder", "Field required"))),
        # the release matrix applies with verification, which refuses the call before anything runs
        LeaveOneOut(
            "0.16.0",
            Symptom(
                "verify",
                "",
                ("get_kv_cache_config_from_groups(...): got an unexpected keyword argument 'kv_cache_specs'",),
            ),
            calls="all",
            tensor_parallel=2,
        ),
    ),
    on_fixed_in="already-satisfied",
)
