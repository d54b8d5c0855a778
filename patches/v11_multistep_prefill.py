"""v11: keep stepping until each prompt's prefill is complete, and take every prompt's own rows.

Not a vLLM change. speculators 0.3.0 aborts every request scheduled in a step right after that
step. When a batch's prompts together exceed the step's token budget (max_num_batched_tokens,
max(8192, max_model_len) in 0.3.0), vLLM's scheduler computes the last prompt that fits only in
part; aborting it there leaves it cut, and the offset slicing then hands the following prompts
rows of others. Measured on vLLM 0.16 CPU: eleven prompts of 900-1000 tokens, the last came back
with 694 rows instead of 977, and the two before it with rows of their neighbours.

In generate(), with v10's worker (which it needs):
- while adding requests, remember {request id: prompt tokens} in the caller's order;
- before each execute_model(), tell the worker which requests the step computes
  (_set_request_metadata with scheduler_output.num_scheduled_tokens);
- abort a request only once its whole prompt is computed (after schedule(), vLLM has already
  counted the step's tokens in request.num_computed_tokens), so a split prompt is continued in
  the next step;
- after the loop, abort whatever the scheduler could not start, so it cannot leak into the
  next call;
- ask the worker for the rows request by request, in the caller's order: the existing offset
  slicing (which v2 edits) then hands every prompt exactly its own rows.
speculators 0.4.0 steps the same way but returns results sorted by the request id as a string.
"""

from __future__ import annotations

import textwrap

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod, SkipFile, append_arg, has_keyword, keyword_arg
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import EVERY_RELEASE, GENERATOR, SPECULATORS_0_3

TOKENS = "request_tokens"
SELF_SCHEDULER = m.Attribute(value=m.Name("self"), attr=m.Name("scheduler"))
SELF_EXECUTOR = m.Attribute(value=m.Name("self"), attr=m.Name("executor"))


def call_statement(call: m.Shape) -> m.Shape:
    return m.SimpleStatementLine(body=[m.Expr(value=call) | m.Assign(value=call)])


ADD_REQUEST = m.SimpleStatementLine(
    body=[
        m.Expr(
            value=m.Call(
                func=m.Attribute(value=SELF_SCHEDULER, attr=m.Name("add_request")), args=[m.Arg(value=m.Name())]
            )
        )
    ]
)
EXECUTE_MODEL = call_statement(m.Call(func=m.Attribute(value=SELF_EXECUTOR, attr=m.Name("execute_model"))))
COLLECTIVE_RPC = m.Attribute(value=SELF_EXECUTOR, attr=m.Name("collective_rpc"))


def rpc_named(name: str) -> m.Shape:
    return m.Call(
        func=COLLECTIVE_RPC,
        args=[m.Arg(value=m.SimpleString(f'"{name}"') | m.SimpleString(f"'{name}'")), m.ZeroOrMore()],
    )


# The RPC naming the step's requests; with v21 the same RPC carries the states written so far
# (`_states_while_stepping(self, request_tokens, scheduled)`): the metadata is sent either way.
SET_METADATA = call_statement(rpc_named("_set_request_metadata")) | call_statement(
    m.Call(func=m.Name("_states_while_stepping"))
)
GET_CAPTURED = rpc_named("_get_captured_states")
FINISH_REQUESTS = call_statement(m.Call(func=m.Attribute(value=SELF_SCHEDULER, attr=m.Name("finish_requests"))))
ABORT_LOOP = m.For(
    target=m.Name(),
    iter=m.Attribute(attr=m.Name("num_scheduled_tokens")),
    body=m.IndentedBlock(body=[FINISH_REQUESTS]),
)
PREFILL_DONE_TEST = m.Comparison(
    left=m.Attribute(attr=m.Name("num_computed_tokens")),
    comparisons=[m.ComparisonTarget(operator=m.GreaterThanEqual())],
)
GUARDED_ABORT_LOOP = m.For(
    target=m.Name(),
    iter=m.Attribute(attr=m.Name("num_scheduled_tokens")),
    body=m.IndentedBlock(body=[m.If(test=PREFILL_DONE_TEST)]),
)
TOKENS_INIT = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name(TOKENS))], value=m.Dict())])
TOKENS_RECORD = m.SimpleStatementLine(
    body=[m.Assign(targets=[m.AssignTarget(target=m.Subscript(value=m.Name(TOKENS)))])]
)
UNFINISHED = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name("unfinished"))])])


def block_statements(source: str) -> list[cst.BaseStatement]:
    """`source` parsed as statements of a block (comments and blank lines kept with them)."""
    wrapper = cst.parse_module("if True:\n" + textwrap.indent(source, "    ")).body[0]
    assert isinstance(wrapper, cst.If) and isinstance(wrapper.body, cst.IndentedBlock)
    return list(wrapper.body.body)


def metadata_statement(scheduler_output: cst.BaseExpression) -> cst.BaseStatement:
    expr = cst.Module([]).code_for_node(scheduler_output)
    return cst.parse_statement(
        "self.executor.collective_rpc(\n"
        '    "_set_request_metadata",\n'
        f"    args=(dict({expr}.num_scheduled_tokens),),\n"
        ")\n"
    )


def guarded_finish(loop: cst.For) -> cst.For:
    target = loop.target
    assert isinstance(target, cst.Name)
    finish = loop.body.body[0]
    guard = cst.parse_statement(
        "if (\n"
        f"    self.scheduler.requests[{target.value}].num_computed_tokens\n"
        f"    >= {TOKENS}[{target.value}]\n"
        "):\n"
        "    pass\n"
    )
    assert isinstance(guard, cst.If)
    comment = [
        cst.EmptyLine(comment=cst.Comment("# Abort a request only once its whole prompt is computed: vLLM")),
        cst.EmptyLine(comment=cst.Comment("# splits prompts longer than the step's token budget across steps.")),
    ]
    guard = guard.with_changes(
        leading_lines=comment,
        body=guard.body.with_changes(body=[finish.with_changes(leading_lines=())]),
    )
    return loop.with_changes(body=loop.body.with_changes(body=[guard]))


UNFINISHED_SOURCE = f"""\

# Requests the scheduler could not start (too little KV cache) must not leak into the next call.
unfinished = [r for r in {TOKENS} if r in self.scheduler.requests]
if unfinished:
    self.scheduler.finish_requests(unfinished, RequestStatus.FINISHED_ABORTED)
"""


class _Parts(cst.CSTTransformer):
    """The five places of one function; each counts as found when rewritten or already patched."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, str] = {}  # part -> "rewrote" | "patched"
        self.indent_stack: list[str] = []

    def mark(self, part: str, state: str) -> None:
        self.found.setdefault(part, state)

    # --- blocks holding several of the places ----------------------------------------------

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        body = list(updated.body)
        out: list[cst.BaseStatement] = []
        for index, statement in enumerate(body):
            previous = out[-1] if out else None
            following = body[index + 1] if index + 1 < len(body) else None
            # (1) request_tokens = {} before the loop that adds requests
            if isinstance(statement, cst.For) and any(m.matches(s, ADD_REQUEST) for s in statement.body.body):
                if any(m.matches(s, TOKENS_INIT) for s in out):
                    self.mark("init", "patched")
                else:
                    self.mark("init", "rewrote")
                    # The new statement takes over the blank lines and comments above the loop.
                    out.append(
                        cst.parse_statement(f"{TOKENS} = {{}}\n").with_changes(leading_lines=statement.leading_lines)
                    )
                    statement = statement.with_changes(leading_lines=())
            # (3) metadata before execute_model
            if m.matches(statement, EXECUTE_MODEL):
                if previous is not None and m.matches(previous, SET_METADATA):
                    self.mark("metadata", "patched")
                else:
                    call = m.findall(statement, m.Call(func=m.Attribute(attr=m.Name("execute_model"))))[0]
                    assert isinstance(call, cst.Call) and call.args
                    self.mark("metadata", "rewrote")
                    out.append(
                        metadata_statement(call.args[0].value).with_changes(leading_lines=statement.leading_lines)
                    )
                    statement = statement.with_changes(leading_lines=())
            out.append(statement)
            # (2) request_tokens[req.request_id] = ... after add_request
            if m.matches(statement, ADD_REQUEST):
                if following is not None and m.matches(following, TOKENS_RECORD):
                    self.mark("record", "patched")
                else:
                    request = statement.body[0].value.args[0].value.value
                    self.mark("record", "rewrote")
                    out.append(
                        cst.parse_statement(f"{TOKENS}[{request}.request_id] = len({request}.prompt_token_ids)\n")
                    )
            # (5) abort what could not start, after the stepping loop
            if isinstance(statement, cst.While) and m.findall(statement, EXECUTE_MODEL):
                if following is not None and m.matches(following, UNFINISHED):
                    self.mark("unfinished", "patched")
                else:
                    self.mark("unfinished", "rewrote")
                    out.extend(block_statements(UNFINISHED_SOURCE))
        return updated.with_changes(body=out)

    # (4) abort only once the prefill is complete
    def leave_For(self, original: cst.For, updated: cst.For) -> cst.For:
        if m.matches(updated, GUARDED_ABORT_LOOP):
            self.mark("guard", "patched")
            return updated
        if m.matches(updated, ABORT_LOOP):
            self.mark("guard", "rewrote")
            return guarded_finish(updated)
        return updated

    # (6) ask for the rows by request, in the caller's order
    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not m.matches(updated, GET_CAPTURED):
            return updated
        if has_keyword(updated, "args") or len([a for a in updated.args if a.keyword is None]) > 1:
            self.mark("get", "patched")
            return updated
        self.mark("get", "rewrote")
        args = list(updated.args)
        new = keyword_arg("args", cst.parse_expression(f"({TOKENS},)"))
        # args=... goes right after the method name, before unique_reply_rank=...
        if len(args) > 1:
            new = new.with_changes(comma=args[0].comma)
            args.insert(1, new)
            return updated.with_changes(args=args)
        return append_arg(updated, new)


PARTS = ("init", "record", "metadata", "guard", "unfinished", "get")


class PrefillAcrossSteps(PatchCodemod):
    """In the function that adds requests and steps the scheduler (generate), all six places
    or none: a partial edit would leave `request_tokens` undefined or unused."""

    ANCHOR = (
        "a function with a loop calling self.scheduler.add_request(req), a while loop calling "
        "self.executor.execute_model(...) and aborting every scheduled request "
        "(for req_id in ....num_scheduled_tokens: self.scheduler.finish_requests(...)), and "
        'self.executor.collective_rpc("_get_captured_states", ...)'
    )

    def __init__(self, filename: str = "<source>") -> None:
        super().__init__(filename)
        # Per enclosing function: which of ADD_REQUEST, EXECUTE_MODEL its body holds (nested
        # functions included), noted on the way instead of searching every function again.
        self.functions: list[set[str]] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.functions.append(set())

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        if self.functions:
            seen = {
                name for name, shape in (("add", ADD_REQUEST), ("execute", EXECUTE_MODEL)) if m.matches(updated, shape)
            }
            for frame in self.functions:
                frame |= seen
        return updated

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if self.functions.pop() != {"add", "execute"}:
            return updated
        parts = _Parts()
        result = updated.visit(parts)
        missing = [p for p in PARTS if p not in parts.found]
        if missing:
            raise SkipFile(f"anchor not found: expected {self.ANCHOR} (missing: {', '.join(missing)})")
        if all(state == "patched" for state in parts.found.values()):
            self.found_patched()
            return updated
        self.rewrote()
        assert isinstance(result, cst.FunctionDef)
        return result


# when=EVERY_RELEASE: 0.3.0's own loop, wrong wherever vLLM v1 splits a prompt across steps.

BEFORE = """\
def generate(self, token_ids):
    for i, ids in enumerate(input_ids_list):
        req = Request(request_id=f"req_{self._request_counter}_{i}", prompt_token_ids=ids)
        self.scheduler.add_request(req)

    self._request_counter += 1
    self.executor.collective_rpc("_reset_capture")

    while (
        scheduler_output := self.scheduler.schedule()
    ).total_num_scheduled_tokens > 0:
        self.executor.execute_model(scheduler_output)
        self.executor.sample_tokens(None)

        for req_id in scheduler_output.num_scheduled_tokens:
            self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    captured_states_list = self.executor.collective_rpc(
        "_get_captured_states",
        unique_reply_rank=0,
    )
    return captured_states_list
"""

AFTER = """\
def generate(self, token_ids):
    request_tokens = {}
    for i, ids in enumerate(input_ids_list):
        req = Request(request_id=f"req_{self._request_counter}_{i}", prompt_token_ids=ids)
        self.scheduler.add_request(req)
        request_tokens[req.request_id] = len(req.prompt_token_ids)

    self._request_counter += 1
    self.executor.collective_rpc("_reset_capture")

    while (
        scheduler_output := self.scheduler.schedule()
    ).total_num_scheduled_tokens > 0:
        self.executor.collective_rpc(
            "_set_request_metadata",
            args=(dict(scheduler_output.num_scheduled_tokens),),
        )
        self.executor.execute_model(scheduler_output)
        self.executor.sample_tokens(None)

        for req_id in scheduler_output.num_scheduled_tokens:
            # Abort a request only once its whole prompt is computed: vLLM
            # splits prompts longer than the step's token budget across steps.
            if (
                self.scheduler.requests[req_id].num_computed_tokens
                >= request_tokens[req_id]
            ):
                self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    # Requests the scheduler could not start (too little KV cache) must not leak into the next call.
    unfinished = [r for r in request_tokens if r in self.scheduler.requests]
    if unfinished:
        self.scheduler.finish_requests(unfinished, RequestStatus.FINISHED_ABORTED)

    captured_states_list = self.executor.collective_rpc(
        "_get_captured_states",
        args=(request_tokens,),
        unique_reply_rank=0,
    )
    return captured_states_list
"""

PATCH = Patch(
    id="v11-multistep-prefill",
    title="step until every prompt's prefill is complete; take each prompt's own rows, in order",
    target=GENERATOR,
    requires=SPECULATORS_0_3,
    edits=(
        Edit(
            PrefillAcrossSteps,
            when=EVERY_RELEASE,
            answers="vLLM's scheduler splits a prompt across steps when a batch exceeds "
            "max_num_batched_tokens, and counts scheduled tokens in request.num_computed_tokens",
            fact=Fact(
                "defines",
                "vllm.v1.request",
                "Request",
                "num_computed_tokens",
                needs=(Fact("defines", "vllm.v1.core.sched.output", "SchedulerOutput", "num_scheduled_tokens"),),
            ),
        ),
    ),
    examples=(Example(before=BEFORE, after=AFTER),),
    satisfied=(AFTER,),
    near_misses=(
        # a stepping loop that aborts no request per step: not 0.3.0's loop
        """
            def generate(self, token_ids):
                for i, ids in enumerate(input_ids_list):
                    req = Request(request_id=f"req_{self._request_counter}_{i}", prompt_token_ids=ids)
                    self.scheduler.add_request(req)

                self._request_counter += 1
                self.executor.collective_rpc("_reset_capture")

                while (
                    scheduler_output := self.scheduler.schedule()
                ).total_num_scheduled_tokens > 0:
                    self.executor.execute_model(scheduler_output)
                    self.executor.sample_tokens(None)

                captured_states_list = self.executor.collective_rpc(
                    "_get_captured_states",
                    unique_reply_rank=0,
                )
                return captured_states_list
        """,
    ),
    upstream="not a vLLM change: vLLM v1's chunked prefill (vllm/v1/core/sched/scheduler.py); "
    "speculators 0.4.0 steps until prefill completes but sorts results by request id string",
    fixed_in="speculators 0.4.0 (its results come back out of order from the eleventh prompt of a call on: v22)",
    needs=("v10-worker-request-capture",),
    without_it="silently cut data without it: a prompt vLLM splits across scheduler steps (a batch over the step's 8192-token budget) comes back short (694 of 977 rows measured) and its neighbours get each other's rows; needs v10",
    leave_one_out=(
        LeaveOneOut("0.16.0", Symptom("rows"), calls="3"),
        LeaveOneOut("0.16.0", Symptom("rows"), calls="all", tensor_parallel=2),
    ),
    since="any",
    on_fixed_in="anchor-missing",
)
