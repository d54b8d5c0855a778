"""v27: the worker attributes captured rows by Model Runner V2's batch of the step, as it does by V1's.

speculators' worker learns which request each captured row belongs to from the V1 model runner's
persistent batch, `self.model_runner.input_batch.req_id_to_index` (0.4.0's own
`_store_captured_states`; 0.3.0's once v10 adds the same). Model Runner V2
(vllm/v1/worker/gpu/model_runner.py: in vLLM since 0.12.0 behind VLLM_USE_V2_MODEL_RUNNER=1,
the default on CUDA for some models from 0.22.0, for every model from 0.29.0 where Triton is,
the only runner in 0.34.0) keeps no batch on the runner: `execute_model()` builds a new
`InputBatch` in `prepare_inputs()` (vllm/v1/worker/gpu/input_batch.py: `req_ids` in batch
order, each request's `num_scheduled_tokens` rows one after another from `query_start_loc`),
runs the model with it and only then stores it in `execute_model_state`. Every step's first
capture fails: "'GPUModelRunner' object has no attribute 'input_batch'". V2 also orders a
step's requests its own way (0.22: by number of tokens; 0.26 on: decodes, short extends,
prefills, `sort_batch_req_ids`), so the order must be read, never assumed.

The edit, in the worker class:
- `_setup_hidden_states_capture` ends with `_follow_v2_batches(self)`: on a V2 runner it wraps
  the runner's `prepare_inputs` (an attribute of the runner object, which `execute_model` calls
  as `self.prepare_inputs(...)` on every release 0.12-0.34) so that each step's `InputBatch` is
  kept on the worker; on V1 it does nothing;
- every `self.model_runner.input_batch` becomes `_step_batch(self)`: V1's batch as before, or
  on V2 the step's `req_ids` as `req_id_to_index`, the one thing the capture reads of it. A V2
  batch is taken once, so a forward pass without a batch of its own (none on the path the
  generator drives: vLLM's warm-up runs build dummy batches, but the capture reads a batch only
  for steps the generator announced) raises instead of reading another step's order.
What is captured and returned keeps its shape (per layer one tensor per step; per step the
requests in batch order), so v10's `_rows_by_request`, v11's loop and v21's shared-memory
transfer, and 0.4.0's own slicing, read it as on V1.

Why not V2's aux hidden-state outputs (`SupportsEagle3.set_aux_hidden_state_layers`, which
EAGLE-3 and vLLM's `extract_hidden_states` use): they record the input of each listed layer
(vLLM passes layer + 1 for the output of a layer), so the last layer's output, in speculators'
default layer list (`num_layers - 1`), is never recorded; the runner only unpacks them where its
own `use_aux_hidden_state_outputs` says so (set from the speculative config at init), and they
are handed to a drafter in `sample_tokens`, not kept; and speculators' replacement forward,
which v7, v8 and v20 adapt and every end-to-end run compares with transformers, would be
bypassed. The batch is what V1's path already reads; only where it is read changes.
"""

from __future__ import annotations

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import SPECULATORS_0_3_OR_0_4, WORKER

SETUP = "_setup_hidden_states_capture"
FOLLOW = "_follow_v2_batches"
STEP_BATCH = "_step_batch"

HELPERS_SOURCE = '''\
# Model Runner V2 (vllm/v1/worker/gpu/model_runner.py; the only runner from vLLM 0.34.0) builds a
# new InputBatch in every step's prepare_inputs() and keeps none on the runner; V1 keeps its batch
# as model_runner.input_batch (patcher v27).
def _follow_v2_batches(worker):
    """On Model Runner V2, keep the InputBatch each step's prepare_inputs() returns on the
    worker: the forward pass that captures runs next, in the same execute_model()."""
    runner = worker.model_runner
    if hasattr(runner, "input_batch") or not hasattr(runner, "prepare_inputs"):
        return  # V1: its batch is model_runner.input_batch
    if getattr(runner.prepare_inputs, "_speculators_keeps_batch", False):
        return
    prepare_inputs = runner.prepare_inputs

    def prepare_and_keep(*args, **kwargs):
        batch = prepare_inputs(*args, **kwargs)
        worker._v2_step_batch = batch
        return batch

    prepare_and_keep._speculators_keeps_batch = True
    runner.prepare_inputs = prepare_and_keep


def _step_batch(worker):
    """The batch of the forward pass capturing now, as V1's is read (req_id_to_index: request
    id -> position in the batch; the rows follow in that order): V1's input_batch, or the
    requests of the InputBatch V2's prepare_inputs() made for this step, taken once."""
    import types

    batch = getattr(worker.model_runner, "input_batch", None)
    if batch is not None:
        return batch
    batch = getattr(worker, "_v2_step_batch", None)
    worker._v2_step_batch = None
    if batch is None:
        raise RuntimeError(
            "Model Runner V2 ran a forward pass without a batch from prepare_inputs(): "
            "cannot tell which request each captured row belongs to"
        )
    return types.SimpleNamespace(
        req_id_to_index={req_id: index for index, req_id in enumerate(batch.req_ids)}
    )
'''

FOLLOW_SOURCE = """\
# Model Runner V2 keeps no batch on the runner: keep each step's (patcher v27)
_follow_v2_batches(self)
"""

SELF_MODEL_RUNNER = m.Attribute(value=m.Name("self"), attr=m.Name("model_runner"))
V1_BATCH = m.Attribute(value=SELF_MODEL_RUNNER, attr=m.Name("input_batch"))
FOLLOW_CALL = m.SimpleStatementLine(
    body=[m.Expr(value=m.Call(func=m.Name(FOLLOW), args=[m.Arg(value=m.Name("self"))]))]
)


class _V1BatchReads(cst.CSTTransformer):
    """`self.model_runner.input_batch` -> `_step_batch(self)`, counting them."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
        if not m.matches(updated, V1_BATCH):
            return updated
        self.count += 1
        return cst.Call(func=cst.Name(STEP_BATCH), args=[cst.Arg(value=cst.Name("self"))])


def _follow_statements() -> list[cst.BaseStatement]:
    statement = cst.parse_statement(FOLLOW_SOURCE)
    comment = FOLLOW_SOURCE.splitlines()[0]
    return [
        statement.with_changes(leading_lines=[cst.EmptyLine(indent=False), cst.EmptyLine(comment=cst.Comment(comment))])
    ]


class WorkerReadsV2StepBatch(PatchCodemod):
    """In the class defining _setup_hidden_states_capture: that method ends with
    `_follow_v2_batches(self)`, every `self.model_runner.input_batch` of the class becomes
    `_step_batch(self)`; the module gets both helpers (before its first class).

    Patched: the method calls `_follow_v2_batches(self)` and no `self.model_runner.input_batch`
    is left. It runs on the class as it is left, after the edits of earlier patches on it (v10
    adds its read of the V1 batch there).
    """

    ANCHOR = f"a class with a method {SETUP}(self, ...)"

    def __init__(self, filename: str = "<source>") -> None:
        super().__init__(filename)
        self.needs_helpers = False

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        if not isinstance(updated.body, cst.IndentedBlock):
            return updated
        setup = next((s for s in updated.body.body if isinstance(s, cst.FunctionDef) and s.name.value == SETUP), None)
        if setup is None or not isinstance(setup.body, cst.IndentedBlock):
            return updated
        follows = any(m.matches(s, FOLLOW_CALL) for s in setup.body.body)
        reads = _V1BatchReads()
        rewritten = updated.visit(reads)
        assert isinstance(rewritten, cst.ClassDef) and isinstance(rewritten.body, cst.IndentedBlock)
        self.needs_helpers = True
        if follows and not reads.count:
            self.found_patched()
            return updated
        self.rewrote()
        if follows:
            return rewritten
        body = []
        for statement in rewritten.body.body:
            if isinstance(statement, cst.FunctionDef) and statement.name.value == SETUP:
                assert isinstance(statement.body, cst.IndentedBlock)
                statement = statement.with_changes(
                    body=statement.body.with_changes(body=[*statement.body.body, *_follow_statements()])
                )
            body.append(statement)
        return rewritten.with_changes(body=rewritten.body.with_changes(body=body))

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        if not self.needs_helpers:
            return updated
        if any(isinstance(s, cst.FunctionDef) and s.name.value == STEP_BATCH for s in updated.body):
            return updated
        self.rewrote()
        # after a first statement, so the opening comment stays with the code it describes
        helpers = list(cst.parse_module("_ = None\n" + HELPERS_SOURCE).body[1:])
        body = list(updated.body)
        index = next((i for i, s in enumerate(body) if isinstance(s, cst.ClassDef)), len(body))
        blank = [cst.EmptyLine(), cst.EmptyLine()] if index else []
        helpers[0] = helpers[0].with_changes(leading_lines=[*blank, *helpers[0].leading_lines])
        if index < len(body):
            body[index] = body[index].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
        return updated.with_changes(body=[*body[:index], *helpers, *body[index:]])


# vLLM 0.12.0: Model Runner V2 (vllm/v1/worker/gpu/) first ships; VLLM_USE_V2_MODEL_RUNNER=1
# selects it there, vLLM itself from 0.22.0 (model by model) and 0.29.0 (every model).
V2_RUNNER_SINCE = {"vllm": ">=0.12.0"}

# speculators 0.4.0's own read of the V1 batch (0.3.0 has the same once v10 adds it)
BEFORE = '''\
import torch


class HiddenStatesWorkerExtension:
    def _store_captured_states(self, aux_hidden_states):
        metadata = getattr(self, "_current_request_metadata", None)
        if metadata is not None:
            input_batch = self.model_runner.input_batch  # type: ignore[attr-defined]
            self._request_metadata.append(sorted(metadata.items(), key=lambda item: input_batch.req_id_to_index.get(item[0], float("inf"))))

    def _setup_hidden_states_capture(self, layer_ids: list[int]):
        """Setup model to capture auxiliary hidden states from specific layers"""
        model = self.model_runner.model  # type: ignore[attr-defined]
        base_model = model.model
        logger.info(f"Hidden states capture setup complete for layers {layer_ids}")
'''

AFTER = (
    "import torch\n\n\n"
    + HELPERS_SOURCE
    + '''

class HiddenStatesWorkerExtension:
    def _store_captured_states(self, aux_hidden_states):
        metadata = getattr(self, "_current_request_metadata", None)
        if metadata is not None:
            input_batch = _step_batch(self)  # type: ignore[attr-defined]
            self._request_metadata.append(sorted(metadata.items(), key=lambda item: input_batch.req_id_to_index.get(item[0], float("inf"))))

    def _setup_hidden_states_capture(self, layer_ids: list[int]):
        """Setup model to capture auxiliary hidden states from specific layers"""
        model = self.model_runner.model  # type: ignore[attr-defined]
        base_model = model.model
        logger.info(f"Hidden states capture setup complete for layers {layer_ids}")

        # Model Runner V2 keeps no batch on the runner: keep each step's (patcher v27)
        _follow_v2_batches(self)
'''
)

# speculators 0.3.0 without v10: nothing reads the batch yet; the setup follows V2's all the same
BEFORE_0_3_0 = """\
class HiddenStatesWorkerExtension:
    def _setup_hidden_states_capture(self, layer_ids):
        self._layer_ids = frozenset(layer_ids)
"""

AFTER_0_3_0 = (
    HELPERS_SOURCE
    + """

class HiddenStatesWorkerExtension:
    def _setup_hidden_states_capture(self, layer_ids):
        self._layer_ids = frozenset(layer_ids)

        # Model Runner V2 keeps no batch on the runner: keep each step's (patcher v27)
        _follow_v2_batches(self)
"""
)

# what the first generate() shows when the workers run Model Runner V2 and read V1's batch
NO_V1_BATCH = Symptom("generate 1", "RuntimeError", ("'GPUModelRunner' object has no attribute 'input_batch'",))

PATCH = Patch(
    id="v27-worker-v2-step-batch",
    title="worker: captured rows are attributed by Model Runner V2's batch of the step (V1's input_batch is gone)",
    target=WORKER,
    requires=SPECULATORS_0_3_OR_0_4,
    edits=(
        Edit(
            WorkerReadsV2StepBatch,
            when=V2_RUNNER_SINCE,
            answers="Model Runner V2 builds a new InputBatch (req_ids in batch order) in every step's "
            "prepare_inputs() and keeps none on the runner (no model_runner.input_batch)",
            fact=Fact(
                "defines",
                "vllm.v1.worker.gpu.input_batch",
                "InputBatch",
                "req_ids",
                needs=(Fact("defines", "vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "prepare_inputs"),),
            ),
        ),
    ),
    examples=(
        Example(before=BEFORE, after=AFTER),
        Example(before=BEFORE_0_3_0, after=AFTER_0_3_0),
    ),
    satisfied=(AFTER,),
    near_misses=(
        # a module-level helper, not a worker class's _setup_hidden_states_capture method
        """
            def _setup_hidden_states_capture(worker, layer_ids):
                worker._layer_ids = frozenset(layer_ids)
        """,
    ),
    upstream="vLLM 0.12.0-0.34.0: vllm/v1/worker/gpu/model_runner.py (GPUModelRunner.prepare_inputs, "
    "execute_model), vllm/v1/worker/gpu/input_batch.py (InputBatch.req_ids); vLLM 0.34.0 removed "
    "vllm/v1/worker/gpu_model_runner.py and gpu_input_batch.py",
    without_it="without it on Model Runner V2 (the only runner of CUDA vLLM 0.34; the default on CUDA for "
    "Llama, Mistral and Qwen3 from 0.23 and for every model from 0.29): every `generate()` fails at its "
    "first step, `RuntimeError: 'GPUModelRunner' object has no attribute 'input_batch'` (speculators 0.4.x; "
    "0.3.0 with v10). The CPU build never runs V2 (it needs Triton)",
    # the GPU runs on CUDA vLLM 0.34.0 (bench/gpu/gpu_run.py --leave-out v27; the Llama and Kimi-K2.5 INT4)
    leave_one_out=(
        LeaveOneOut(
            "0.34.0",
            NO_V1_BATCH,
            device="cuda",
            record="bench/gpu/results/0.34.0-before-v28-h200x1/e2e-without-v27.json",
        ),
        LeaveOneOut(
            "0.34.0",
            NO_V1_BATCH,
            device="cuda",
            record="bench/gpu/results/0.34.0-speculators-0.4.0.1-h200x1/e2e-without-v27.json",
            speculators="0.4.0.1",
        ),
        LeaveOneOut("0.16.0", None, calls="all", tensor_parallel=2),
        LeaveOneOut("0.16.0", None, calls="all", tensor_parallel=2, speculators="0.4.0.1"),
    ),
    since="0.12.0",
)
