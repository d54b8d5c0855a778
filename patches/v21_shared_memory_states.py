"""v21: the captured hidden states reach the generator through shared host memory, not vLLM's RPC queue.

Not a vLLM change: a speed fix. speculators 0.3.0's worker returns every captured tensor as the
reply of `collective_rpc("_get_captured_states")`, which vLLM serialises through the executor's
message queue (vllm/distributed/device_communicators/shm_broadcast.py: a shared ring of small
chunks, larger replies over a local socket). Measured on an H200 with CUDA vLLM 0.20.0 (issue 26):
a 1.0B Llama, 512 prompts of 1024 tokens, layers 1-3, 64 prompts a call: 28.5 s of 28.7 s in
that call, 805 MB a call at about 225 MB/s, 18,242 tokens/s against 256,290 for vLLM's own
prefill of the same prompts. The cost is per byte, so a model of hidden size 7168 is capped near
5,000 tokens/s whatever the GPUs do.

With this patch, per generate() call, the same reply by another path (whatever the RPC asks
for: with v11, each request's rows in the caller's order; without it, 0.3.0's concatenation):
- the generator makes one empty file (a random name, O_EXCL, mode 0600) on a tmpfs (/dev/shm where
  it can write there, else tempfile's folder) and sends only its path through the RPC, with a callable
  that runs in the worker (collective_rpc takes callables on every release; it is pickled by
  reference, so the worker runs this same patched module);
- the worker (tensor parallel rank 0, the only one that captures; the others answer None) takes
  the rows _get_captured_states would return and copies each layer into a host buffer it keeps
  for later calls; only when a call needs more room than the buffer has (or the caller has not
  mapped it) does it size that file (posix_fallocate: ENOSPC now, not SIGBUS later), map it and,
  where CUDA is, pin it (cudaHostRegister, as torch's own checkpoint stager pins shared memory),
  so the device-to-host copy is one DMA straight into the pages the caller reads; it replies with
  the dtype, shape and offset of each layer;
- the generator maps that file (where the worker made it), removes its name at once (in a
  `finally`: the only name ever made is the caller's own, so neither an exception nor Ctrl-C can
  leave one behind; the worker opens the path, never creates it), and hands v2's code per-layer
  views of the buffer, each prompt's rows already copied out of it, several prompts at a time,
  into tensors the caller owns (their pages advised as huge ones before the copy writes them), so
  the results stay valid after later calls and after the generator is gone.
Host memory: the buffer is as large as the largest call's captured states (page-aligned per
layer), shared by the two processes (counted once), and goes with them. Where no buffer can be
made (a full /dev/shm), the worker keeps its states, one warning names the reason, and the RPC
queue carries them as before.

With v11's RPC before each step (each step's request metadata), that RPC carries the transfer
too, so that it overlaps the steps: the worker copies the rows of the steps done so far into the
buffer, each request's at its place in the same layout, and replies with the requests whose rows
are all there; the generator copies those prompts out in threads while vLLM computes the step.
Into a pinned buffer those copies run on a side stream of the worker's, after the step that
captured the rows and beside the next one: a request counts as there once the event recorded after
its last rows has passed (so usually one RPC later), the allocator keeps each captured tensor
until that stream is done with it, and the write after the last step waits for the stream.
bench/gpu/side_stream_check.py runs these helpers on CUDA against copies on the compute stream.
After the last step the fetch is that write for the last steps, the check that each request has
exactly its rows (v10's words) and the wait for the copies. Measured without it on an H200 (CUDA
vLLM 0.26.0, 1.0B Llama, 64 prompts of 1024 tokens a call; bench/gpu/results/
extract-0.26.0-llama-1b-h200x1): the steps 0.267 s a call, then 0.132 s of transfer and copy-out
while the GPU waits.

Why not the alternatives: CUDA IPC handles would make the generator's process open a CUDA
context (v18 exists to keep CUDA out of it) and copy there; a pinned staging buffer in the worker
written into a file (as vLLM's example hidden-states connector writes safetensors files) copies
every byte once more on the host; memfd_create would need the descriptor passed between the
processes. The cleanup argument above needs no signal handler and no sweep of stale files.
"""

from __future__ import annotations

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import AttributeCall, Edit, Example, Fact, LeaveOneOut, Patch
from patcher.shared_states import BUFFER_SOURCE, with_helpers_before_first_class

from .targets import EVERY_RELEASE, GENERATOR, SPECULATORS_0_3

REPLY = "captured_states_list"
FETCH = "_captured_states_through_shared_memory"
AFTER_STEPS = "_captured_states_after_steps"
STEP = "_states_while_stepping"
# Definitions of patcher/shared_states.py's BUFFER_SOURCE the generator's module gets with v21
# (worker side: _capturing_worker, _shared_states_buffer; generator side: _shared_states_call,
# _copy_rows), then v21's own: the write after the steps (CAPTURED_STATES_SOURCE) and the writes
# while stepping (STEPS_SOURCE).
CAPTURED_STATES_SOURCE = """\
def _write_captured_states(worker, request_tokens, path, mapped_buffer):
    \"\"\"In the worker (collective_rpc sends it): copy the captured rows into the host buffer
    shared with the generator and return where each layer lies; the rows are those
    _get_captured_states(request_tokens) would return (each request's in the order of
    request_tokens; with None, as vLLM computed them).

    None where nothing was captured (tensor parallel ranks other than 0); {"unavailable": why}
    where no buffer could be made: the states are kept for _get_captured_states.
    \"\"\"
    import time

    worker = _capturing_worker(worker)
    if getattr(worker, "_captured_states", None) is None:
        return None
    started = time.perf_counter()
    if request_tokens is None:
        layers = [torch.cat(steps, dim=0) for steps in worker._captured_states]
    else:
        from speculators.data_generation.custom_worker import _rows_by_request

        layers = _rows_by_request(
            worker._captured_states, getattr(worker, "_request_metadata", None) or [], request_tokens
        )
    layout, end = _layer_layout([(layer.dtype, layer.shape) for layer in layers])
    try:
        buffer, made = _shared_states_buffer(worker, end, path, mapped_buffer, layers[0].is_cuda)
    except OSError as error:
        return _no_buffer(error, end, path)
    for view, layer in zip(_buffer_views(buffer["host"], layout), layers):
        view.copy_(layer, non_blocking=buffer["pinned"])
    if layers[0].is_cuda:
        torch.cuda.synchronize(layers[0].device)
    worker._captured_states = None
    worker._request_metadata = []
    return {
        "buffer": buffer["id"],
        "made": made,
        "size": buffer["size"],
        "pinned": buffer["pinned"],
        "layers": layout,
        "seconds": time.perf_counter() - started,
    }


class _SharedStates(list):
    \"\"\"One reply's layers (views of the shared buffer) with each prompt's rows already copied
    out (owned: {(start, stop): rows}), several prompts at a time.\"\"\"

    owned = None


def _prompt_rows(layers, start, stop):
    \"\"\"Rows start:stop of every layer, each a CPU tensor of its own (copied already where the
    reply came through the shared buffer).\"\"\"
    owned = getattr(layers, "owned", None)
    rows = owned.pop((start, stop), None) if owned else None
    if rows is None:
        rows = [layer[start:stop].clone().cpu() for layer in layers]
    return rows


def _shared_states_result(state, layers, reply, started):
    \"\"\"layers as collective_rpc would return them (in a one-element list where the executor
    wraps the reply, as vLLM 0.11.0 does), the call counted and measured.\"\"\"
    _count_call(state, layers, reply, started)
    return [layers] if state.get("wrapped") else layers


def _captured_states_through_shared_memory(generator, request_tokens):
    \"\"\"What collective_rpc("_get_captured_states", args=(request_tokens,), unique_reply_rank=0)
    returns (one tensor per layer), as CPU views of the buffer shared with the worker, valid
    until the next call, with each prompt's rows copied out already (_prompt_rows hands them
    over). None where the worker captured nothing or could make no buffer (then the RPC queue
    carries them).
    \"\"\"
    import time

    started = time.perf_counter()
    reply = _shared_states_call(generator, _write_captured_states, (request_tokens,))
    if reply is None:
        return None
    state = generator._shared_states
    layers = _SharedStates(_buffer_views(state["host"], reply["layers"]))
    if request_tokens:  # the rows come in the caller's order: each prompt's are known now
        spans = _spans(request_tokens.values())
        layers.owned = dict(zip(spans, _copy_rows(layers, spans)))
    return _shared_states_result(state, layers, reply, started)
"""

STEPS_SOURCE = '''\
def _write_steps(worker, request_tokens, call, scheduled, path, mapped_buffer):
    """In the worker (collective_rpc): the rows of every step captured since this call's last
    write into the shared buffer, each request's at its place in the order of request_tokens (the
    layout _write_captured_states writes); then, with scheduled, the next step's request metadata
    (v10's _set_request_metadata); without it (after the last step), the check that each request
    has exactly its rows, and the capture cleared as _get_captured_states clears it.

    None on ranks that captured nothing; {"unavailable": why} where no buffer could be made (the
    states stay captured for _get_captured_states); else the buffer's id, whether it is new, its
    size, whether it is pinned, where each layer lies and the requests whose rows are complete now.
    """
    import time

    worker = _capturing_worker(worker)
    started = time.perf_counter()
    progress = getattr(worker, "_speculators_steps", None)
    if progress is None or progress["call"] != call:
        progress = worker._speculators_steps = {"call": call, "steps": 0, "rows": {}, "reply": None}
    reply = _write_new_steps(worker, progress, request_tokens, path, mapped_buffer, scheduled is None)
    if scheduled is not None:
        worker._set_request_metadata(scheduled)
        return reply
    worker._speculators_steps = None
    if reply is None or "unavailable" in reply:
        return reply
    for request_id, expected in request_tokens.items():
        got = progress["rows"].get(request_id, 0)
        if got != expected:
            raise RuntimeError(f"request {request_id}: captured {got} rows of hidden states, expected {expected}")
    worker._captured_states = None
    worker._request_metadata = []
    reply["seconds"] = time.perf_counter() - started
    return reply


def _copy_stream(worker, tensor):
    """The worker's side stream for the device-to-host copies of the steps' rows (kept for later
    calls); None off CUDA."""
    if not tensor.is_cuda:
        return None
    stream = getattr(worker, "_speculators_copy_stream", None)
    if stream is None or stream.device != tensor.device:
        stream = worker._speculators_copy_stream = torch.cuda.Stream(tensor.device)
    return stream


def _write_new_steps(worker, progress, request_tokens, path, mapped_buffer, final):
    """_write_steps' copy: the call's first write lays the buffer out for every request's rows.

    Into a pinned buffer the copies run on a side stream while the next step computes: a request
    counts as complete once the event after its last rows has passed (the final write waits for
    all), and the allocator keeps each source until that stream is done with it.
    """
    import contextlib

    captured = getattr(worker, "_captured_states", None)
    if captured is None:
        return None
    if "no_buffer" in progress:
        return progress["no_buffer"]
    steps = getattr(worker, "_request_metadata", None) or []
    count = len(captured[0])
    if len(steps) != count:
        raise RuntimeError(f"captured {count} forward steps, request metadata for {len(steps)}")
    if progress["reply"] is None:
        rows = sum(request_tokens.values())
        layers, end = _layer_layout([(steps[0].dtype, [rows, *steps[0].shape[1:]]) for steps in captured])
        stream = _copy_stream(worker, captured[0][0])
        if stream is not None:  # an interrupted call's copies may still be writing the buffer
            stream.synchronize()
        try:
            buffer, made = _shared_states_buffer(worker, end, path, mapped_buffer, captured[0][0].is_cuda)
        except OSError as error:
            progress["no_buffer"] = _no_buffer(error, end, path)
            return progress["no_buffer"]
        spans = _spans(request_tokens.values())
        progress["starts"] = {request_id: span[0] for request_id, span in zip(request_tokens, spans)}
        progress["views"] = _buffer_views(buffer["host"], layers)
        progress["stream"] = stream if buffer["pinned"] else None  # pageable memory: copies wait anyway
        progress["pending"] = []
        progress["reply"] = {
            "buffer": buffer["id"],
            "made": made,
            "size": buffer["size"],
            "pinned": buffer["pinned"],
            "layers": layers,
        }
        reply = dict(progress["reply"])
    else:
        reply = dict(progress["reply"], made=False)
    views, complete, stream = progress["views"], [], progress["stream"]
    if stream is not None and count > progress["steps"]:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for step in range(progress["steps"], count):
            scheduled = steps[step]
            if scheduled is None:
                raise RuntimeError(f"step {step} ran without request metadata")
            captured_rows = captured[0][step].shape[0]
            total = sum(rows for _, rows in scheduled)
            if total > captured_rows:
                raise RuntimeError(f"step {step}: {total} tokens scheduled, {captured_rows} rows captured")
            if stream is not None:
                for layer_steps in captured:
                    layer_steps[step].record_stream(stream)
            start = 0
            for request_id, rows in scheduled:
                expected = request_tokens.get(request_id)
                if expected is not None and rows:
                    done = progress["rows"].get(request_id, 0)
                    if done + rows > expected:
                        raise RuntimeError(
                            f"request {request_id}: captured {done + rows} rows of hidden states, expected {expected}"
                        )
                    at = progress["starts"][request_id] + done
                    for view, layer_steps in zip(views, captured):
                        view[at : at + rows].copy_(layer_steps[step][start : start + rows], non_blocking=stream is not None)
                    progress["rows"][request_id] = done + rows
                    if done + rows == expected:
                        complete.append(request_id)
                start += rows
    if stream is not None:
        pending = progress["pending"]
        if count > progress["steps"]:
            event = torch.cuda.Event()
            event.record(stream)
            pending.append((event, complete))
        if final:
            stream.synchronize()
        complete = []
        while pending and (final or pending[0][0].query()):
            complete.extend(pending.pop(0)[1])
    progress["steps"] = count
    reply["complete"] = complete
    return reply


def _stepping(generator, request_tokens):
    """This call's progress in the generator: its id for the worker, each request's rows in the
    buffer, the copies under way. A new call (each generate() makes its request_tokens anew) ends
    what an earlier call left, an interrupted one's copies included."""
    import os

    state = _shared_states_of(generator)
    progress = state.get("stepping")
    if progress is not None and progress["tokens"] is request_tokens:
        return progress
    _end_stepping(state)
    state["stepped"] = state.get("stepped", 0) + 1
    progress = state["stepping"] = {
        "tokens": request_tokens,
        "call": f"{os.getpid()}-{id(generator)}-{state['stepped']}",
        "spans": dict(zip(request_tokens, _spans(request_tokens.values()))),
        "copies": {},
        "copy_seconds": [],
        "prepared": {},
        "prepare_seconds": [],
        "layers": None,
        "buffer": None,
        "pool": _copy_pool(),
    }
    return progress


def _end_stepping(state):
    """End the copies of the call in progress: those not started cancelled, those under way waited
    for, its threads told to stop (one whose start a Ctrl-C interrupted too: the pool never
    recorded it, so nothing else would stop it, and the interpreter would wait for it at exit)."""
    progress = state.get("stepping")
    state["stepping"] = None
    if progress is not None:
        progress["pool"].shutdown(wait=True, cancel_futures=True)


def _copy_complete(generator, progress, reply):
    """Start copying out, in the pool, the rows of each request the reply says are complete. With
    the buffer's layout, every request's tensors are made first (in order, so each copy finds its
    tensors made or being made by another thread)."""
    pool = progress["pool"]
    if progress["buffer"] != reply["buffer"]:
        progress["layers"] = _buffer_views(generator._shared_states["host"], reply["layers"])
        progress["buffer"] = reply["buffer"]
        progress["prepared"] = {
            span: pool.submit(_touched_rows, progress["layers"], span, progress["prepare_seconds"])
            for span in progress["spans"].values()
        }
    for request_id in reply["complete"]:
        span = progress["spans"][request_id]
        progress["copies"][span] = pool.submit(
            _copy_into_touched, progress["prepared"].pop(span), progress["layers"], span, progress["copy_seconds"]
        )


def _touched_rows(layers, span, seconds):
    """_empty_rows with each page written once: made while vLLM steps, so that the prompts complete
    only after the last step are copied into warm pages."""
    import time

    started = time.perf_counter()
    rows = _empty_rows(layers, span)
    for owned in rows:
        owned.view(-1).view(torch.uint8)[::4096].fill_(0)
    seconds.append(time.perf_counter() - started)
    return rows


def _copy_into_touched(touched, layers, span, seconds):
    """_rows_into the tensors _touched_rows made (touched: its future)."""
    import time

    rows = touched.result()
    started = time.perf_counter()
    _rows_into(rows, layers, span)
    seconds.append(time.perf_counter() - started)
    return rows


def _states_while_stepping(generator, request_tokens, scheduled):
    """In place of collective_rpc("_set_request_metadata", args=(scheduled,)), before each step: one
    RPC in which the worker writes the steps done so far into the shared buffer and takes scheduled
    as the next step's request metadata; the prompts complete in the buffer are copied out in
    threads while vLLM computes the step."""
    progress = _stepping(generator, request_tokens)
    try:
        reply = _shared_states_call(generator, _write_steps, (request_tokens, progress["call"], scheduled))
        if reply is not None:
            _copy_complete(generator, progress, reply)
    except BaseException:  # the call fails: its copies end here, not at the next call
        _end_stepping(generator._shared_states)
        raise


def _captured_states_after_steps(generator, request_tokens):
    """What _captured_states_through_shared_memory returns (the layers as views of the buffer,
    each prompt's rows copied out already), once the steps' writes are done: the worker
    writes the last steps and checks every request's rows, and the copies are waited for. None
    where nothing was captured or no buffer could be made (the RPC queue carries the states)."""
    import time

    if not request_tokens:  # no request tokens: the fetch after the steps
        return _captured_states_through_shared_memory(generator, request_tokens)
    started = time.perf_counter()
    progress = _stepping(generator, request_tokens)
    state = generator._shared_states
    try:
        reply = _shared_states_call(generator, _write_steps, (request_tokens, progress["call"], None))
        if reply is None:
            return None
        _copy_complete(generator, progress, reply)
        waited = time.perf_counter()
        owned = {span: copy.result() for span, copy in progress["copies"].items()}
        waited = time.perf_counter() - waited
    finally:
        _end_stepping(state)
    layers = _SharedStates(progress["layers"])
    layers.owned = owned
    result = _shared_states_result(state, layers, reply, started)
    # each prompt's copy-out and its tensors' making (summed over the threads), and how long the
    # fetch waited for the copies
    copied = progress["copy_seconds"]
    state["last"].update(
        copies=len(copied),
        copy_seconds=sum(copied),
        copy_wait_seconds=waited,
        prepare_seconds=sum(progress["prepare_seconds"]),
    )
    return result
'''

HELPERS_SOURCE = (
    "# How the captured states reach the generator (patcher v21): through a host buffer that the\n"
    "# worker which captured them (tensor parallel rank 0) and the generator both map, in a file on a\n"
    "# tmpfs whose name exists only while one call's reply is in flight. vLLM's RPC queue carries the\n"
    "# file's path and where each layer lies, never the tensors. With v11's per-step RPC, that RPC\n"
    "# carries the steps done so far and the generator copies out each complete prompt while vLLM\n"
    "# computes the next step.\n" + BUFFER_SOURCE + "\n\n" + CAPTURED_STATES_SOURCE + "\n\n" + STEPS_SOURCE
)

GUARD_COMMENT = "# nothing captured, or no shared buffer (logged): vLLM's RPC queue carries them"

SELF_EXECUTOR = m.Attribute(value=m.Name("self"), attr=m.Name("executor"))
GET_CAPTURED_CALL = m.Call(
    func=m.Attribute(value=SELF_EXECUTOR, attr=m.Name("collective_rpc")),
    args=[
        m.Arg(value=m.SimpleString('"_get_captured_states"') | m.SimpleString("'_get_captured_states'")),
        m.ZeroOrMore(),
    ],
)
REPLY_TARGET = [m.AssignTarget(target=m.Name(REPLY))]
RPC_ASSIGN = m.SimpleStatementLine(body=[m.Assign(targets=REPLY_TARGET, value=GET_CAPTURED_CALL)])
FAST_ASSIGN = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=REPLY_TARGET,
            value=m.Call(func=m.Name(FETCH) | m.Name(AFTER_STEPS), args=[m.Arg(value=m.Name("self")), m.Arg()]),
        )
    ]
)
# v11's per-step RPC: self.executor.collective_rpc("_set_request_metadata", args=(X,))
SET_METADATA = m.SimpleStatementLine(
    body=[
        m.Expr(
            value=m.Call(
                func=m.Attribute(value=SELF_EXECUTOR, attr=m.Name("collective_rpc")),
                args=[
                    m.Arg(value=m.SimpleString('"_set_request_metadata"') | m.SimpleString("'_set_request_metadata'")),
                    m.Arg(keyword=m.Name("args"), value=m.Tuple(elements=[m.Element()])),
                ],
            )
        )
    ]
)
REPLY_IS_NONE = m.Comparison(
    left=m.Name(REPLY), comparisons=[m.ComparisonTarget(operator=m.Is(), comparator=m.Name("None"))]
)
GUARD = m.If(test=REPLY_IS_NONE, body=m.IndentedBlock(body=[RPC_ASSIGN]))
ROWS = "_prompt_rows"
# speculators' own copy of each prompt's rows: [h[offset : offset + seq_len].clone().cpu() for h in ...]
PROMPT_ROWS = m.ListComp(
    elt=m.Call(
        func=m.Attribute(
            value=m.Call(
                func=m.Attribute(
                    value=m.Subscript(
                        value=m.Name(),
                        slice=[m.SubscriptElement(slice=m.Slice(lower=m.Name(), upper=m.BinaryOperation(), step=None))],
                    ),
                    attr=m.Name("clone"),
                ),
                args=[],
            ),
            attr=m.Name("cpu"),
        ),
        args=[],
    ),
    for_in=m.CompFor(target=m.Name(), iter=m.Name(), ifs=[], inner_for_in=None),
)


def _request_tokens_of(statement: cst.SimpleStatementLine) -> cst.BaseExpression | None:
    """What the RPC passes as request_tokens: X of args=(X,) (v11), the expression None where it
    passes no arguments (0.3.0's own call); Python None for any other call (left alone)."""
    call = statement.body[0].value  # type: ignore[attr-defined]
    rest = call.args[1:]
    args = [a for a in rest if a.keyword is not None and a.keyword.value == "args"]
    if any(a.keyword is None for a in rest) or len(args) > 1:
        return None
    if not args:
        return cst.Name("None")
    value = args[0].value
    if (
        isinstance(value, cst.Tuple)
        and len(value.elements) == 1
        and not isinstance(value.elements[0], cst.StarredElement)
    ):
        return value.elements[0].value
    return None


def _stepped_tokens(function: cst.FunctionDef) -> str | None:
    """The request tokens' expression where the function has v11's per-step RPC and one
    unpatched fetch of the captured states with request tokens (the steps can carry the
    transfer); None otherwise."""
    if not m.findall(function, SET_METADATA):
        return None
    guarded = [rpc for guard in m.findall(function, GUARD) for rpc in m.findall(guard, RPC_ASSIGN)]
    rpcs = [rpc for rpc in m.findall(function, RPC_ASSIGN) if not any(rpc is g for g in guarded)]
    tokens = _request_tokens_of(rpcs[0]) if len(rpcs) == 1 else None  # type: ignore[arg-type]
    if tokens is None or m.matches(tokens, m.Name("None")):
        return None
    return cst.Module(body=[]).code_for_node(tokens)


class _Blocks(cst.CSTTransformer):
    """Rewrites the RPC statement in every block of one function, and with steps (the request
    tokens' expression) v11's per-step RPC (see the codemod)."""

    def __init__(self, codemod: PatchCodemod, steps: str | None) -> None:
        super().__init__()
        self.codemod = codemod
        self.steps = steps
        self.in_guard = 0

    def visit_If(self, node: cst.If) -> None:
        if m.matches(node, GUARD):
            self.in_guard += 1

    def leave_If(self, original: cst.If, updated: cst.If) -> cst.If:
        if m.matches(original, GUARD):
            self.in_guard -= 1
        return updated

    def leave_ListComp(self, original: cst.ListComp, updated: cst.BaseExpression) -> cst.BaseExpression:
        # `[h[a : b].clone().cpu() for h in layers]`, each prompt's own rows: `_prompt_rows(layers, a, b)`
        if not m.matches(updated, PROMPT_ROWS):
            return updated
        assert isinstance(updated, cst.ListComp)
        if updated.elt.func.value.func.value.value.value != updated.for_in.target.value:  # type: ignore[attr-defined]
            return updated  # rows of something else than the loop's layer
        span = updated.elt.func.value.func.value.slice[0].slice  # type: ignore[attr-defined]
        iterable = updated.for_in.iter
        code = cst.Module(body=[]).code_for_node
        self.codemod.rewrote()
        return cst.parse_expression(f"{ROWS}({code(iterable)}, {code(span.lower)}, {code(span.upper)})")

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        if self.steps is None or not m.matches(updated, SET_METADATA):
            return updated
        self.codemod.rewrote()
        scheduled = cst.Module(body=[]).code_for_node(updated.body[0].value.args[1].value.elements[0].value)  # type: ignore[attr-defined]
        statement = cst.parse_statement(f"{STEP}(self, {self.steps}, {scheduled})\n")
        assert isinstance(statement, cst.SimpleStatementLine)
        return statement.with_changes(leading_lines=updated.leading_lines)

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        if self.in_guard:  # the fallback inside the patched guard
            return updated
        body = list(updated.body)
        out: list[cst.BaseStatement] = []
        changed = False
        for index, statement in enumerate(body):
            if m.matches(statement, GUARD) and index and m.matches(body[index - 1], FAST_ASSIGN):
                self.codemod.found_patched()
            elif m.matches(statement, RPC_ASSIGN) and (tokens := _request_tokens_of(statement)) is not None:
                self.codemod.rewrote()
                changed = True
                expression = cst.Module(body=[]).code_for_node(tokens)
                fetch = AFTER_STEPS if self.steps is not None else FETCH
                fast = cst.parse_statement(f"{REPLY} = {fetch}(self, {expression})\n").with_changes(
                    leading_lines=statement.leading_lines
                )
                guard = cst.parse_statement(f"if {REPLY} is None:\n    pass\n")
                assert isinstance(guard, cst.If)
                fallback = statement.with_changes(
                    leading_lines=[cst.EmptyLine(indent=True, comment=cst.Comment(GUARD_COMMENT))]
                )
                out.extend([fast, guard.with_changes(body=guard.body.with_changes(body=[fallback]))])
                continue
            out.append(statement)
        return updated.with_changes(body=out) if changed else updated


class CapturedStatesThroughSharedMemory(PatchCodemod):
    """`captured_states_list = self.executor.collective_rpc("_get_captured_states", ...)`, with
    args=(X,) (v11's call) or none (0.3.0's), becomes the shared-memory fetch of the same
    states (X, or None), with that call kept as the fallback under
    `if captured_states_list is None:`; the module gets the helpers (before its first class).

    In a function that also has v11's `self.executor.collective_rpc("_set_request_metadata",
    args=(S,))` before each step, the steps carry the transfer: that RPC becomes
    `_states_while_stepping(self, X, S)` and the fetch `_captured_states_after_steps(self, X)`
    (both or neither: one alone would write steps nobody reads, or read steps nobody wrote).

    Patched: the fetch followed by that guard. speculators 0.4.0 assigns its reply (keyed by
    request id) to another name: anchor-missing. The rewrite runs on each outermost function as
    it is left, after the edits of earlier patches on it (v11 rewrites the whole of generate()
    there), so the fetch always asks for what the RPC asks for.
    """

    ANCHOR = f'{REPLY} = self.executor.collective_rpc("_get_captured_states", ...)'

    def __init__(self, filename: str = "<source>") -> None:
        super().__init__(filename)
        self.depth = 0

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.depth += 1

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        self.depth -= 1
        if self.depth:
            return updated
        result = updated.visit(_Blocks(self, _stepped_tokens(updated)))
        assert isinstance(result, cst.FunctionDef)
        return result

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        if not (self.rewrites or self.patched_seen):
            return updated
        if any(isinstance(s, cst.FunctionDef) and s.name.value == FETCH for s in updated.body):
            return updated
        self.rewrote()
        return with_helpers_before_first_class(updated, HELPERS_SOURCE)


# when=EVERY_RELEASE: the RPC queue carries the reply on every release the patches support.

BEFORE = """\
import torch


class VllmHiddenStatesGenerator:
    def generate(self, token_ids):
        request_tokens = {}
        # Get captured states from driver worker
        captured_states_list = self.executor.collective_rpc(
            "_get_captured_states",
            args=(request_tokens,),
            unique_reply_rank=0,
        )
        offset = 0
        rows = [h[offset : offset + 3].clone().cpu() for h in captured_states_list]
        return rows
"""

AFTER = (
    "import torch\n\n\n"
    + HELPERS_SOURCE
    + """

class VllmHiddenStatesGenerator:
    def generate(self, token_ids):
        request_tokens = {}
        # Get captured states from driver worker
        captured_states_list = _captured_states_through_shared_memory(self, request_tokens)
        if captured_states_list is None:
            # nothing captured, or no shared buffer (logged): vLLM's RPC queue carries them
            captured_states_list = self.executor.collective_rpc(
                "_get_captured_states",
                args=(request_tokens,),
                unique_reply_rank=0,
            )
        offset = 0
        rows = _prompt_rows(captured_states_list, offset, offset + 3)
        return rows
"""
)

# v11's generate(): its RPC before each step carries the steps' transfer
BEFORE_STEPS = """\
import torch


class VllmHiddenStatesGenerator:
    def generate(self, token_ids):
        request_tokens = {"req_0_0": 3}
        while (scheduler_output := self.scheduler.schedule()).total_num_scheduled_tokens > 0:
            self.executor.collective_rpc(
                "_set_request_metadata",
                args=(dict(scheduler_output.num_scheduled_tokens),),
            )
            self.executor.execute_model(scheduler_output)
        captured_states_list = self.executor.collective_rpc(
            "_get_captured_states",
            args=(request_tokens,),
            unique_reply_rank=0,
        )
        return captured_states_list
"""
AFTER_STEPS_EXAMPLE = (
    "import torch\n\n\n"
    + HELPERS_SOURCE
    + """

class VllmHiddenStatesGenerator:
    def generate(self, token_ids):
        request_tokens = {"req_0_0": 3}
        while (scheduler_output := self.scheduler.schedule()).total_num_scheduled_tokens > 0:
            _states_while_stepping(self, request_tokens, dict(scheduler_output.num_scheduled_tokens))
            self.executor.execute_model(scheduler_output)
        captured_states_list = _captured_states_after_steps(self, request_tokens)
        if captured_states_list is None:
            # nothing captured, or no shared buffer (logged): vLLM's RPC queue carries them
            captured_states_list = self.executor.collective_rpc(
                "_get_captured_states",
                args=(request_tokens,),
                unique_reply_rank=0,
            )
        return captured_states_list
"""
)

OWN_CALL = 'captured_states_list = self.executor.collective_rpc("_get_captured_states", unique_reply_rank=0)'
BEFORE_0_3_0 = """\
import torch


class G:
    def generate(self):
        captured_states_list = self.executor.collective_rpc("_get_captured_states", unique_reply_rank=0)
        return captured_states_list
"""
AFTER_0_3_0 = (
    "import torch\n\n\n"
    + HELPERS_SOURCE
    + "\n\nclass G:\n    def generate(self):\n"
    + f"        {REPLY} = {FETCH}(self, None)\n"
    + f"        if {REPLY} is None:\n"
    + f"            {GUARD_COMMENT}\n"
    + f"            {OWN_CALL}\n"
    + "        return captured_states_list\n"
)

PATCH = Patch(
    id="v21-shared-memory-states",
    title="the captured states reach the generator through a shared host buffer, not vLLM's RPC queue",
    target=GENERATOR,
    requires=SPECULATORS_0_3,
    edits=(
        Edit(
            CapturedStatesThroughSharedMemory,
            when=EVERY_RELEASE,
            answers="collective_rpc sends a callable to every worker and returns only the reply of "
            "unique_reply_rank; that reply travels through the executor's message queue",
            fact=Fact(
                "has-param",
                "vllm.v1.executor.multiproc_executor",
                "MultiprocExecutor.collective_rpc",
                "unique_reply_rank",
            ),
        ),
    ),
    examples=(
        Example(before=BEFORE_STEPS, after=AFTER_STEPS_EXAMPLE),
        # the fetch with request tokens but no per-step RPC: the transfer after the last step
        Example(before=BEFORE, after=AFTER),
        # 0.3.0's own call (v11 not applied): the same rows, in the order vLLM computed them
        Example(before=BEFORE_0_3_0, after=AFTER_0_3_0),
    ),
    satisfied=(AFTER_STEPS_EXAMPLE, AFTER),
    near_misses=(
        # another RPC (_reset_capture) bound to the same name: not the captured states
        """
            import torch


            class G:
                def generate(self):
                    captured_states_list = self.executor.collective_rpc("_reset_capture", unique_reply_rank=0)
                    return captured_states_list
        """,
    ),
    upstream="not a vLLM change: vLLM's executor message queue "
    "(vllm/distributed/device_communicators/shm_broadcast.py) is built for small replies; vLLM's "
    "own hidden-states connector (vllm/distributed/kv_transfer/kv_connector/v1/"
    "example_hidden_states_connector.py) writes files instead",
    attribute_calls=(
        AttributeCall(
            "generator.executor",
            "collective_rpc",
            "vllm.v1.executor.multiproc_executor:MultiprocExecutor.collective_rpc",
        ),
    ),
    without_it="correct but slow: every captured tensor travels through vLLM's RPC message queue "
    "(about 225 MB/s on an H200: 18,242 tokens/s, 0.071 of vLLM's own prefill, 1.0B Llama, hidden 2048); "
    "figures in the extraction speed page",
    # correct without it, only slow: the run passes (its need is measured by bench/extract.py)
    leave_one_out=(
        LeaveOneOut("0.16.0", None, calls="all"),
        LeaveOneOut("0.16.0", None, calls="all", tensor_parallel=2),
    ),
    since="any",
    # 0.4.0 returns its captured states through the same RPC queue under another name
    # (request_states_dict): this shape is not there; speculators 0.4.x's own patch set decides
    on_fixed_in="anchor-missing",
)
