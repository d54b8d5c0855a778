"""v13: stop passing eos_token_id to Request(...).

vLLM 0.17.0: vllm/v1/request.py (Request.__init__ no longer takes eos_token_id; the EOS token
lives in SamplingParams, which vLLM fills from the model's generation config). The generator only
prefills (max_tokens=1), so the EOS token never matters to it: the keyword just goes.
speculators 0.4.0 still passes it (it predates vLLM 0.17), so on vLLM 0.17 it needs this as much as
0.3.0 does.
"""

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod, has_keyword, remove_keyword
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import GENERATOR, SPECULATORS_0_3_OR_0_4

REQUEST_CALL = m.Call(func=m.Name("Request"))
EOS_KEYWORD = "eos_token_id"

# vLLM 0.17.0 dropped the parameter from Request.__init__.
REQUEST_WITHOUT_EOS_SINCE = {"vllm": ">=0.17.0"}


class RequestWithoutEosTokenId(PatchCodemod):
    """Request(..., eos_token_id=..., ...) -> Request(..., ...)."""

    ANCHOR = "a call Request(...)"

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not m.matches(updated, REQUEST_CALL):
            return updated
        if not has_keyword(updated, EOS_KEYWORD):
            self.found_patched()
            return updated
        self.rewrote()
        return remove_keyword(updated, EOS_KEYWORD)


PATCH = Patch(
    id="v13-request-eos-token-id",
    title="Request(...) without eos_token_id (the EOS token lives in SamplingParams)",
    target=GENERATOR,
    requires=SPECULATORS_0_3_OR_0_4,
    edits=(
        Edit(
            RequestWithoutEosTokenId,
            when=REQUEST_WITHOUT_EOS_SINCE,
            answers="Request.__init__ has no parameter eos_token_id",
            fact=Fact("lacks-param", "vllm.v1.request", "Request.__init__", EOS_KEYWORD),
        ),
    ),
    examples=(
        # speculators 0.3.0's call
        Example(
            before="""
                req = Request(
                    request_id=f"req_{self._request_counter}_{i}",
                    prompt_token_ids=ids_list,
                    sampling_params=SamplingParams(
                        max_tokens=MAX_DECODE_TOKENS, temperature=SAMPLING_TEMPERATURE
                    ),
                    pooling_params=None,
                    eos_token_id=self.tokenizer.eos_token_id,
                    arrival_time=INITIAL_ARRIVAL_TIME,
                )
            """,
            after="""
                req = Request(
                    request_id=f"req_{self._request_counter}_{i}",
                    prompt_token_ids=ids_list,
                    sampling_params=SamplingParams(
                        max_tokens=MAX_DECODE_TOKENS, temperature=SAMPLING_TEMPERATURE
                    ),
                    pooling_params=None,
                    arrival_time=INITIAL_ARRIVAL_TIME,
                )
            """,
        ),
        # last on one line: the closing parenthesis follows the new last argument
        Example(
            before="""
                req = Request(request_id="r", prompt_token_ids=[1], eos_token_id=2)
            """,
            after="""
                req = Request(request_id="r", prompt_token_ids=[1])
            """,
        ),
    ),
    satisfied=('req = Request(request_id="r", prompt_token_ids=[1], sampling_params=None, pooling_params=None)\n',),
    near_misses=(
        # EngineCoreRequest, which keeps eos_token_id: not the scheduler's Request
        """
            req = EngineCoreRequest(request_id="r", prompt_token_ids=[1], eos_token_id=2)
        """,
    ),
    upstream="vLLM 0.17.0: vllm/v1/request.py (Request.__init__ without eos_token_id)",
    without_it="without it on vLLM 0.17 and later: `TypeError: Request.__init__() got an unexpected keyword argument 'eos_token_id'` at the first `generate()` (verification catches it and rolls back)",
    leave_one_out=(
        LeaveOneOut("0.32.0", Symptom("generate 1", "TypeError", ("unexpected keyword argument 'eos_token_id'",))),
        LeaveOneOut("0.17.1", Symptom("verify", messages=("got an unexpected keyword argument 'eos_token_id'",))),
        LeaveOneOut(
            "0.20.0",
            Symptom("verify", messages=("got an unexpected keyword argument 'eos_token_id'",)),
            speculators="0.4.0.1",
        ),
    ),
)
