"""v26: speculators 0.4.x's captured states reach the generator through shared host memory, not vLLM's RPC queue.

Not a vLLM change: a speed fix, v21's for speculators 0.4.x. 0.4's worker returns its captured
states as the reply of `collective_rpc("_get_captured_states", unique_reply_rank=0)`, a dict of
request id to one tensor per layer, which vLLM serialises through the executor's message queue.
Measured on an H200 with CUDA vLLM 0.26.0 (issue 39): a 1.0B Llama, 256 prompts of 1024 tokens,
32 a call, the same run: patched 0.4.0.1 30,786 tokens/s, patched 0.3.0 (with v21) 193,720;
`_get_captured_states` took 8.43 of 0.4.0.1's 8.52 s. v21 cannot match 0.4's file: it assigns
the reply to another name and reads it per request.

With this patch, per `_get_captured_states` call of generate(), the same reply by another path,
the mechanism of v21 (shared source: patcher/shared_states.py):
- the generator makes one empty file (mode 0600) on a tmpfs (/dev/shm where it can write there,
  else tempfile's folder) and sends only its path through the RPC, with a callable that runs in
  the worker (collective_rpc takes callables on every release; it is pickled by reference, so the
  worker runs this same patched module);
- the worker (tensor parallel rank 0, the only one that captures; the others answer None) cuts
  its captured steps into requests exactly as `_get_captured_states` does (the steps' metadata in
  order, each cut clamped as slicing clamps it, a request's cuts joined), and copies them into a
  host buffer it keeps for later calls, layer by layer, each request's rows one block, adjacent
  blocks of one step in one copy; only when a call needs more room than the buffer has (or the
  generator has not mapped it) does it size that file (posix_fallocate: ENOSPC now, not SIGBUS
  later), map it and, where CUDA is, pin it, so each device-to-host copy is one DMA into the pages
  the generator reads; it clears its states as `_get_captured_states` does and replies with the
  dtype, row shape and offset of each layer and each request's id and row count;
- the generator maps that file (where the worker made it) and removes its name in a `finally`
  (the only name ever made is its own, so neither an exception nor Ctrl-C leaves one; the worker
  opens the path, never creates it), then copies each request's rows out of the buffer into
  tensors of their own, eight requests at a time (vLLM runs the caller's torch on one thread),
  and hands back the dict `_get_captured_states` would: request id to those tensors, in the same
  order. generate()'s own copy of each request's rows (`[h.clone().cpu() for h in ...]`) takes
  them as they are (`_request_rows`), so each result owns its storage, stays valid after later
  calls and after the generator is gone, and is not copied twice; the dict holds no view of the
  buffer, so the reply stays right however often generate() asks for it.
Host memory: the buffer is as large as the largest call's captured states (page-aligned per
layer), shared by the two processes (counted once), and goes with them. Where no buffer can be
made (a full /dev/shm), the worker keeps its states, one warning names the reason, and the RPC
queue carries them as before. Tensor parallel by design: the callable goes to every worker and
only rank 0's reply comes back (unique_reply_rank=0), as with the RPC it replaces.

The rewrite finds the RPC's statement wherever generate() has it (in any block, under any name,
after the edits of earlier patches on the function: v25 rewrites 0.4's scheduling loop), and
rewrites only the per-request copy of the name that statement assigns.
"""

from __future__ import annotations

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import AttributeCall, Edit, Example, Fact, LeaveOneOut, Patch
from patcher.shared_states import BUFFER_SOURCE, defines_function, with_helpers_before_first_class

from .targets import EVERY_RELEASE, GENERATOR, SPECULATORS_0_4

FETCH = "_request_states_through_shared_memory"
ROWS = "_request_rows"

REQUEST_STATES_SOURCE = '''\
def _write_request_states(worker, path, mapped_buffer):
    """In the worker (collective_rpc sends it): what _get_captured_states() would return, each
    request's rows of every layer, copied into the host buffer shared with the generator; where
    each layer and each request's rows lie. None where nothing was captured (tensor parallel
    ranks other than 0); {"unavailable": why} where no buffer could be made (the states are kept
    for _get_captured_states).
    """
    import bisect
    import time

    worker = _capturing_worker(worker)
    captured = getattr(worker, "_captured_states", None)
    if captured is None:
        return None
    started = time.perf_counter()
    # _get_captured_states concatenates each layer's steps, then cuts (request id, count) after
    # (request id, count) of the steps' metadata from it: rows current:current + count, clamped
    # as slicing clamps them, one request's cuts joined in order, the requests in the order they
    # first appear. The same cuts as copies [from, to, row in the buffer], adjacent ones merged.
    step_starts = []
    total = 0
    for step in captured[0]:
        step_starts.append(total)
        total += step.shape[0]
    step_rows = [step.shape[0] for step in captured[0]]
    for number, steps in enumerate(captured):
        if [step.shape[0] for step in steps] != step_rows:  # each step captures every layer at once
            raise RuntimeError(
                f"captured layer {number} has steps of {[step.shape[0] for step in steps]} rows, "
                f"the first layer {step_rows}: not one capture of every layer per step"
            )
    cuts = {}
    current = 0
    for metadata in getattr(worker, "_request_metadata", None) or []:
        for request_id, count in metadata:
            start = min(current, total)
            cuts.setdefault(request_id, []).append((start, max(start, min(current + count, total))))
            current += count
    copies = []
    requests = []
    rows = 0
    for request_id, pieces in cuts.items():
        first = rows
        for start, stop in pieces:
            if stop == start:
                continue
            if copies and copies[-1][1] == start:
                copies[-1][1] = stop
            else:
                copies.append([start, stop, rows])
            rows += stop - start
        requests.append([request_id, rows - first])
    layout, end = _layer_layout([(steps[0].dtype, [rows, *steps[0].shape[1:]]) for steps in captured])
    device = captured[0][0].device
    try:
        buffer, made = _shared_states_buffer(worker, end, path, mapped_buffer, device.type == "cuda")
    except OSError as error:
        return _no_buffer(error, end, path)
    for steps, layer in zip(captured, _buffer_views(buffer["host"], layout)):
        for start, stop, at in copies:
            while start < stop:  # a copy spans steps only where the metadata does
                index = bisect.bisect_right(step_starts, start) - 1
                until = min(stop, step_starts[index] + steps[index].shape[0])
                source = steps[index][start - step_starts[index] : until - step_starts[index]]
                layer[at : at + until - start].copy_(source, non_blocking=buffer["pinned"])
                at += until - start
                start = until
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    worker._captured_states = None
    worker._request_metadata = []
    return {
        "buffer": buffer["id"],
        "made": made,
        "size": buffer["size"],
        "pinned": buffer["pinned"],
        "layers": layout,
        "requests": requests,
        "seconds": time.perf_counter() - started,
    }


class _RequestStates(dict):
    """_get_captured_states' reply, {request id: one tensor per layer}, each tensor a copy of its
    own; _request_rows hands each request's tensors over once, without copying them again."""

    handed = None


def _request_rows(states, request_id):
    """Every layer's rows of one request, CPU tensors of their own: the reply's own where it came
    through the shared buffer (copied out of it already), else copies."""
    handed = getattr(states, "handed", None)
    if handed is not None and request_id not in handed:
        handed.add(request_id)
        return list(states[request_id])
    return [h.clone().cpu() for h in states[request_id]]


def _request_states_through_shared_memory(generator):
    """What collective_rpc("_get_captured_states", unique_reply_rank=0) returns, {request id: one
    tensor per layer} in the same order, each tensor a CPU copy of its own (copied out of the
    buffer shared with the worker). None where the worker captured nothing or could make no
    buffer (then the RPC queue carries them).
    """
    import time

    started = time.perf_counter()
    reply = _shared_states_call(generator, _write_request_states, ())
    if reply is None:
        return None
    layers = _buffer_views(generator._shared_states["host"], reply["layers"])
    spans = _spans(count for _, count in reply["requests"])
    states = _RequestStates(zip((request_id for request_id, _ in reply["requests"]), _copy_rows(layers, spans)))
    states.handed = set()
    _count_call(generator._shared_states, layers, reply, started)
    return states
'''

HELPERS_SOURCE = (
    "# How the captured states reach the generator (patcher v26): through a host buffer that the\n"
    "# worker which captured them (tensor parallel rank 0) and the generator both map, in a file on a\n"
    "# tmpfs whose name exists only while one call's reply is in flight. vLLM's RPC queue carries the\n"
    "# file's path and where each request's rows lie, never the tensors.\n"
    + BUFFER_SOURCE
    + "\n\n"
    + REQUEST_STATES_SOURCE
)

GUARD_COMMENT = "# nothing captured, or no shared buffer (logged): vLLM's RPC queue carries them"

# `NAME = self.executor.collective_rpc("_get_captured_states", unique_reply_rank=0)`: 0.4's call
# (0.3.0's takes request_tokens, or nothing, and its reply is a list: v21's)
GET_CAPTURED_CALL = m.Call(
    func=m.Attribute(value=m.Attribute(value=m.Name("self"), attr=m.Name("executor")), attr=m.Name("collective_rpc")),
    args=[
        m.Arg(keyword=None, value=m.SimpleString('"_get_captured_states"') | m.SimpleString("'_get_captured_states'")),
        m.Arg(keyword=m.Name("unique_reply_rank"), value=m.Integer("0")),
    ],
)
RPC_ASSIGN = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())], value=GET_CAPTURED_CALL)])
FAST_ASSIGN = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name())],
            value=m.Call(func=m.Name(FETCH), args=[m.Arg(keyword=None, value=m.Name("self"))]),
        )
    ]
)


def _assigned(statement: cst.SimpleStatementLine) -> str:
    return statement.body[0].targets[0].target.value  # type: ignore[attr-defined]


def _guard_of(name: str) -> m.NodeShape:
    """`if NAME is None:` around 0.4's RPC statement assigning NAME: the fallback."""
    return m.If(
        test=m.Comparison(
            left=m.Name(name), comparisons=[m.ComparisonTarget(operator=m.Is(), comparator=m.Name("None"))]
        ),
        body=m.IndentedBlock(body=[RPC_ASSIGN]),
        orelse=None,
    )


def _prompt_copy_of(names: set[str]) -> m.NodeShape:
    """generate()'s copy of one request's rows: `[h.clone().cpu() for h in NAME[KEY]]`, NAME one
    of the names the RPC's reply is assigned to."""
    return m.ListComp(
        elt=m.Call(
            func=m.Attribute(
                value=m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("clone")), args=[]), attr=m.Name("cpu")
            ),
            args=[],
        ),
        for_in=m.CompFor(
            target=m.Name(),
            iter=m.Subscript(
                value=m.OneOf(*(m.Name(name) for name in sorted(names))),
                slice=[m.SubscriptElement(slice=m.Index(value=m.Name()))],
            ),
            ifs=[],
            inner_for_in=None,
            asynchronous=None,
        ),
    )


class _Function(cst.CSTTransformer):
    """Rewrites, in one outermost function, every RPC statement (see the codemod) and the
    per-request copies of the names those statements assign."""

    def __init__(self, codemod: PatchCodemod, names: set[str]) -> None:
        super().__init__()
        self.codemod = codemod
        self.prompt_copy = _prompt_copy_of(names)
        self.guard = m.OneOf(*(_guard_of(name) for name in sorted(names)))
        self.in_guard = 0

    def visit_If(self, node: cst.If) -> None:
        if m.matches(node, self.guard):
            self.in_guard += 1

    def leave_If(self, original: cst.If, updated: cst.If) -> cst.If:
        if m.matches(original, self.guard):
            self.in_guard -= 1
        return updated

    def leave_ListComp(self, original: cst.ListComp, updated: cst.BaseExpression) -> cst.BaseExpression:
        if not m.matches(updated, self.prompt_copy):
            return updated
        assert isinstance(updated, cst.ListComp)
        if updated.elt.func.value.func.value.value != updated.for_in.target.value:  # type: ignore[attr-defined]
            return updated  # copies of something else than the loop's tensor
        self.codemod.rewrote()
        subscript = updated.for_in.iter
        assert isinstance(subscript, cst.Subscript)
        key = subscript.slice[0].slice.value  # type: ignore[attr-defined]
        return cst.Call(func=cst.Name(ROWS), args=[cst.Arg(subscript.value), cst.Arg(key)])

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        if self.in_guard:  # the fallback inside the patched guard
            return updated
        out: list[cst.BaseStatement] = []
        changed = False
        for index, statement in enumerate(updated.body):
            previous = updated.body[index - 1] if index else None
            if isinstance(statement, cst.SimpleStatementLine) and m.matches(statement, RPC_ASSIGN):
                self.codemod.rewrote()
                changed = True
                name = _assigned(statement)
                fast = cst.parse_statement(f"{name} = {FETCH}(self)\n").with_changes(
                    leading_lines=statement.leading_lines
                )
                guard = cst.parse_statement(f"if {name} is None:\n    pass\n")
                assert isinstance(guard, cst.If)
                fallback = statement.with_changes(
                    leading_lines=[cst.EmptyLine(indent=True, comment=cst.Comment(GUARD_COMMENT))]
                )
                out.extend([fast, guard.with_changes(body=guard.body.with_changes(body=[fallback]))])
                continue
            if (
                isinstance(previous, cst.SimpleStatementLine)
                and m.matches(previous, FAST_ASSIGN)
                and m.matches(statement, _guard_of(_assigned(previous)))
            ):
                self.codemod.found_patched()
            out.append(statement)
        return updated.with_changes(body=out) if changed else updated


class RequestStatesThroughSharedMemory(PatchCodemod):
    """`NAME = self.executor.collective_rpc("_get_captured_states", unique_reply_rank=0)` becomes
    the shared-memory fetch of the same reply, with that call kept as the fallback under
    `if NAME is None:`; generate()'s per-request copy `[h.clone().cpu() for h in NAME[req_id]]`
    becomes `_request_rows(NAME, req_id)`; the module gets the helpers (before its first class).

    Patched: the fetch followed by that guard. speculators 0.3.0 passes request tokens (or
    nothing) and names the reply captured_states_list (v21's): anchor-missing. Runs on each
    outermost function as it is left, after the edits of earlier patches on it.
    """

    ANCHOR = 'NAME = self.executor.collective_rpc("_get_captured_states", unique_reply_rank=0)'

    def __init__(self, filename: str = "<source>") -> None:
        super().__init__(filename)
        self.depth = 0

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.depth += 1

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        self.depth -= 1
        if self.depth:
            return updated
        assigning = m.findall(updated, RPC_ASSIGN) + m.findall(updated, FAST_ASSIGN)
        if not assigning:
            return updated
        names = {_assigned(s) for s in assigning if isinstance(s, cst.SimpleStatementLine)}
        result = updated.visit(_Function(self, names))
        assert isinstance(result, cst.FunctionDef)
        return result

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        if not (self.rewrites or self.patched_seen) or defines_function(updated, FETCH):
            return updated
        self.rewrote()
        return with_helpers_before_first_class(updated, HELPERS_SOURCE)


# when=EVERY_RELEASE: the RPC queue carries the reply on every release the patches support.

# 0.4's generate(), cut down, with near misses the codemod leaves alone: a copy of another dict's
# rows, 0.3.0's call (its request tokens: v21's), a call to another rank.
BEFORE = """\
import torch


class VllmHiddenStatesGenerator:
    def generate(self, token_ids):
        request_id_to_idx = {}
        # Get captured states organized by request ID
        request_states_dict = self.executor.collective_rpc(
            "_get_captured_states",
            unique_reply_rank=0,
        )
        results = []
        for req_id in request_id_to_idx:
            layer_states = [h.clone().cpu() for h in request_states_dict[req_id]]
            earlier = [h.clone().cpu() for h in self.earlier_states[req_id]]
            results.append(layer_states + earlier)
        return results

    def near_misses(self, request_tokens):
        captured_states_list = self.executor.collective_rpc(
            "_get_captured_states", args=(request_tokens,), unique_reply_rank=0
        )
        other = self.executor.collective_rpc("_get_captured_states", unique_reply_rank=1)
        return captured_states_list, other
"""

AFTER = (
    "import torch\n\n\n"
    + HELPERS_SOURCE
    + """

class VllmHiddenStatesGenerator:
    def generate(self, token_ids):
        request_id_to_idx = {}
        # Get captured states organized by request ID
        request_states_dict = _request_states_through_shared_memory(self)
        if request_states_dict is None:
            # nothing captured, or no shared buffer (logged): vLLM's RPC queue carries them
            request_states_dict = self.executor.collective_rpc(
                "_get_captured_states",
                unique_reply_rank=0,
            )
        results = []
        for req_id in request_id_to_idx:
            layer_states = _request_rows(request_states_dict, req_id)
            earlier = [h.clone().cpu() for h in self.earlier_states[req_id]]
            results.append(layer_states + earlier)
        return results

    def near_misses(self, request_tokens):
        captured_states_list = self.executor.collective_rpc(
            "_get_captured_states", args=(request_tokens,), unique_reply_rank=0
        )
        other = self.executor.collective_rpc("_get_captured_states", unique_reply_rank=1)
        return captured_states_list, other
"""
)

# Where a rewritten scheduling loop (v25) may put the call: inside a block, the reply under
# another name, read per request in a loop of its own.
BEFORE_IN_A_LOOP = """\
class G:
    def generate(self, batches):
        results = {}
        for batch in batches:
            if batch:
                states = self.executor.collective_rpc("_get_captured_states", unique_reply_rank=0)
                for req_id in batch:
                    results[req_id] = [t.clone().cpu() for t in states[req_id]]
        return results
"""
AFTER_IN_A_LOOP = (
    HELPERS_SOURCE
    + """

class G:
    def generate(self, batches):
        results = {}
        for batch in batches:
            if batch:
                states = _request_states_through_shared_memory(self)
                if states is None:
                    # nothing captured, or no shared buffer (logged): vLLM's RPC queue carries them
                    states = self.executor.collective_rpc("_get_captured_states", unique_reply_rank=0)
                for req_id in batch:
                    results[req_id] = _request_rows(states, req_id)
        return results
"""
)

PATCH = Patch(
    id="v26-shared-memory-request-states",
    title="speculators 0.4.x: the captured states reach the generator through a shared host buffer, "
    "not vLLM's RPC queue",
    target=GENERATOR,
    requires=SPECULATORS_0_4,
    edits=(
        Edit(
            RequestStatesThroughSharedMemory,
            when=EVERY_RELEASE,
            answers="collective_rpc sends a callable to every worker and returns only the reply of "
            "unique_reply_rank; that reply travels through the executor's message queue",
            fact=Fact(
                "has-param",
                "vllm.v1.executor.multiproc_executor",
                "MultiprocExecutor.collective_rpc",
                "unique_reply_rank",
                # the callable is handed vLLM's wrapper of the worker: the states are read from,
                # and cleared on, the worker it wraps (_capturing_worker)
                needs=(
                    Fact(
                        "defines",
                        ("vllm.v1.worker.worker_base", "vllm.worker.worker_base"),
                        "WorkerWrapperBase",
                        "worker",
                    ),
                ),
            ),
        ),
    ),
    examples=(
        Example(before=BEFORE, after=AFTER),
        Example(before=BEFORE_IN_A_LOOP, after=AFTER_IN_A_LOOP),
    ),
    satisfied=(AFTER, AFTER_IN_A_LOOP),
    near_misses=(
        # every rank's replies (no unique_reply_rank): not the single reply 0.4.x reads
        """
            class G:
                def generate(self, batches):
                    results = {}
                    for batch in batches:
                        if batch:
                            states = self.executor.collective_rpc("_get_captured_states")
                            for req_id in batch:
                                results[req_id] = [t.clone().cpu() for t in states[0][req_id]]
                    return results
        """,
    ),
    upstream="not a vLLM change: vLLM's executor message queue "
    "(vllm/distributed/device_communicators/shm_broadcast.py) is built for small replies; speculators "
    "0.4.0 vllm_hidden_states_generator.py, generate() (`request_states_dict = "
    'self.executor.collective_rpc("_get_captured_states", unique_reply_rank=0)`)',
    attribute_calls=(
        AttributeCall(
            "generator.executor",
            "collective_rpc",
            "vllm.v1.executor.multiproc_executor:MultiprocExecutor.collective_rpc",
        ),
    ),
    without_it="correct but slow: every captured tensor travels through vLLM's RPC message queue "
    "(on an H200, CUDA vLLM 0.26.0, 1.0B Llama, 32 prompts a call: 0.4.0.1 30,786 tokens/s, 0.3.0 with v21 "
    "193,720; `_get_captured_states` 8.43 of 8.52 s); figures in the extraction speed page",
    # correct without it, only slow: the run passes (its need is measured by bench/extract.py)
    leave_one_out=(
        LeaveOneOut("0.16.0", None, calls="all", speculators="0.4.0.1"),
        LeaveOneOut("0.16.0", None, calls="all", tensor_parallel=2, speculators="0.4.0.1"),
    ),
    since="any",
)
