"""v25: let each request leave the scheduler once its prompt is computed, so one generate() call
may hold any number of prompts.

speculators 0.4.0 (and 0.4.0.1, the same file) steps the scheduler until every prompt's prefill
is counted, but finishes no request before the loop has ended. vLLM's scheduler runs at most
max_num_seqs requests at once (the generator sets MAX_NUM_SEQS = 32) and admits a waiting one only
into a free place: once the first 32 prompts are computed nothing is left to schedule, the loop
ends, and prompts 33 on never run. A call of more than 32 prompts fails, `RuntimeError: Request
req_0_32 not found in captured states` (vLLM 0.16 CPU, 40 short prompts; CUDA vLLM 0.26.0, 64
prompts of 1024 tokens). Not a vLLM change: every release.

Each step now ends by finishing those of its requests whose whole prompt is computed (the loop's
own test, taken from its `all_prefill_complete = all(...)`), as v11 does for 0.3.0, so the next
step admits waiting ones. The last step's requests are left to the abort after the loop: a
request finished in the loop reaches the workers only with the next scheduler output they
execute, and the loop's closing schedule() is never executed (v29 ends the call with one that
is). The worker's capture is unchanged (each step's rows go to that step's requests, `_set_request_metadata`), so a prompt is
whole however its steps fall; v22 gives the results back in the caller's order.
"""

from __future__ import annotations

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import EVERY_RELEASE, GENERATOR, SPECULATORS_0_4

DONE = "all_prefill_complete"
SELF_SCHEDULER = m.Attribute(value=m.Name("self"), attr=m.Name("scheduler"))
SELF_EXECUTOR = m.Attribute(value=m.Name("self"), attr=m.Name("executor"))

# (scheduler_output := self.scheduler.schedule()).total_num_scheduled_tokens > 0 and not all_prefill_complete
STEP_TEST = m.BooleanOperation(
    left=m.Comparison(
        left=m.Attribute(
            value=m.NamedExpr(
                target=m.Name(),
                value=m.Call(func=m.Attribute(value=SELF_SCHEDULER, attr=m.Name("schedule")), args=[]),
            ),
            attr=m.Name("total_num_scheduled_tokens"),
        ),
        comparisons=[m.ComparisonTarget(operator=m.GreaterThan(), comparator=m.Integer("0"))],
    ),
    operator=m.And(),
    right=m.UnaryOperation(operator=m.Not(), expression=m.Name(DONE)),
)
# all_prefill_complete = all(<a request's prompt is computed> for req_id in ...)
DONE_TEST = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name(DONE))],
            value=m.Call(
                func=m.Name("all"),
                args=[m.Arg(value=m.GeneratorExp(elt=m.Comparison(), for_in=m.CompFor(target=m.Name(), ifs=[])))],
            ),
        )
    ]
)
EXECUTE_MODEL = m.Call(func=m.Attribute(value=SELF_EXECUTOR, attr=m.Name("execute_model")))
FINISH_REQUESTS = m.Call(func=m.Attribute(value=SELF_SCHEDULER, attr=m.Name("finish_requests")))
FINISH_STATEMENT = m.SimpleStatementLine(body=[m.Expr(value=FINISH_REQUESTS)])
# the patched step's end: if not all_prefill_complete: self.scheduler.finish_requests(...)
RELEASE = m.If(
    test=m.UnaryOperation(operator=m.Not(), expression=m.Name(DONE)),
    body=m.IndentedBlock(body=[FINISH_STATEMENT]),
    orelse=None,
)


def release_statement(step: str, request: str, prompt_computed: cst.BaseExpression) -> cst.If:
    """What the step ends with: finish the step's requests whose prompt is computed (the loop's
    own test for it, `prompt_computed`, of the name `request`), unless the loop ends here."""
    test = cst.Module([]).code_for_node(prompt_computed)
    statement = cst.parse_statement(
        f"if not {DONE}:\n"
        "    self.scheduler.finish_requests(\n"
        "        [\n"
        f"            {request}\n"
        f"            for {request} in {step}.num_scheduled_tokens\n"
        f"            if {test}\n"
        "        ],\n"
        "        RequestStatus.FINISHED_ABORTED,\n"
        "    )\n"
    )
    assert isinstance(statement, cst.If)
    comment = (
        "# Let a request go once its prompt is computed: the scheduler runs at most max_num_seqs",
        "# requests and admits a waiting one only into a free place. The last step's requests",
        "# stay for the abort after the loop.",
    )
    return statement.with_changes(
        leading_lines=[cst.EmptyLine(indent=False), *(cst.EmptyLine(comment=cst.Comment(line)) for line in comment)]
    )


class ReleasePrefilledRequests(PatchCodemod):
    """The stepping loop `while (out := self.scheduler.schedule()).total_num_scheduled_tokens > 0 and
    not all_prefill_complete:` ends each step by finishing its requests whose prompt is computed.
    Patched: the loop's last statement is `if not all_prefill_complete: self.scheduler.finish_requests(...)`."""

    ANCHOR = (
        "a loop `while (scheduler_output := self.scheduler.schedule()).total_num_scheduled_tokens > 0 "
        "and not all_prefill_complete:` that sets `all_prefill_complete = all(... for req_id in ...)` and calls "
        "self.executor.execute_model(...), followed in its block by self.scheduler.finish_requests(...)"
    )

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        body = list(updated.body)
        for index, statement in enumerate(body):
            if not (isinstance(statement, cst.While) and m.matches(statement.test, STEP_TEST)):
                continue
            # the abort after the loop takes the last step's requests (and any the loop left)
            if not any(m.matches(later, FINISH_STATEMENT) for later in body[index + 1 :]):
                continue
            steps = list(statement.body.body)
            done = next((s for s in steps if m.matches(s, DONE_TEST)), None)
            if done is None or not any(m.findall(s, EXECUTE_MODEL) for s in steps):
                continue
            if m.matches(steps[-1], RELEASE):
                self.found_patched()
                continue
            test = statement.test
            assert isinstance(test, cst.BooleanOperation) and isinstance(test.left, cst.Comparison)
            named = test.left.left
            assert isinstance(named, cst.Attribute) and isinstance(named.value, cst.NamedExpr)
            step = named.value.target
            assert isinstance(done, cst.SimpleStatementLine)
            assign = done.body[0]
            assert isinstance(assign, cst.Assign)
            assert isinstance(assign.value, cst.Call) and isinstance(assign.value.args[0].value, cst.GeneratorExp)
            generator = assign.value.args[0].value
            request = generator.for_in.target
            assert isinstance(step, cst.Name) and isinstance(request, cst.Name)
            steps.append(release_statement(step.value, request.value, generator.elt))
            body[index] = statement.with_changes(body=statement.body.with_changes(body=steps))
            self.rewrote()
        return updated.with_changes(body=body)


# when=EVERY_RELEASE: Not a vLLM change: the scheduler has run at most max_num_seqs requests on every release.

BEFORE = """\
def generate(self, token_ids):
    request_num_computed = dict.fromkeys(request_id_to_idx, 0)
    all_prefill_complete = False

    while (
        scheduler_output := self.scheduler.schedule()
    ).total_num_scheduled_tokens > 0 and not all_prefill_complete:
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request_num_computed[req_id] += num_tokens

        all_prefill_complete = all(
            request_num_computed[req_id] >= request_id_to_prompt_len[req_id]
            for req_id in request_id_to_idx
        )

        model_output = self.executor.execute_model(scheduler_output)
        self.executor.sample_tokens(model_output)

    # Abort all requests (prefill complete, don't need decode)
    self.scheduler.finish_requests(
        list(request_id_to_idx.keys()), RequestStatus.FINISHED_ABORTED
    )
"""

AFTER = """\
def generate(self, token_ids):
    request_num_computed = dict.fromkeys(request_id_to_idx, 0)
    all_prefill_complete = False

    while (
        scheduler_output := self.scheduler.schedule()
    ).total_num_scheduled_tokens > 0 and not all_prefill_complete:
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request_num_computed[req_id] += num_tokens

        all_prefill_complete = all(
            request_num_computed[req_id] >= request_id_to_prompt_len[req_id]
            for req_id in request_id_to_idx
        )

        model_output = self.executor.execute_model(scheduler_output)
        self.executor.sample_tokens(model_output)

        # Let a request go once its prompt is computed: the scheduler runs at most max_num_seqs
        # requests and admits a waiting one only into a free place. The last step's requests
        # stay for the abort after the loop.
        if not all_prefill_complete:
            self.scheduler.finish_requests(
                [
                    req_id
                    for req_id in scheduler_output.num_scheduled_tokens
                    if request_num_computed[req_id] >= request_id_to_prompt_len[req_id]
                ],
                RequestStatus.FINISHED_ABORTED,
            )

    # Abort all requests (prefill complete, don't need decode)
    self.scheduler.finish_requests(
        list(request_id_to_idx.keys()), RequestStatus.FINISHED_ABORTED
    )
"""

# Near misses: each is the anchor less one part, and is left alone (anchor not found, bytes unchanged).
NEAR_MISSES = (
    # speculators 0.3.0's loop as v11 leaves it: it lets each request go after its step already
    """\
def generate(self):
    while (
        scheduler_output := self.scheduler.schedule()
    ).total_num_scheduled_tokens > 0:
        all_prefill_complete = all(computed[r] >= prompt_len[r] for r in request_id_to_idx)
        self.executor.execute_model(scheduler_output)
        for req_id in scheduler_output.num_scheduled_tokens:
            self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
    self.scheduler.finish_requests(unfinished, RequestStatus.FINISHED_ABORTED)
""",
    # no abort after the loop: the requests of its last step would stay in the scheduler
    """\
def generate(self):
    while (
        scheduler_output := self.scheduler.schedule()
    ).total_num_scheduled_tokens > 0 and not all_prefill_complete:
        all_prefill_complete = all(computed[r] >= prompt_len[r] for r in request_id_to_idx)
        self.executor.execute_model(scheduler_output)
    results = self.executor.collective_rpc("_get_captured_states", unique_reply_rank=0)
""",
    # the loop does not run the model: what it schedules is never computed
    """\
def generate(self):
    while (
        scheduler_output := self.scheduler.schedule()
    ).total_num_scheduled_tokens > 0 and not all_prefill_complete:
        all_prefill_complete = all(computed[r] >= prompt_len[r] for r in request_id_to_idx)
    self.scheduler.finish_requests(list(request_id_to_idx), RequestStatus.FINISHED_ABORTED)
""",
    # all_prefill_complete is decided elsewhere: nothing in the loop says which request is done
    """\
def generate(self):
    while (
        scheduler_output := self.scheduler.schedule()
    ).total_num_scheduled_tokens > 0 and not all_prefill_complete:
        all_prefill_complete = self.step_done(scheduler_output)
        self.executor.execute_model(scheduler_output)
    self.scheduler.finish_requests(list(request_id_to_idx), RequestStatus.FINISHED_ABORTED)
""",
)

PATCH = Patch(
    id="v25-release-prefilled-requests",
    title="each request leaves the scheduler once its prompt is computed: a generate() call takes any number of prompts",
    target=GENERATOR,
    requires=SPECULATORS_0_4,
    edits=(
        Edit(
            ReleasePrefilledRequests,
            when=EVERY_RELEASE,
            answers="vLLM's scheduler runs at most max_num_seqs requests at once (SchedulerConfig.max_num_seqs) "
            "and admits a waiting one only when a running one is finished",
            fact=Fact(
                "defines",
                "vllm.config.scheduler",
                "SchedulerConfig",
                "max_num_seqs",
                needs=(Fact("defines", "vllm.v1.core.sched.scheduler", "Scheduler", "finish_requests"),),
            ),
        ),
    ),
    examples=(Example(before=BEFORE, after=AFTER),),
    satisfied=(AFTER,),
    near_misses=NEAR_MISSES,
    upstream="not a vLLM change: speculators 0.4.0 vllm_hidden_states_generator.py, generate() "
    "(finishes its requests only after the loop; MAX_NUM_SEQS = 32)",
    without_it="without it a `generate()` call of more than 32 prompts (the generator's max_num_seqs) fails, "
    "`RuntimeError: Request req_0_32 not found in captured states`, on every vLLM release: the scheduler "
    "never admits prompts 33 on",
    leave_one_out=(
        LeaveOneOut(
            "0.16.0",
            Symptom("generate 5", "RuntimeError", ("Request req_0_32 not found in captured states",)),
            calls="5",
            speculators="0.4.0.1",
        ),
        LeaveOneOut(
            "0.16.0",
            Symptom("generate 5", "RuntimeError", ("Request req_4_32 not found in captured states",)),
            calls="all",
            tensor_parallel=2,
            speculators="0.4.0.1",
        ),
    ),
    since="any",
)
