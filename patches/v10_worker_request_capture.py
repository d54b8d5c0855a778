"""v10: the worker records which request every captured row belongs to, and can return the rows
request by request, in the order the caller asks for.

Not a vLLM change, but what a correct capture needs on every release: vLLM splits a prompt across
scheduler steps when a batch exceeds the step's token budget, and orders the rows of a step by
its input batch (vllm/v1/worker/gpu_input_batch.py, req_id_to_index), not by the order requests
were added. speculators 0.3.0's worker only concatenates rows; the generator then slices them by
prompt length in its own order. On vLLM 0.16 CPU, eleven prompts of 900-1000 tokens: the
second step held [req 9, req 10, req 8 (its second part)].

This patch adds, without changing what the old calls do:
- `_set_request_metadata({request id: tokens scheduled})`, sent before each step (v11 does);
- in `_store_captured_states`, that step's requests in vLLM's batch order (as speculators 0.4.0
  does, from `model_runner.input_batch.req_id_to_index`);
- `_get_captured_states(request_tokens=None)`: with {request id: prompt tokens} (in the caller's
  order), per layer one tensor holding each request's rows in that order, raising unless every
  request has exactly its number of rows; without it, the old concatenation.
speculators 0.4.0 keys the result by request id and its generator sorts the ids as strings
(req_0_10 before req_0_2); here the caller's order is kept.
"""

from __future__ import annotations

import textwrap

import libcst as cst

from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import EVERY_RELEASE, SPECULATORS_0_3, WORKER

HELPER = "_rows_by_request"
SET_METADATA = "_set_request_metadata"
STORE = "_store_captured_states"
RESET = "_reset_capture"
GET = "_get_captured_states"
PARAM = "request_tokens"

HELPER_SOURCE = '''\
def _rows_by_request(captured, steps, request_tokens):
    """Each request's captured rows, in the order of request_tokens, from every step.

    captured: per layer, one tensor per forward step; steps: per step, [(request id,
    rows)] in vLLM's batch order (rows past their sum are padding). Raises unless each
    request has exactly its number of prompt tokens.
    """
    if len(steps) != len(captured[0]):
        raise RuntimeError(
            f"captured {len(captured[0])} forward steps, request metadata for {len(steps)}"
        )
    pieces = {request_id: [] for request_id in request_tokens}
    for step, scheduled in enumerate(steps):
        if scheduled is None:
            raise RuntimeError(f"step {step} ran without request metadata")
        start = 0
        for request_id, count in scheduled:
            if request_id in pieces:
                pieces[request_id].append((step, start, count))
            start += count
        if start > captured[0][step].shape[0]:
            raise RuntimeError(
                f"step {step}: {start} tokens scheduled, "
                f"{captured[0][step].shape[0]} rows captured"
            )
    for request_id, expected in request_tokens.items():
        got = sum(count for _, _, count in pieces[request_id])
        if got != expected:
            raise RuntimeError(
                f"request {request_id}: captured {got} rows of hidden states, "
                f"expected {expected}"
            )
    return [
        torch.cat(
            [
                layer_steps[step][start : start + count]
                for request_id in request_tokens
                for step, start, count in pieces[request_id]
            ],
            dim=0,
        )
        for layer_steps in captured
    ]
'''

STORE_ADDITION = """\

# Which request each row of this step belongs to, in vLLM's batch order
# (vLLM reorders requests and splits long prompts across steps).
scheduled = getattr(self, "_current_request_metadata", None)
self._current_request_metadata = None
steps = getattr(self, "_request_metadata", None)
if steps is None:
    steps = self._request_metadata = []
if scheduled is None:
    steps.append(None)
else:
    index = self.model_runner.input_batch.req_id_to_index  # type: ignore[attr-defined]
    steps.append(
        sorted(scheduled.items(), key=lambda item: index.get(item[0], len(index)))
    )
"""

SET_METADATA_SOURCE = '''\
def _set_request_metadata(self, request_metadata):
    """Requests of the next forward pass: {request id: number of scheduled tokens}."""
    self._current_request_metadata = dict(request_metadata)
'''

RESET_ADDITION = """\
self._request_metadata = []
self._current_request_metadata = None
"""

GET_SOURCE = '''\
def _get_captured_states(self, request_tokens=None):
    """Get the captured hidden states

    Args:
        request_tokens: {request id: number of prompt tokens}, in the caller's order;
            None keeps the rows in the order vLLM computed them.

    Returns:
        List of tensors, one per target layer, or None if no states captured; with
        request_tokens, each request's rows in the caller's order (raises unless every
        request has exactly its number of prompt tokens).
    """
    if self._captured_states is None:
        return None
    steps = getattr(self, "_request_metadata", None) or []
    if request_tokens is not None:
        result = _rows_by_request(self._captured_states, steps, request_tokens)
    else:
        # Concatenate lists of tensors into single tensors
        result = [
            torch.cat(layer_tensors, dim=0) for layer_tensors in self._captured_states
        ]
    # Clear intermediate storage after concatenating
    self._captured_states = None  # type: ignore[assignment]
    self._request_metadata = []
    return result
'''


def method_statements(source: str) -> list[cst.BaseStatement]:
    """Statements of `source` as they would sit in a method body (leading comments kept)."""
    block = cst.parse_module("class _T:\n    def _m(self):\n" + textwrap.indent(source, "        ")).body[0]
    assert isinstance(block, cst.ClassDef)
    method = block.body.body[0]
    assert isinstance(method, cst.FunctionDef) and isinstance(method.body, cst.IndentedBlock)
    return list(method.body.body)


def method_def(source: str) -> cst.FunctionDef:
    block = cst.parse_module("class _T:\n" + textwrap.indent(source, "    ")).body[0]
    assert isinstance(block, cst.ClassDef)
    method = block.body.body[0]
    assert isinstance(method, cst.FunctionDef)
    return method


def param_names(node: cst.FunctionDef) -> list[str]:
    return [p.name.value for p in node.params.params]


def methods_of(node: cst.ClassDef) -> dict[str, cst.FunctionDef]:
    if not isinstance(node.body, cst.IndentedBlock):
        return {}
    return {s.name.value: s for s in node.body.body if isinstance(s, cst.FunctionDef)}


def append_to_body(node: cst.FunctionDef, statements: list[cst.BaseStatement]) -> cst.FunctionDef:
    assert isinstance(node.body, cst.IndentedBlock)
    return node.with_changes(body=node.body.with_changes(body=[*node.body.body, *statements]))


# when=EVERY_RELEASE: chunked prefill and batch reordering are how vLLM v1 schedules.


class WorkerRecordsRequestRows(PatchCodemod):
    """In the class defining _store_captured_states, _reset_capture and _get_captured_states(self):
    record each step's requests, add _set_request_metadata, reset the record with the rest, and
    give _get_captured_states a request_tokens parameter (module helper _rows_by_request).

    Patched: the class has _set_request_metadata and _get_captured_states takes request_tokens.
    speculators 0.4.0 has the first but not the second (it returns a dict keyed by id): neither
    shape, so anchor-missing.
    """

    ANCHOR = f"a class with {STORE}, {RESET} and {GET}(self), and no {SET_METADATA}"

    def __init__(self, filename: str = "<source>") -> None:
        super().__init__(filename)
        self.needs_helper = False

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        methods = methods_of(updated)
        if SET_METADATA in methods and GET in methods and PARAM in param_names(methods[GET]):
            self.found_patched()
            self.needs_helper = True
            return updated
        if not ({STORE, RESET, GET} <= methods.keys() and SET_METADATA not in methods):
            return updated
        if param_names(methods[GET]) != ["self"]:
            return updated
        self.rewrote()
        self.needs_helper = True
        body: list[cst.BaseStatement] = []
        assert isinstance(updated.body, cst.IndentedBlock)
        for statement in updated.body.body:
            if not isinstance(statement, cst.FunctionDef):
                body.append(statement)
                continue
            name = statement.name.value
            if name == STORE:
                body.append(append_to_body(statement, method_statements(STORE_ADDITION)))
                body.append(method_def(SET_METADATA_SOURCE).with_changes(leading_lines=[cst.EmptyLine(indent=False)]))
            elif name == RESET:
                body.append(append_to_body(statement, method_statements(RESET_ADDITION)))
            elif name == GET:
                body.append(method_def(GET_SOURCE).with_changes(leading_lines=statement.leading_lines))
            else:
                body.append(statement)
        return updated.with_changes(body=updated.body.with_changes(body=body))

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        if not self.needs_helper:
            return updated
        if any(isinstance(s, cst.FunctionDef) and s.name.value == HELPER for s in updated.body):
            return updated
        self.rewrote()
        helper = cst.parse_statement(HELPER_SOURCE).with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
        body = list(updated.body)
        index = next((i for i, s in enumerate(body) if isinstance(s, cst.ClassDef)), len(body))
        body.insert(index, helper)
        return updated.with_changes(body=body)


BEFORE = '''\
import torch


class HiddenStatesWorkerExtension:
    def _store_captured_states(self, aux_hidden_states):
        if self._captured_states is None:
            self._captured_states = [[h] for h in aux_hidden_states]
        else:
            for i, h in enumerate(aux_hidden_states):
                self._captured_states[i].append(h)

    def _reset_capture(self):
        """Reset captured states before starting a new batch"""
        self._captured_states = None

    def _get_captured_states(self):
        if self._captured_states is None:
            return None
        result = [torch.cat(t, dim=0) for t in self._captured_states]
        self._captured_states = None
        return result
'''

AFTER = (
    "import torch\n\n\n"
    + HELPER_SOURCE
    + """

class HiddenStatesWorkerExtension:
    def _store_captured_states(self, aux_hidden_states):
        if self._captured_states is None:
            self._captured_states = [[h] for h in aux_hidden_states]
        else:
            for i, h in enumerate(aux_hidden_states):
                self._captured_states[i].append(h)
"""
    + textwrap.indent(STORE_ADDITION, " " * 8)
    + "\n"
    + textwrap.indent(SET_METADATA_SOURCE, " " * 4)
    + """
    def _reset_capture(self):
        \"\"\"Reset captured states before starting a new batch\"\"\"
        self._captured_states = None
"""
    + textwrap.indent(RESET_ADDITION, " " * 8)
    + "\n"
    + textwrap.indent(GET_SOURCE, " " * 4)
)  # the BEFORE class with the codemod's additions, in the layout it writes them

PATCH = Patch(
    id="v10-worker-request-capture",
    title="worker: record each captured row's request; return rows request by request, in the caller's order",
    target=WORKER,
    requires=SPECULATORS_0_3,
    edits=(
        Edit(
            WorkerRecordsRequestRows,
            when=EVERY_RELEASE,
            answers="vLLM splits prompts across scheduler steps and orders a step's rows by its "
            "input batch (req_ids; the V1 runner's model_runner.input_batch.req_id_to_index, which "
            "v27 reads from Model Runner V2's batch of the step where V1 is gone)",
            # the V1 runner's batch (vllm/v1/worker/gpu_input_batch.py) until 0.33, Model Runner V2's
            # (vllm/v1/worker/gpu/input_batch.py) in 0.34, which removed V1
            fact=Fact(
                "defines",
                ("vllm.v1.worker.gpu_input_batch", "vllm.v1.worker.gpu.input_batch"),
                "InputBatch",
                "req_ids",
            ),
        ),
    ),
    examples=(Example(before=BEFORE, after=AFTER),),
    satisfied=(AFTER,),
    near_misses=(
        # a worker whose _get_captured_states already takes the request ids (speculators 0.4's shape)
        '''
            import torch


            class HiddenStatesWorkerExtension:
                def _store_captured_states(self, aux_hidden_states):
                    if self._captured_states is None:
                        self._captured_states = [[h] for h in aux_hidden_states]
                    else:
                        for i, h in enumerate(aux_hidden_states):
                            self._captured_states[i].append(h)

                def _reset_capture(self):
                    """Reset captured states before starting a new batch"""
                    self._captured_states = None

                def _get_captured_states(self, request_ids):
                    if self._captured_states is None:
                        return None
                    result = {r: [torch.cat(t, dim=0) for t in self._captured_states] for r in request_ids}
                    self._captured_states = None
                    return result
        ''',
    ),
    upstream="not a vLLM change: vLLM v1's chunked prefill and input batch ordering "
    "(vllm/v1/core/sched/scheduler.py, vllm/v1/worker/gpu_input_batch.py); speculators 0.4.0 "
    "tracks requests the same way but returns them sorted by id string",
    fixed_in="speculators 0.4.0 (its results come back out of order from the eleventh prompt of a call on: v22)",
    without_it="harmless alone (the old calls behave as before); v11 needs it: with both, rows are attributed to their own request in the caller's order, and a request with too few or too many rows raises instead of returning wrong data. Without both, a prompt that vLLM splits across steps comes back cut and the prompts after it get rows of others",
    leave_one_out=(
        LeaveOneOut("0.16.0", Symptom("rows"), calls="3"),
        LeaveOneOut("0.16.0", Symptom("rows"), calls="all", tensor_parallel=2),
    ),
    since="any",
    on_fixed_in="anchor-missing",
)
