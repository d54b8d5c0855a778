"""v19 (withdrawn): the generator's workers ran vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0).

vLLM 0.22.0 made Model Runner V2 (vllm/v1/worker/gpu/model_runner.py) the default on CUDA for
Qwen3, 0.23.0 for Llama and Mistral too, 0.25.0 for every dense model and 0.29.0 for every model
(vllm/config/vllm.py, `VllmConfig.use_v2_model_runner`; only where Triton is, so never on the CPU
build). speculators' worker extension, and v10's capture by request, read the V1 runner's per-step
batch (`model_runner.input_batch`), which V2 does not keep. On an H200 with vLLM 0.23.0 and 0.26.0
every `generate()` failed at the first step: "'GPUModelRunner' object has no attribute
'input_batch'" (the records below). This patch set vLLM's own switch, VLLM_USE_V2_MODEL_RUNNER=0,
while the generator built its config, so its workers ran V1.

Withdrawn: v27 reads Model Runner V2's batch of the step, on every release that has V2 (0.12 on),
so patcher leaves the choice of runner to vLLM, as for any other caller (`patcher status` says
which one a target's workers will use). Read in the sources of 0.12-0.34, nothing of V2 keeps
v27 from serving where vLLM picks V2; vLLM 0.34.0 has no V1 at all. A target patched with it is
told (stale) and `apply` removes it. The gate below is where it was selected (0.22 until 0.34,
whose pre-releases may still have V1; 0.34.0 has no V1 and refuses the switch).
"""

from __future__ import annotations

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod, with_import_first
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import GENERATOR, SPECULATORS_0_3_OR_0_4

METHOD = "_create_vllm_config"
SWITCH = 'os.environ["VLLM_USE_V2_MODEL_RUNNER"]'
SETTING = f'{SWITCH} = "0"\n'
WHY = (
    "# speculators' worker extension reads the V1 model runner's batch (input_batch); vLLM",
    "# picks Model Runner V2 by default on CUDA (Qwen3 from 0.22, Llama from 0.23, all from 0.32)",
)

# vLLM 0.22.0: the first release whose VllmConfig chooses V2 by default for some models; 0.34.0
# has no V1 and refuses the switch. Its pre-releases and nightlies stay in (PEP 440's "<0.34.0"
# would leave out 0.34.0rc1, which may predate the removal; check-upstream's nightly check asks so).
V2_RUNNER_BY_DEFAULT_SINCE = {"vllm": ">=0.22.0,<=0.34.0,!=0.34.0"}

DOCSTRING = m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString())])


def _source(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def _sets_switch(statement: cst.BaseStatement) -> bool:
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return False
    assign = statement.body[0]
    return isinstance(assign, cst.Assign) and len(assign.targets) == 1 and _source(assign.targets[0].target) == SWITCH


class SelectV1ModelRunner(PatchCodemod):
    """`def _create_vllm_config(...)` gets `os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"` as its
    first statement (after the docstring), and the module `import os`.

    Patched: the method sets the switch to "0". Set to anything else, it is set to "0".
    """

    ANCHOR = f"a method def {METHOD}(...)"

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if updated.name.value != METHOD or not isinstance(updated.body, cst.IndentedBlock):
            return updated
        body = list(updated.body.body)
        setting = cst.parse_statement(SETTING)
        for index, statement in enumerate(body):
            if _sets_switch(statement):
                if m.matches(statement.body[0].value, m.SimpleString('"0"')):
                    self.found_patched()
                    return updated
                self.rewrote()
                body[index] = setting.with_changes(leading_lines=statement.leading_lines)
                return updated.with_changes(body=updated.body.with_changes(body=body))
        self.rewrote()
        at = 1 if body and m.matches(body[0], DOCSTRING) else 0
        why = [cst.EmptyLine(comment=cst.Comment(line)) for line in WHY]
        body.insert(at, setting.with_changes(leading_lines=why))
        return updated.with_changes(body=updated.body.with_changes(body=body))

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        if not (self.rewrites or self.patched_seen):
            return updated
        imported = with_import_first(updated, "os")
        if imported is None:
            return updated
        self.rewrote()
        return imported


BEFORE = '''\
"""Extract hidden states from intermediate layers during prefill using vLLM."""

import torch
from vllm.config import VllmConfig


class VllmHiddenStatesGenerator:
    def _create_vllm_config(
        self,
        model_path: str,
        max_model_len: int,
    ) -> VllmConfig:
        """Create VllmConfig with hidden states worker extension"""
        cache_config = CacheConfig(block_size=VLLM_BLOCK_SIZE)
        return VllmConfig(cache_config=cache_config)
'''

AFTER = '''\
"""Extract hidden states from intermediate layers during prefill using vLLM."""

import os
import torch
from vllm.config import VllmConfig


class VllmHiddenStatesGenerator:
    def _create_vllm_config(
        self,
        model_path: str,
        max_model_len: int,
    ) -> VllmConfig:
        """Create VllmConfig with hidden states worker extension"""
        # speculators' worker extension reads the V1 model runner's batch (input_batch); vLLM
        # picks Model Runner V2 by default on CUDA (Qwen3 from 0.22, Llama from 0.23, all from 0.32)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        cache_config = CacheConfig(block_size=VLLM_BLOCK_SIZE)
        return VllmConfig(cache_config=cache_config)
'''

# what the first generate() shows when the workers run Model Runner V2
NO_V1_BATCH = Symptom("generate 1", "RuntimeError", ("'GPUModelRunner' object has no attribute 'input_batch'",))

PATCH = Patch(
    id="v19-v1-model-runner",
    title="the generator's workers run vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)",
    target=GENERATOR,
    requires=SPECULATORS_0_3_OR_0_4,
    edits=(
        Edit(
            SelectV1ModelRunner,
            when=V2_RUNNER_BY_DEFAULT_SINCE,
            answers="VllmConfig.use_v2_model_runner chooses Model Runner V2 by default, whose "
            "runner has no input_batch",
            fact=Fact("defines", "vllm.config.vllm", "VllmConfig", "use_v2_model_runner"),
        ),
    ),
    examples=(
        Example(before=BEFORE, after=AFTER),
        # no docstring, `import os` already there; a switch set to "1" is set to "0"
        Example(
            before="""
                import os


                class G:
                    def _create_vllm_config(self):
                        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
                        return None
            """,
            after="""
                import os


                class G:
                    def _create_vllm_config(self):
                        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
                        return None
            """,
        ),
    ),
    satisfied=(AFTER,),
    near_misses=(
        # a module-level function, not the generator's _create_vllm_config method
        """
            import os


            def create_vllm_config():
                os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
                return None
        """,
    ),
    upstream="vLLM 0.22.0-0.33.0: vllm/config/vllm.py (DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES, "
    "VllmConfig.use_v2_model_runner); vllm/v1/worker/gpu_worker.py builds "
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner when it says so",
    withdrawn="v27 reads Model Runner V2's batch: the workers run the runner vLLM itself picks",
    without_it="withdrawn: v27 serves Model Runner V2. Without it on CUDA vLLM 0.22-0.33 the workers run vLLM's own choice of runner, Model Runner V2 for most models (Llama and Mistral from 0.23, every model from 0.29), where v27 attributes the captured rows by V2's batch. Before v27, every `generate()` failed at its first step there, `RuntimeError: 'GPUModelRunner' object has no attribute 'input_batch'` (seen on an H200 with vLLM 0.23.0 and 0.26.0, the records below). The CPU build never uses V2 (it needs Triton); vLLM 0.34.0 has only V2 and refuses the switch",
    leave_one_out=(
        LeaveOneOut(
            "0.23.0",
            NO_V1_BATCH,
            device="cuda",
        ),
        LeaveOneOut(
            "0.26.0",
            NO_V1_BATCH,
            device="cuda",
            record="bench/gpu/results/0.26.0-speculators-0.4.0.1-h200x1/log.txt",
            speculators="0.4.0.1",
        ),
    ),
)
