"""v4: build SchedulerConfig with async_scheduling=False.

https://github.com/vllm-project/vllm/blob/v0.16.0/vllm/config/scheduler.py
Harmless and not sufficient: vLLM keeps the two-phase execute_model()/sample_tokens()
contract whatever this flag says (v5 answers that). Kept because the seeds' hosts carry it.
"""

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod, append_arg, has_keyword, keyword_arg
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch

from .targets import GENERATOR, SPECULATORS_0_3

SCHEDULER_CONFIG_CALL = m.Call(func=m.Name("SchedulerConfig"))


class SchedulerConfigAsyncOff(PatchCodemod):
    ANCHOR = "a call SchedulerConfig(...)"

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not m.matches(updated, SCHEDULER_CONFIG_CALL):
            return updated
        if has_keyword(updated, "async_scheduling"):
            self.found_patched()
            return updated
        self.rewrote()
        return append_arg(updated, keyword_arg("async_scheduling", cst.Name("False")))


PATCH = Patch(
    id="v4-async-scheduling",
    title="SchedulerConfig(..., async_scheduling=False), as the seeds did (harmless, not sufficient)",
    target=GENERATOR,
    requires=SPECULATORS_0_3,
    edits=(
        Edit(
            SchedulerConfigAsyncOff,
            when={"vllm": ">=0.11.0"},
            answers="SchedulerConfig has a field async_scheduling",
            fact=Fact("defines", "vllm.config.scheduler", "SchedulerConfig", "async_scheduling"),
        ),
    ),
    examples=(
        Example(
            before="""
                cfg = SchedulerConfig(max_num_seqs=1, max_model_len=2)
            """,
            after="""
                cfg = SchedulerConfig(max_num_seqs=1, max_model_len=2, async_scheduling=False)
            """,
        ),
        Example(
            before="""
                cfg = SchedulerConfig(
                    max_num_seqs=1,
                    max_model_len=2,
                )
            """,
            after="""
                cfg = SchedulerConfig(
                    max_num_seqs=1,
                    max_model_len=2,
                    async_scheduling=False,
                )
            """,
        ),
    ),
    satisfied=("cfg = SchedulerConfig(max_num_seqs=1, async_scheduling=False)\n",),
    near_misses=(
        # EngineArgs, not SchedulerConfig: the engine builds its scheduler config itself
        """
            args = EngineArgs(max_num_seqs=1, max_model_len=2)
        """,
    ),
    upstream="vLLM SchedulerConfig.async_scheduling (present in 0.11.0; default None from 0.14.0)",
    fixed_in="speculators 0.4.0 (never sets it)",
    without_it="nothing: the run does not need it (the seeds' v4; vLLM keeps the two-phase contract whatever the flag says); kept because hosts patched by hand carry it",
    leave_one_out=(
        LeaveOneOut("0.16.0", None, calls="all"),
        LeaveOneOut("0.16.0", None, calls="all", tensor_parallel=2),
    ),
    # 0.4.0 never sets async_scheduling, so this codemod would add it; not part of the 0.4 set:
    # the 0.4.0.1 rows of the release matrix pass without it (docs/speculators-releases.md)
    on_fixed_in="applies",
)
