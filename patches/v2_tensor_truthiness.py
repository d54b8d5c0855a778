"""v2: read the captured hidden states from collective_rpc's single reply, and test them for emptiness explicitly.

vLLM 0.11.1: vllm/v1/executor/multiproc_executor.py (MultiprocExecutor.collective_rpc with
unique_reply_rank returns that rank's reply itself, no longer a one-element list).
Upstream fix: https://github.com/vllm-project/speculators/pull/225
"""

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import GENERATOR, SPECULATORS_0_3

REPLY = "captured_states_list"
STATES = "aux_hidden_states"

FIRST_OF_REPLY = m.Subscript(
    value=m.Name(REPLY),
    slice=[m.SubscriptElement(slice=m.Index(value=m.Integer("0")))],
)
STATES_TARGET = [m.AssignTarget(target=m.Name(STATES))]
# The worker's _get_captured_states() returns a list of tensors (one per layer) or None.
# Up to 0.11.0 the executor wrapped it in a one-element list; from 0.11.1 on it does not.
# A one-element list whose element is not a tensor is the old wrapping, whatever the
# reply was (a list, or None); a list of tensors, even of one, is the reply itself.
SINGLE_REPLY = cst.parse_expression(
    "(\n"
    f"    {REPLY}[0]\n"
    f"    if isinstance({REPLY}, (list, tuple))\n"
    f"    and len({REPLY}) == 1\n"
    f"    and not isinstance({REPLY}[0], torch.Tensor)\n"
    f"    else {REPLY}\n"
    ")"
)
SINGLE_REPLY_SHAPE = m.IfExp(body=FIRST_OF_REPLY, orelse=m.Name(REPLY))

# vLLM 0.11.1: collective_rpc(..., unique_reply_rank=r) returns the single reply.
SINGLE_REPLY_SINCE = {"vllm": ">=0.11.1"}


class CapturedStatesSingleReply(PatchCodemod):
    """aux_hidden_states = captured_states_list[0] -> accept the bare reply and the old list."""

    ANCHOR = f"an assignment {STATES} = {REPLY}[0]"

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign) -> cst.Assign:
        if not m.matches(updated, m.Assign(targets=STATES_TARGET)):
            return updated
        if m.matches(updated.value, SINGLE_REPLY_SHAPE):
            self.found_patched()
            return updated
        if not m.matches(updated.value, FIRST_OF_REPLY):
            return updated
        self.rewrote()
        return updated.with_changes(value=SINGLE_REPLY)


NOT_STATES = m.UnaryOperation(operator=m.Not(), expression=m.Name(STATES))
EMPTINESS_TEST = cst.parse_expression(f"{STATES} is None or len({STATES}) == 0")
EMPTINESS_TEST_SHAPE = m.BooleanOperation(
    left=m.Comparison(
        left=m.Name(STATES), comparisons=[m.ComparisonTarget(operator=m.Is(), comparator=m.Name("None"))]
    ),
    operator=m.Or(),
    right=m.Comparison(
        left=m.Call(func=m.Name("len"), args=[m.Arg(value=m.Name(STATES))]),
        comparisons=[m.ComparisonTarget(operator=m.Equal(), comparator=m.Integer("0"))],
    ),
)

# Same release: with the reply no longer wrapped, `captured_states_list[0]` is a tensor and
# `not` on it raises; an explicit test is right for a list of tensors and for a tensor alike.
EMPTINESS_TEST_SINCE = SINGLE_REPLY_SINCE


class CapturedStatesEmptinessTest(PatchCodemod):
    """`if not aux_hidden_states:` -> `if aux_hidden_states is None or len(aux_hidden_states) == 0:`."""

    ANCHOR = f"a test `if not {STATES}:`"

    def leave_If(self, original: cst.If, updated: cst.If) -> cst.If:
        if m.matches(updated.test, EMPTINESS_TEST_SHAPE):
            self.found_patched()
            return updated
        if not m.matches(updated.test, NOT_STATES):
            return updated
        self.rewrote()
        return updated.with_changes(test=EMPTINESS_TEST)


BEFORE = """\
captured_states_list = self.executor.collective_rpc(
    "_get_captured_states",
    unique_reply_rank=0,
)
aux_hidden_states = captured_states_list[0]

if not aux_hidden_states:
    raise RuntimeError("Failed to capture hidden states from worker")
"""

AFTER = """\
captured_states_list = self.executor.collective_rpc(
    "_get_captured_states",
    unique_reply_rank=0,
)
aux_hidden_states = (
    captured_states_list[0]
    if isinstance(captured_states_list, (list, tuple))
    and len(captured_states_list) == 1
    and not isinstance(captured_states_list[0], torch.Tensor)
    else captured_states_list
)

if aux_hidden_states is None or len(aux_hidden_states) == 0:
    raise RuntimeError("Failed to capture hidden states from worker")
"""

PATCH = Patch(
    id="v2-tensor-truthiness",
    title="take collective_rpc's single reply as the captured states; test them for emptiness explicitly",
    target=GENERATOR,
    requires=SPECULATORS_0_3,
    edits=(
        Edit(
            CapturedStatesSingleReply,
            when=SINGLE_REPLY_SINCE,
            answers="collective_rpc(..., unique_reply_rank=r) returns the single reply, not a one-element list",
            fact=Fact("returns-first-item", "vllm.v1.executor.multiproc_executor", "MultiprocExecutor.collective_rpc"),
        ),
        Edit(
            CapturedStatesEmptinessTest,
            when=EMPTINESS_TEST_SINCE,
            answers="the captured-states reply holds tensors, whose truth value is ambiguous",
            fact=Fact("returns-first-item", "vllm.v1.executor.multiproc_executor", "MultiprocExecutor.collective_rpc"),
        ),
    ),
    examples=(
        Example(before=BEFORE, after=AFTER),
        Example(
            before="""
                def states(self):
                    captured_states_list = self.executor.collective_rpc("_get_captured_states", unique_reply_rank=0)
                    aux_hidden_states = captured_states_list[0]
                    if not aux_hidden_states:
                        return []
                    return aux_hidden_states
            """,
            after="""
                def states(self):
                    captured_states_list = self.executor.collective_rpc("_get_captured_states", unique_reply_rank=0)
                    aux_hidden_states = (
                        captured_states_list[0]
                        if isinstance(captured_states_list, (list, tuple))
                        and len(captured_states_list) == 1
                        and not isinstance(captured_states_list[0], torch.Tensor)
                        else captured_states_list
                    )
                    if aux_hidden_states is None or len(aux_hidden_states) == 0:
                        return []
                    return aux_hidden_states
            """,
        ),
    ),
    satisfied=(AFTER,),
    near_misses=(
        # another element of the reply (the last rank's): not the single reply read as a list
        """
            def states(self):
                captured_states_list = self.executor.collective_rpc("_get_captured_states", unique_reply_rank=0)
                aux_hidden_states = captured_states_list[-1]
                if not aux_hidden_states:
                    return []
                return aux_hidden_states
        """,
    ),
    upstream="vLLM 0.11.1: vllm/v1/executor/multiproc_executor.py (collective_rpc with "
    "unique_reply_rank returns the single reply); speculators fix "
    "https://github.com/vllm-project/speculators/pull/225",
    fixed_in="speculators 0.4.0",
    without_it="without it `generate()` takes the first layer's tensor for the whole reply and fails: `RuntimeError: Boolean value of Tensor with more than one value is ambiguous`",
    leave_one_out=(
        LeaveOneOut(
            "0.16.0",
            Symptom("generate 1", "RuntimeError", ("Boolean value of Tensor with more than one value is ambiguous",)),
        ),
        LeaveOneOut(
            "0.16.0",
            Symptom("generate 1", "RuntimeError", ("Boolean value of Tensor with more than one value is ambiguous",)),
            calls="all",
            tensor_parallel=2,
        ),
    ),
    on_fixed_in="anchor-missing",
)
