"""v5: follow every executor.execute_model(...) with executor.sample_tokens(None).

https://github.com/vllm-project/vllm/pull/26866 (first released in vLLM 0.11.1)
From then on the model runner's execute_model() returns None and keeps its state until
sample_tokens(grammar_output) collects it; a second execute_model() before that raises.
"""

from collections.abc import Sequence

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import AttributeCall, Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import GENERATOR, SPECULATORS_0_3

EXECUTOR = m.Attribute(value=m.Name("self"), attr=m.Name("executor"))


def executor_call(method: str) -> "m.Shape":
    return m.Call(func=m.Attribute(value=EXECUTOR, attr=m.Name(method)))


def statement_calling(method: str) -> "m.Shape":
    """`self.executor.<method>(...)` as a statement of its own, bare or assigned."""
    call = executor_call(method)
    return m.SimpleStatementLine(body=[m.Expr(value=call) | m.Assign(value=call)])


EXECUTE_MODEL_STATEMENT = statement_calling("execute_model")
SAMPLE_TOKENS_STATEMENT = statement_calling("sample_tokens")
# vLLM's own engine loop: `if model_output is None: model_output = ....sample_tokens(...)`
SAMPLE_TOKENS_IF = m.If(body=m.IndentedBlock(body=[SAMPLE_TOKENS_STATEMENT, m.ZeroOrMore()]))


def sample_tokens_statement() -> cst.SimpleStatementLine:
    return cst.parse_statement("self.executor.sample_tokens(None)\n")  # type: ignore[return-value]


# vLLM 0.11.1: two-phase execution, execute_model() then sample_tokens() (PR 26866).
TWO_PHASE_SINCE = {"vllm": ">=0.11.1"}


class SampleTokensAfterExecuteModel(PatchCodemod):
    """Insert `self.executor.sample_tokens(None)` after each statement calling execute_model.

    Both `self.executor.execute_model(x)` and `out = self.executor.execute_model(x)` are
    anchors. Either counts as patched when the very next statement calls
    `self.executor.sample_tokens(...)`, bare, assigned, or as the first statement of an
    `if` (speculators 0.4.0 writes `self.executor.sample_tokens(model_output)`). Otherwise
    the call is inserted with None, the grammar output of a request without structured
    output; an assigned execute_model result is left as it is (it is None from 0.11.1 on).
    """

    ANCHOR = "a statement self.executor.execute_model(...)"

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        body = self.follow_execute_model(updated.body)
        return updated if body is None else updated.with_changes(body=body)

    def follow_execute_model(self, body: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement] | None:
        out: list[cst.BaseStatement] = []
        changed = False
        for index, statement in enumerate(body):
            out.append(statement)
            if not m.matches(statement, EXECUTE_MODEL_STATEMENT):
                continue
            following = body[index + 1] if index + 1 < len(body) else None
            if following is not None and m.matches(following, SAMPLE_TOKENS_STATEMENT | SAMPLE_TOKENS_IF):
                self.found_patched()
                continue
            self.rewrote()
            out.append(sample_tokens_statement())
            changed = True
        return out if changed else None


PATCH = Patch(
    id="v5-sample-tokens",
    title="call executor.sample_tokens(None) after each executor.execute_model(...)",
    target=GENERATOR,
    requires=SPECULATORS_0_3,
    edits=(
        Edit(
            SampleTokensAfterExecuteModel,
            when=TWO_PHASE_SINCE,
            answers="executors expose sample_tokens(grammar_output), which must follow "
            "every execute_model() that returned None",
            fact=Fact("defines", "vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "sample_tokens"),
        ),
    ),
    examples=(
        Example(
            before="""
                def generate(self):
                    while (scheduler_output := self.scheduler.schedule()).total_num_scheduled_tokens > 0:
                        self.executor.execute_model(scheduler_output)

                        for req_id in scheduler_output.num_scheduled_tokens:
                            self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
            """,
            after="""
                def generate(self):
                    while (scheduler_output := self.scheduler.schedule()).total_num_scheduled_tokens > 0:
                        self.executor.execute_model(scheduler_output)
                        self.executor.sample_tokens(None)

                        for req_id in scheduler_output.num_scheduled_tokens:
                            self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
            """,
        ),
        Example(
            before="""
                def step(self, scheduler_output):
                    model_output = self.executor.execute_model(scheduler_output)
                    return model_output
            """,
            after="""
                def step(self, scheduler_output):
                    model_output = self.executor.execute_model(scheduler_output)
                    self.executor.sample_tokens(None)
                    return model_output
            """,
        ),
    ),
    satisfied=(
        # speculators 0.4.0's shape
        (
            "def generate(self):\n"
            "    while self.scheduler.has_requests():\n"
            "        model_output = self.executor.execute_model(scheduler_output)\n"
            "        self.executor.sample_tokens(model_output)\n"
        ),
        # vLLM's engine core shape
        (
            "def step(self):\n"
            "    model_output = self.executor.execute_model(scheduler_output)\n"
            "    if model_output is None:\n"
            "        model_output = self.executor.sample_tokens(grammar_output)\n"
        ),
    ),
    near_misses=(
        # vLLM's engine core (self.model_executor), not the generator's own executor
        """
            def step(self, scheduler_output):
                model_output = self.model_executor.execute_model(scheduler_output)
                return model_output
        """,
    ),
    upstream="https://github.com/vllm-project/vllm/pull/26866 (vLLM 0.11.1: "
    "vllm/v1/executor/abstract.py, vllm/v1/worker/gpu_model_runner.py)",
    fixed_in="speculators 0.4.0",
    attribute_calls=(
        AttributeCall(
            "self.executor",
            "sample_tokens",
            "vllm.v1.executor.multiproc_executor:MultiprocExecutor.sample_tokens",
        ),
        AttributeCall(
            "self.executor",
            "execute_model",
            "vllm.v1.executor.multiproc_executor:MultiprocExecutor.execute_model",
        ),
    ),
    without_it="without it the second `execute_model()` in a process fails: `RuntimeError: ... sample_tokens() must be called after execute_model() returns None.`",
    leave_one_out=(
        LeaveOneOut(
            "0.16.0",
            # the first call's end (v29's execute_model() for the finished requests) is already a
            # second execute_model() without sample_tokens()
            Symptom(
                "generate 1", "RuntimeError", ("sample_tokens() must be called after execute_model() returns None",)
            ),
            calls="1,2",
        ),
        LeaveOneOut(
            "0.16.0",
            Symptom(
                "generate 1", "RuntimeError", ("sample_tokens() must be called after execute_model() returns None",)
            ),
            calls="all",
            tensor_parallel=2,
        ),
    ),
    on_fixed_in="already-satisfied",
)
