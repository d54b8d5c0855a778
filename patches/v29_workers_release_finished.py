"""v29: end each generate() call with one scheduler output, without tokens, that tells the workers
every request of the call is finished.

A worker frees a request's state only when a scheduler output it executes names the request in
`finished_req_ids`. speculators' stepping loop (0.3.0 and 0.4.x) ends on a `schedule()` that is
never executed: the requests finished by the last step (v11's aborts, 0.3.0) or after the loop
(0.4.x's abort of every request) reach the workers in the next call at the earliest. Model Runner
V2 keeps one slot per request (`RequestState`, max_num_seqs of them), so the leak fills them and a
later call fails in the worker, `AssertionError: No free indices` (CUDA vLLM 0.26.0 on V2: the
fifth call, 70 prompts, after calls of 7, 5, 11 and 4); V1 keeps each request's cached state until
the process ends. Not a vLLM change: every release.

After the call's last `finish_requests`, every request of the call is finished, so a new
`schedule()` has no tokens to schedule; it is given the ids the loop's closing output named and
executed: the workers update their request states (finished ones out) and return without a
forward pass, on V1 and V2 alike. The two-phase contract (0.11.1 on: `sample_tokens()` after an
`execute_model()` that returned None, v5) holds as written: without tokens execute_model() returns
its output at once.
"""

from __future__ import annotations

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import EVERY_RELEASE, GENERATOR, SPECULATORS_0_3_OR_0_4

FINISHED_OUTPUT = "finished_output"
SELF_SCHEDULER = m.Attribute(value=m.Name("self"), attr=m.Name("scheduler"))
SELF_EXECUTOR = m.Attribute(value=m.Name("self"), attr=m.Name("executor"))
# (scheduler_output := self.scheduler.schedule()), in the stepping loop's test
STEP_SCHEDULE = m.NamedExpr(
    target=m.Name(), value=m.Call(func=m.Attribute(value=SELF_SCHEDULER, attr=m.Name("schedule")), args=[])
)
FINISH_REQUESTS = m.Call(func=m.Attribute(value=SELF_SCHEDULER, attr=m.Name("finish_requests")))
# the patched end: if self.executor.execute_model(finished_output) is None: ...
EXECUTE_FINISHED = m.If(
    test=m.Comparison(
        left=m.Call(
            func=m.Attribute(value=SELF_EXECUTOR, attr=m.Name("execute_model")),
            args=[m.Arg(value=m.Name(FINISHED_OUTPUT))],
        )
    )
)


def finished_statements(step: str) -> list[cst.BaseStatement]:
    """The call's new end: one more scheduler output, no tokens, naming the finished requests."""
    module = cst.parse_module(
        f"{FINISHED_OUTPUT} = self.scheduler.schedule()\n"
        f"{FINISHED_OUTPUT}.finished_req_ids.update({step}.finished_req_ids)\n"
        f"if self.executor.execute_model({FINISHED_OUTPUT}) is None:\n"
        "    self.executor.sample_tokens(None)\n"
    )
    comment = (
        "# The workers free a request's state when an executed scheduler output names it finished,",
        "# and the loop's closing schedule() is never executed. Every request of the call is",
        "# finished now, so one more output has no tokens: it tells the workers, and runs nothing.",
    )
    first = module.body[0].with_changes(
        leading_lines=[cst.EmptyLine(indent=False), *(cst.EmptyLine(comment=cst.Comment(line)) for line in comment)]
    )
    return [first, *module.body[1:]]


class TellWorkersFinished(PatchCodemod):
    """After the stepping loop `while (scheduler_output := self.scheduler.schedule())...:` and the
    call's last self.scheduler.finish_requests(...) that follows it in the same block, the workers
    execute one more scheduler output naming the finished requests.
    Patched: the block holds `if self.executor.execute_model(finished_output) is None:` after the loop."""

    ANCHOR = "a loop `while (scheduler_output := self.scheduler.schedule())...:` in a block"

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        body = self.told(list(updated.body))
        return updated if body is None else updated.with_changes(body=body)

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        body = self.told(list(updated.body))
        return updated if body is None else updated.with_changes(body=body)

    def told(self, body: list) -> list | None:
        """`body` with the workers told after its stepping loop; None where nothing changes."""
        for index, statement in enumerate(body):
            if not isinstance(statement, cst.While):
                continue
            steps = m.findall(statement.test, STEP_SCHEDULE)
            if not steps:
                continue
            later = body[index + 1 :]
            if any(m.matches(s, EXECUTE_FINISHED) for s in later):
                self.found_patched()
                continue
            step = steps[0]
            assert isinstance(step, cst.NamedExpr) and isinstance(step.target, cst.Name)
            # after the call's last finish_requests (v11's, 0.4.x's abort of every request), if any
            at = index + 1
            for offset, after in enumerate(later):
                if m.findall(after, FINISH_REQUESTS):
                    at = index + 2 + offset
            body[at:at] = finished_statements(step.target.value)
            self.rewrote()
            return body
        return None


# speculators 0.3.0's loop (v11 patches its inside; its abort of unstarted requests follows it)
BEFORE_0_3 = """\
while (
    scheduler_output := self.scheduler.schedule()
).total_num_scheduled_tokens > 0:
    self.executor.execute_model(scheduler_output)
    for req_id in scheduler_output.num_scheduled_tokens:
        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

# Get captured states from driver worker
captured_states_list = self.executor.collective_rpc("_get_captured_states", unique_reply_rank=0)
"""
AFTER_0_3 = """\
while (
    scheduler_output := self.scheduler.schedule()
).total_num_scheduled_tokens > 0:
    self.executor.execute_model(scheduler_output)
    for req_id in scheduler_output.num_scheduled_tokens:
        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

# The workers free a request's state when an executed scheduler output names it finished,
# and the loop's closing schedule() is never executed. Every request of the call is
# finished now, so one more output has no tokens: it tells the workers, and runs nothing.
finished_output = self.scheduler.schedule()
finished_output.finished_req_ids.update(scheduler_output.finished_req_ids)
if self.executor.execute_model(finished_output) is None:
    self.executor.sample_tokens(None)

# Get captured states from driver worker
captured_states_list = self.executor.collective_rpc("_get_captured_states", unique_reply_rank=0)
"""
# speculators 0.4.x's: every request is aborted after the loop
BEFORE_0_4 = """\
while (
    scheduler_output := self.scheduler.schedule()
).total_num_scheduled_tokens > 0 and not all_prefill_complete:
    model_output = self.executor.execute_model(scheduler_output)
    self.executor.sample_tokens(model_output)

# Abort all requests (prefill complete, don't need decode)
self.scheduler.finish_requests(
    list(request_id_to_idx.keys()), RequestStatus.FINISHED_ABORTED
)

# Get captured states organized by request ID
request_states_dict = self.executor.collective_rpc(
    "_get_captured_states",
    unique_reply_rank=0,
)
"""
AFTER_0_4 = """\
while (
    scheduler_output := self.scheduler.schedule()
).total_num_scheduled_tokens > 0 and not all_prefill_complete:
    model_output = self.executor.execute_model(scheduler_output)
    self.executor.sample_tokens(model_output)

# Abort all requests (prefill complete, don't need decode)
self.scheduler.finish_requests(
    list(request_id_to_idx.keys()), RequestStatus.FINISHED_ABORTED
)

# The workers free a request's state when an executed scheduler output names it finished,
# and the loop's closing schedule() is never executed. Every request of the call is
# finished now, so one more output has no tokens: it tells the workers, and runs nothing.
finished_output = self.scheduler.schedule()
finished_output.finished_req_ids.update(scheduler_output.finished_req_ids)
if self.executor.execute_model(finished_output) is None:
    self.executor.sample_tokens(None)

# Get captured states organized by request ID
request_states_dict = self.executor.collective_rpc(
    "_get_captured_states",
    unique_reply_rank=0,
)
"""

LEFT_IN_WORKERS = Symptom("generate 1", "RuntimeError", ("left", "requests in the workers' model runner"))
NO_FREE_SLOT = Symptom("generate 5", "RuntimeError", ("No free indices",))

PATCH = Patch(
    id="v29-workers-release-finished",
    title="each generate() call ends by telling the workers its requests are finished (no request state "
    "stays for the next call)",
    target=GENERATOR,
    requires=SPECULATORS_0_3_OR_0_4,
    edits=(
        Edit(
            TellWorkersFinished,
            when=EVERY_RELEASE,
            answers="a worker frees a request's state only when a scheduler output it executes names the "
            "request in finished_req_ids; Model Runner V2 holds max_num_seqs request slots",
            fact=Fact(
                "defines",
                "vllm.v1.core.sched.output",
                "SchedulerOutput",
                "finished_req_ids",
                needs=(Fact("defines", "vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),),
            ),
        ),
    ),
    examples=(Example(before=BEFORE_0_3, after=AFTER_0_3), Example(before=BEFORE_0_4, after=AFTER_0_4)),
    satisfied=(AFTER_0_3, AFTER_0_4),
    near_misses=(
        # a loop that steps without the walrus on schedule(): not the generator's stepping loop
        """
        while pending:
            self.executor.execute_model(self.scheduler.schedule())
        """,
    ),
    upstream="not a vLLM change: vllm/v1/worker/gpu/model_runner.py (finish_requests frees RequestState "
    "slots named by scheduler_output.finished_req_ids), vllm/v1/worker/gpu_model_runner.py (_update_states)",
    without_it="without it every call leaves its last step's requests (0.3.0; 0.4.x: all of its requests) in "
    "the workers' model runner; on Model Runner V2 they fill its max_num_seqs slots and a later call fails "
    "in the worker, `AssertionError: No free indices` (CUDA vLLM 0.26.0: the fifth call, 70 prompts); the "
    "extraction driver fails any call that leaves requests behind",
    leave_one_out=(
        # V1 (the CPU build): the requests stay, and the extraction driver's check says so
        LeaveOneOut("0.16.0", LEFT_IN_WORKERS),
        # Model Runner V2 on CUDA: the slots run out in the fifth call (70 prompts)
        LeaveOneOut(
            "0.34.0",
            NO_FREE_SLOT,
            device="cuda",
            calls="all",
            record="bench/gpu/results/0.34.0-five-calls-h200x1/e2e-without-v29.json",
        ),
        LeaveOneOut(
            "0.26.0",
            NO_FREE_SLOT,
            device="cuda",
            calls="all",
            record="bench/gpu/results/0.26.0-v2-h200x1/e2e-without-v29.json",
        ),
        # 0.4.x leaves a whole call's requests, freed in the next call's first step: V2's slots
        # hold, the driver's check fails
        LeaveOneOut(
            "0.34.0",
            LEFT_IN_WORKERS,
            device="cuda",
            calls="all",
            record="bench/gpu/results/0.34.0-speculators-0.4.0.1-five-calls-h200x1/e2e-without-v29.json",
            speculators="0.4.0.1",
        ),
        LeaveOneOut(
            "0.16.0",
            Symptom(
                "generate 1",
                "RuntimeError",
                (
                    "left",
                    "requests in the workers' model runner",
                ),
            ),
            calls="all",
            tensor_parallel=2,
        ),
        LeaveOneOut(
            "0.16.0",
            Symptom(
                "generate 1",
                "RuntimeError",
                (
                    "left",
                    "requests in the workers' model runner",
                ),
            ),
            calls="all",
            tensor_parallel=2,
            speculators="0.4.0.1",
        ),
    ),
    since="any",
)
