"""v22: return generate()'s results in the caller's order, not sorted by request-id string.

speculators 0.4.0 (and 0.4.0.1, the same file) names each prompt's request `req_{call}_{i}` and
gathers the results with `for req_id in sorted(request_id_to_idx.keys())`: a sort of strings, so
from the eleventh prompt of a call on `req_0_10` comes before `req_0_2` and a call of 12 prompts
returns them as [0, 1, 10, 11, 2, ..., 9]. No error: each result carries its own input_ids, and a
caller that pairs results with its prompts by position (as training-data scripts do) trains on
another prompt's hidden states. Not a vLLM change: wrong on every release.

The dict is filled in the caller's order (`for i, ids in enumerate(input_ids_list)`), so iterating
it gives that order back; the loop body already looks each prompt up by its id.
"""

from __future__ import annotations

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import EVERY_RELEASE, GENERATOR, SPECULATORS_0_4

IDS = "request_id_to_idx"

# sorted(request_id_to_idx.keys()) or sorted(request_id_to_idx): a string sort of the ids
SORTED_IDS = m.Call(
    func=m.Name("sorted"),
    args=[m.Arg(value=m.Call(func=m.Attribute(value=m.Name(IDS), attr=m.Name("keys")), args=[]) | m.Name(IDS))],
)

# when=EVERY_RELEASE: Not a vLLM change: wrong on every release.


class ResultsInCallerOrder(PatchCodemod):
    """for req_id in sorted(request_id_to_idx.keys()): -> for req_id in request_id_to_idx:"""

    ANCHOR = "a loop `for req_id in sorted(request_id_to_idx.keys())`"

    def leave_For(self, original: cst.For, updated: cst.For) -> cst.For:
        if not m.matches(updated.target, m.Name("req_id")):
            return updated
        if m.matches(updated.iter, m.Name(IDS)):
            self.found_patched()
            return updated
        if not m.matches(updated.iter, SORTED_IDS):
            return updated
        self.rewrote()
        return updated.with_changes(iter=cst.Name(IDS))


BEFORE = """\
results = []
for req_id in sorted(request_id_to_idx.keys()):
    i = request_id_to_idx[req_id]
    results.append({"input_ids": torch.as_tensor(input_ids_list[i])})
"""

AFTER = """\
results = []
for req_id in request_id_to_idx:
    i = request_id_to_idx[req_id]
    results.append({"input_ids": torch.as_tensor(input_ids_list[i])})
"""

PATCH = Patch(
    id="v22-result-order",
    title="generate() returns its results in the caller's order (not sorted by request-id string)",
    target=GENERATOR,
    requires=SPECULATORS_0_4,
    edits=(
        Edit(
            ResultsInCallerOrder,
            when=EVERY_RELEASE,
            answers="vLLM's requests are named by strings ('req_0_10' sorts before 'req_0_2'): the generator "
            "must not order its results by them",
            fact=Fact("has-param", "vllm.v1.request", "Request.__init__", "request_id"),
        ),
    ),
    examples=(Example(before=BEFORE, after=AFTER),),
    satisfied=(AFTER,),
    near_misses=(
        # a sorted loop over layer ids (their order is the right one), not over request_id_to_idx
        """
            results = []
            for layer_id in sorted(self.layer_ids):
                i = layer_index[layer_id]
                results.append({"hidden_states": torch.as_tensor(captured[i])})
        """,
    ),
    upstream="not a vLLM change: speculators 0.4.0 vllm_hidden_states_generator.py, generate() "
    "(`for req_id in sorted(request_id_to_idx.keys())`)",
    without_it="without it a `generate()` call of more than 10 prompts returns them out of the caller's order "
    "([0, 1, 10, 2, ...]: `req_0_10` sorts before `req_0_2`), silently, on every vLLM release: each result "
    "keeps its own input_ids, so a caller pairing results with its prompts by position gets another "
    "prompt's hidden states",
    leave_one_out=(
        LeaveOneOut("0.16.0", Symptom("rows"), calls="all", speculators="0.4.0.1"),
        LeaveOneOut("0.16.0", Symptom("rows"), calls="all", tensor_parallel=2, speculators="0.4.0.1"),
    ),
    since="any",
)
