"""Bind the patched files' calls, statically, against one release's sources: vLLM's, and the
transformers and torch releases a vLLM release allows (deps.py).

What the agent's verification does at run time (import, then `inspect.signature(...).bind`),
done with `ast` on a release read from the package index: for every release the matrix reads,
the files the patches selected there produce (speculators' pristine file, transformed), and in
them every `from vllm... import NAME` (a module or name that must exist) and every call of such a
NAME, of an imported module's attribute (`torch.cuda.mem_get_info()`), or of a declared attribute
call (AttributeCall: `self.executor.sample_tokens(...)` against `MultiprocExecutor.sample_tokens`)
bound to the callee's parameters: required arguments present, no unknown keyword, not too many
positional arguments. Names are resolved by names.py.

What it cannot see (said in docs/check-upstream.md): calls through values it cannot type (a method of an
object returned by vLLM, a class's methods), names a package defines outside itself or lazily (a
module `__getattr__`, torch's C functions), signatures made at run time (decorators, metaclasses
that change them), classes whose constructor comes from outside the package (msgspec, pydantic
models without a dataclass shape), and anything that depends on what the code does when it runs.

With `classes` (the KV connectors of the speculators 0.5+ path, connectors.py), the file's classes
that subclass vLLM classes are bound too: each base must exist; each method that a base defines
must take what the base's takes (same kind, parameters callers pass); a method no base defines
and nothing in the file's own package refers to is an override vLLM never calls (hs-connectors'
`_write_tensors` before vLLM 0.22.0); `self.NAME` the class does not define, `super().NAME(...)`
and `ImportedClass.NAME(...)` must find NAME in vLLM's classes, and their calls bind to it.
"""

from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..core.syntax import dotted_name
from .facts import MAX_DEPTH, SourceTree, last_definition, parse, top_level
from .names import Target, attribute_target, guarded_imports, lookup, source_tree

DATACLASS_DECORATORS = {"dataclass", "config"}  # vLLM's config classes: @config @dataclass


@dataclass
class Binding:
    """The calls of one patched file bound against one release."""

    file: str  # the patched file (path in its distribution)
    release: str  # e.g. "vllm 0.17.0"
    patches: list[str] = field(default_factory=list)  # the patches selected there
    versions: dict[str, str] = field(default_factory=dict)  # the versions the file was patched for
    checked: int = 0  # imports and calls bound
    unchecked: list[str] = field(default_factory=list)  # what could not be bound statically, and why
    problems: list[str] = field(default_factory=list)
    # Bound against a transformers or torch release: the vLLM releases that allow it (their
    # wheel's Requires-Dist) and where apply writes this file so. Empty for a vLLM release.
    allowed_by: list[str] = field(default_factory=list)

    @property
    def vllm_releases(self) -> list[str]:
        """The vLLM releases this binding speaks for."""
        return [self.versions["vllm"]] if "vllm" in self.versions else self.allowed_by

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "release": self.release,
            "patches": self.patches,
            "versions": self.versions,
            "checked": self.checked,
            "unchecked": self.unchecked,
            "problems": self.problems,
            "allowed_by": self.allowed_by,
        }


# ---------------------------------------------------------------- parameters of a callee


@dataclass(frozen=True)
class Params:
    positional: tuple[tuple[str, bool], ...]  # (name, has default), self excluded
    positional_only: frozenset[str]
    keyword_only: tuple[tuple[str, bool], ...]
    varargs: bool
    varkw: bool


def function_params(fn: ast.FunctionDef | ast.AsyncFunctionDef, drop_first: bool) -> Params:
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    defaults = [False] * (len(positional) - len(args.defaults)) + [True] * len(args.defaults)
    pairs = list(zip((a.arg for a in positional), defaults))
    posonly = {a.arg for a in args.posonlyargs}
    if drop_first and pairs:
        posonly.discard(pairs[0][0])
        pairs = pairs[1:]
    kwonly = tuple((a.arg, d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults))
    return Params(tuple(pairs), frozenset(posonly), kwonly, args.vararg is not None, args.kwarg is not None)


def _decorator_names(node: ast.AST) -> set[str]:
    names = set()
    for decorator in getattr(node, "decorator_list", ()):
        if isinstance(decorator, ast.Call):
            decorator = decorator.func
        if isinstance(decorator, ast.Name):
            names.add(decorator.id)
        elif isinstance(decorator, ast.Attribute):
            names.add(decorator.attr)
    return names


def _kw_only_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        if isinstance(decorator, ast.Call):
            for keyword in decorator.keywords:
                if keyword.arg == "kw_only" and isinstance(keyword.value, ast.Constant) and keyword.value.value:
                    return True
    return False


def _not_in_init(node: ast.AnnAssign) -> bool:
    """A dataclass field declared `field(init=False)` (or pydantic's Field(init=False))."""
    value = node.value
    return isinstance(value, ast.Call) and any(
        k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False for k in value.keywords
    )


def class_params(tree: SourceTree, module: str, cls: ast.ClassDef) -> Params | str:
    """The constructor's parameters, or why they cannot be known statically."""
    from .facts import field_default

    chain = [(module, cls)]
    seen = 0
    while seen < len(chain) and len(chain) <= MAX_DEPTH:
        chain += tree.bases(*chain[seen])
        seen += 1
    for _, c in chain:
        for keyword in c.keywords:
            if keyword.arg == "metaclass" and dotted_name(keyword.value) not in ("ABCMeta", "abc.ABCMeta"):
                # e.g. transformers 5's ModelOutput: its metaclass wraps every dataclass __init__
                # to take the old keyword past_key_values
                return (
                    f"class {cls.name}'s metaclass {ast.unparse(keyword.value)} may change its constructor at run time"
                )
    # The nearest class in the chain that writes __init__ decides: its own def, or @dataclass's
    # generated one (a dataclass subclass of a class with __init__ gets the dataclass's).
    for index, (_owner_module, c) in enumerate(chain):
        own = last_definition(c.body, "__init__")
        if isinstance(own, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return function_params(own, drop_first=True)
        if _decorator_names(c) & DATACLASS_DECORATORS:
            chain = chain[index:]
            break
    else:
        init = tree.member(module, cls, "__init__")  # bases outside the chain followed (depth)
        if init is not None and isinstance(init[1], (ast.FunctionDef, ast.AsyncFunctionDef)):
            return function_params(init[1], drop_first=True)
        return f"class {cls.name} has no __init__ in {tree.package} (its constructor comes from outside)"
    fields: dict[str, bool] = {}
    kw_only = any(_kw_only_dataclass(c) for _, c in chain)
    for _, c in reversed(chain):  # bases first, as dataclasses orders fields
        for node in c.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                annotation = ast.unparse(node.annotation)
                if annotation.startswith(("ClassVar", "typing.ClassVar")) or _not_in_init(node):
                    continue
                fields[node.target.id] = field_default(node)[0]
    pairs = tuple(fields.items())
    if kw_only:
        return Params((), frozenset(), pairs, False, False)
    return Params(pairs, frozenset(), (), False, False)


def bind(params: Params, positional: int, keywords: list[str]) -> str | None:
    """inspect.Signature.bind's verdict, in its words, for a call with `positional` arguments
    and these keyword names."""
    if positional > len(params.positional) and not params.varargs:
        return "too many positional arguments"
    filled = {name for name, _ in params.positional[:positional]}
    names = {name for name, _ in params.positional} | {name for name, _ in params.keyword_only}
    for keyword in keywords:
        if keyword in params.positional_only:
            if not params.varkw:
                return f"{keyword!r} parameter is positional only, but was passed as a keyword"
            continue
        if keyword in names:
            if keyword in filled:
                return f"multiple values for argument {keyword!r}"
            filled.add(keyword)
        elif not params.varkw:
            return f"got an unexpected keyword argument {keyword!r}"
    for name, has_default in (*params.positional, *params.keyword_only):
        if not has_default and name not in filled:
            return f"missing a required argument: {name!r}"
    return None


def _call_shape(call: ast.Call) -> tuple[int, list[str]] | None:
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None  # *args / **kwargs at the call site: arity unknown statically (as the agent)
    return len(call.args), [k.arg for k in call.keywords if k.arg is not None]


# ---------------------------------------------------------------- one file against one release


def bind_file(
    code: str,
    path: str,
    tree: SourceTree,
    release: str,
    attribute_calls=(),
    prefixes: tuple[str, ...] = ("vllm",),
    classes: frozenset[str] | None = None,
) -> Binding:
    """Every import from `prefixes` in `code` must exist in `tree`'s release, and every call of an
    imported name (and each declared attribute call) must bind to its parameters there. With
    `classes` (the attribute names the file's own package uses anywhere), its subclasses of the
    release's classes are bound too (_ClassBinder)."""
    result = Binding(path, release)
    module_ast = parse(code)  # under the lock: bindings run in threads (facts.parse says why)
    binder = _FileBinder(result, tree, module_ast, prefixes)
    binder.bind_imports()
    binder.bind_calls()
    for call in attribute_calls:
        binder.bind_attribute_call(call)
    if classes is not None:
        _ClassBinder(binder, classes).bind()
    result.unchecked = list(dict.fromkeys(result.unchecked))
    return result


class _FileBinder:
    """bind_file's steps over one parsed file, adding to one Binding."""

    def __init__(self, result: Binding, tree: SourceTree, module_ast: ast.AST, prefixes: tuple[str, ...]) -> None:
        self.result = result
        self.tree = tree
        self.module_ast = module_ast
        self.prefixes = prefixes
        self.path, self.release = result.file, result.release
        self.imported: dict[str, tuple[str, str, Target]] = {}  # local name -> (module, name, target)
        self.modules: dict[str, str] = {}  # local name -> module, from `import torch` / `import torch.nn as nn`
        self.type_only: set[int] = set()  # ids of the imports under `if TYPE_CHECKING:`

    def _ours(self, module: str) -> bool:
        return any(module == p or module.startswith(p + ".") for p in self.prefixes)

    def bind_imports(self) -> None:
        guarded = guarded_imports(self.module_ast)
        self.type_only = _type_checking_imports(self.module_ast)
        for node in ast.walk(self.module_ast):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if self._ours(alias.name):
                        top = alias.name.split(".")[0]
                        self.modules[alias.asname or top] = alias.name if alias.asname else top
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and self._ours(node.module):
                for alias in node.names:
                    target = self._import_target(node, node.module, alias, guarded)
                    self.imported[alias.asname or alias.name] = (node.module, alias.name, target)

    def _import_target(self, node: ast.ImportFrom, module: str, alias: ast.alias, guarded: dict) -> Target:
        """`from module import alias`: checked, unchecked or a problem; the target its calls bind to."""
        result, release = self.result, self.release
        target = lookup(self.tree, module, alias.name)
        if target.kind == "external":  # neither found nor known to be missing
            result.unchecked.append(f"from {module} import {alias.name}: {target.detail}")
        else:
            result.checked += 1
        if target.kind == "missing" and id(node) in self.type_only:
            # `if TYPE_CHECKING:`: for annotations only, never imported when the file runs
            result.unchecked.append(
                f"{module}.{alias.name}: {target.detail} in {release}, imported under TYPE_CHECKING"
            )
        elif target.kind == "missing" and id(node) in guarded:
            # `try: from X import f / except ImportError: def f(...)`: the file's own f is called there
            fallback = guarded[id(node)].get(alias.asname or alias.name)
            result.unchecked.append(
                f"{module}.{alias.name}: {target.detail} in {release}, guarded by except ImportError"
                + (" (the file's own definition is bound)" if fallback is not None else "")
            )
            if fallback is not None:
                target = Target("def", self.path, fallback)
        elif target.kind == "missing":
            result.problems.append(
                f"{self.path}:{node.lineno}: from {module} import {alias.name}: {target.detail} in {release}"
            )
        return target

    def bind_calls(self) -> None:
        for node in ast.walk(self.module_ast):
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Name) and node.func.id in self.imported:
                module, name, target = self.imported[node.func.id]
            elif isinstance(node.func, ast.Attribute) and (dotted_name(node.func) or "").split(".")[0] in self.modules:
                dotted = dotted_name(node.func) or ""
                local, _, rest = dotted.partition(".")
                module, name, target = attribute_target(self.tree, f"{self.modules[local]}.{rest}")
                if target.kind == "missing":
                    self.result.checked += 1
                    self.result.problems.append(
                        f"{self.path}:{node.lineno}: {dotted}(...): {target.detail} in {self.release}"
                    )
                    continue
            else:
                continue
            self._bind_call(node, module, name, target)

    def _bind_call(self, node: ast.Call, module: str, name: str, target: Target) -> None:
        result = self.result
        shape = _call_shape(node)
        if target.kind != "def" or shape is None:
            if target.kind == "external":
                result.unchecked.append(f"{module}.{name}: {target.detail}")
            return
        if target.overloads:  # a stub's overloads: one of them must take the call
            errors = [bind(function_params(o, drop_first=False), *shape) for o in target.overloads]
            result.checked += 1
            error = None if None in errors else f"no overload of {len(errors)} takes it ({errors[0]})"
        else:
            params = _params_of(self.tree, target)
            if isinstance(params, str):
                result.unchecked.append(f"{module}.{name}: {params}")
                return
            result.checked += 1
            error = bind(params, *shape)
        if error:
            result.problems.append(f"{self.path}:{node.lineno}: {module}.{name}(...): {error} in {self.release}")

    def bind_attribute_call(self, call: dict) -> None:
        """A declared AttributeCall: every `receiver.method(...)` in the file against its implementation."""
        result = self.result
        module, _, qual = call["implementation"].partition(":")
        label = f"{call['receiver']}.{call['method']}"
        hit = self.tree.resolve(module, qual)
        calls = [
            n
            for n in ast.walk(self.module_ast)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == call["method"]
            and dotted_name(n.func.value) == call["receiver"]
        ]
        if hit is None or not isinstance(hit[1], (ast.FunctionDef, ast.AsyncFunctionDef)):
            if calls:
                result.problems.append(
                    f"{self.path}: {label}: {call['implementation']} does not exist in {self.release}"
                )
            return
        params = function_params(hit[1], drop_first="staticmethod" not in _decorator_names(hit[1]))
        for n in calls:
            shape = _call_shape(n)
            if shape is None:
                continue
            result.checked += 1
            error = bind(params, *shape)
            if error:
                result.problems.append(f"{self.path}:{n.lineno}: {label}(...): {error} in {self.release}")


def _type_checking_imports(module: ast.AST) -> set[int]:
    """ids of the imports inside `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    out: set[int] = set()
    for node in ast.walk(module):
        if isinstance(node, ast.If) and dotted_name(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for statement in node.body:
                out.update(id(n) for n in ast.walk(statement) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return out


# ---------------------------------------------------------------- subclasses of upstream classes

# Bases that add no method a subclass could mean to override.
TRIVIAL_BASES = {"object", "ABC", "abc.ABC", "Generic", "typing.Generic", "Protocol", "typing.Protocol"}
PROPERTY_DECORATORS = {"property", "cached_property", "setter", "getter", "deleter"}


def method_kind(node: ast.AST) -> str:
    """staticmethod, classmethod, property or method (as its decorators make it)."""
    names = _decorator_names(node)
    if "staticmethod" in names:
        return "staticmethod"
    if "classmethod" in names:
        return "classmethod"
    if names & PROPERTY_DECORATORS:
        return "property"
    return "method"


def override_problem(base: ast.FunctionDef | ast.AsyncFunctionDef, over: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """Why `over` does not take every call its base method `base` takes ('' when it does): the
    same kind, each of the base's parameters at the same place (or *args / **kwargs), nothing
    more required."""
    kind, base_kind = method_kind(over), method_kind(base)
    if kind != base_kind:
        return f"it is a {kind} where the base's is a {base_kind}"
    if kind == "property":
        return ""
    drop = kind != "staticmethod"
    b, o = function_params(base, drop_first=drop), function_params(over, drop_first=drop)
    own = {name for name, _ in o.positional} | {name for name, _ in o.keyword_only}
    for index, (name, _) in enumerate(b.positional):
        if index >= len(o.positional):
            if not o.varargs:
                return f"it takes no parameter {name!r} (the base's parameter {index + 1})"
        elif o.positional[index][0] != name and name not in b.positional_only and not o.varkw:
            return f"its parameter {index + 1} is {o.positional[index][0]!r} where the base's is {name!r}"
    for name, _ in b.keyword_only:
        if name not in own and not o.varkw:
            return f"it takes no keyword {name!r} (the base's)"
    taken = {name for name, _ in b.positional} | {name for name, _ in b.keyword_only}
    for name, has_default in (*o.positional[len(b.positional) :], *o.keyword_only):
        if not has_default and name not in taken:
            return f"it requires {name!r}, which the base does not take"
    if b.varargs and not o.varargs:
        return "it takes no *args (the base's does)"
    if b.varkw and not o.varkw:
        return "it takes no **kwargs (the base's does)"
    return ""


class _ClassBinder:
    """The file's classes with a base from the release (directly or through the file's own classes)."""

    def __init__(self, binder: _FileBinder, used: frozenset[str]) -> None:
        self.b = binder
        self.used = used
        body = binder.module_ast.body if isinstance(binder.module_ast, ast.Module) else []
        self.local = {n.name: n for n in top_level(body) if isinstance(n, ast.ClassDef)}

    def bind(self) -> None:
        for cls in self.local.values():
            bases = self._bases(cls, set())
            if bases is None or not bases[0]:
                continue  # a base that is gone (its import is the problem) or none from the release
            upstream, complete = bases
            own = self._own_names(cls, set())
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _dunder(node.name):
                    self._bind_method(cls, node, upstream, complete)
            self._bind_uses(cls, upstream, complete, own)

    # -------------------------------------------------------------- bases

    def _bases(self, cls: ast.ClassDef, seen: set[str]) -> tuple[list[tuple[str, ast.ClassDef]], bool] | None:
        """(the release's classes `cls` derives from, in order, through the file's own classes;
        whether every base of the chain was found), or None when a base is missing."""
        seen = seen | {cls.name}
        upstream: list[tuple[str, ast.ClassDef]] = []
        complete = True
        for expr in cls.bases:
            expr = expr.value if isinstance(expr, ast.Subscript) else expr
            name = dotted_name(expr) or ""
            if name in TRIVIAL_BASES:
                continue
            if name in self.local and name not in seen:
                inner = self._bases(self.local[name], seen)
                if inner is None:
                    return None
                upstream += inner[0]
                complete = complete and inner[1]
                continue
            found = self._upstream_class(cls, expr, name)
            if found is None:
                return None
            if isinstance(found, str):
                complete = False
                continue
            upstream.append(found)
            complete = complete and self._chain_complete(found[0], found[1], 0)
        return upstream, complete

    def _upstream_class(self, cls: ast.ClassDef, expr: ast.expr, name: str) -> tuple[str, ast.ClassDef] | str | None:
        """A base written in the file: (module, ClassDef) in the release; a string when it cannot
        be told (not the release's); None when it is missing (reported here, or as its import)."""
        local, _, rest = name.partition(".")
        b = self.b
        if local in b.imported:
            _, _, target = b.imported[local]
            if target.kind == "missing":
                return None  # its import is the problem
            if rest and target.kind == "module":
                _, _, target = attribute_target(b.tree, f"{target.module}.{rest}")
                if target.kind == "missing":
                    b.result.checked += 1
                    b.result.problems.append(
                        f"{b.path}:{cls.lineno}: class {cls.name}({name}): {target.detail} in {b.release}"
                    )
                    return None
            if target.kind == "def" and isinstance(target.node, ast.ClassDef):
                b.result.checked += 1
                return target.module, target.node
            return f"base {name}: {target.detail or 'not a class of the release'}"
        if local in b.modules and rest:
            _, _, target = attribute_target(b.tree, f"{b.modules[local]}.{rest}")
            b.result.checked += 1
            if target.kind == "missing":
                b.result.problems.append(
                    f"{b.path}:{cls.lineno}: class {cls.name}({name}): {target.detail} in {b.release}"
                )
                return None
            if target.kind == "def" and isinstance(target.node, ast.ClassDef):
                return target.module, target.node
        return f"base {name} is not the release's"

    def _chain_complete(self, module: str, cls: ast.ClassDef, depth: int) -> bool:
        """Whether every base up `cls`'s chain is the release's own (or adds nothing): a base
        from outside may define what the subclass overrides."""
        found = self.b.tree.bases(module, cls)
        written = [e.value if isinstance(e, ast.Subscript) else e for e in cls.bases]
        if len(found) != len([e for e in written if (dotted_name(e) or "") not in TRIVIAL_BASES]):
            return False
        return depth < MAX_DEPTH and all(self._chain_complete(m, c, depth + 1) for m, c in found)

    def _member(self, upstream, name: str) -> tuple[str, ast.ClassDef, ast.AST] | None:
        """`name` in the first of the release's classes that has it (the MRO, near enough)."""
        for module, base in upstream:
            hit = self._member_of(module, base, name, 0)
            if hit is not None:
                return hit
        return None

    def _member_of(self, module: str, cls: ast.ClassDef, name: str, depth: int):
        found = last_definition(cls.body, name)
        if found is not None:
            return module, cls, found
        from .facts import instance_attribute

        found = instance_attribute(cls, name)
        if found is not None:
            return module, cls, found
        if depth <= MAX_DEPTH:
            for base_module, base in self.b.tree.bases(module, cls):
                hit = self._member_of(base_module, base, name, depth + 1)
                if hit is not None:
                    return hit
        return None

    def _own_names(self, cls: ast.ClassDef, seen: set[str]) -> set[str]:
        """What the class and the file's classes it derives from define or assign on self."""
        from .facts import defined_names

        names = {n for node in cls.body for n in defined_names(node)}
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, (ast.Store, ast.Del))
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
        for expr in cls.bases:
            name = dotted_name(expr.value if isinstance(expr, ast.Subscript) else expr) or ""
            if name in self.local and name not in seen:
                names |= self._own_names(self.local[name], seen | {cls.name})
        return names

    # -------------------------------------------------------------- methods and uses

    def _bind_method(self, cls: ast.ClassDef, node, upstream, complete: bool) -> None:
        b = self.b
        hit = self._member(upstream, node.name)
        label = f"{b.path}:{node.lineno}: {cls.name}.{node.name}"
        if hit is None:
            if node.name in self.used:
                return  # the class's own method: its package calls it
            names = ", ".join(base.name for _, base in upstream)
            if not complete:
                b.result.unchecked.append(f"{cls.name}.{node.name}: a base from outside the release may define it")
                return
            b.result.checked += 1
            package = b.path.split("/")[0]
            b.result.problems.append(
                f"{label} overrides nothing: no base ({names}) defines {node.name} in {b.release}, and nothing in "
                f"{package} calls it: it is never called"
            )
            return
        module, base, found = hit
        b.result.checked += 1
        if isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)):
            why = override_problem(found, node)
            if why:
                b.result.problems.append(
                    f"{label} overrides {base.name}.{node.name} ({module}), but {why} in {b.release}"
                )

    def _bind_uses(self, cls: ast.ClassDef, upstream, complete: bool, own: set[str]) -> None:
        """`self.NAME` the class does not define, `super().NAME(...)`, `ImportedClass.NAME(...)`."""
        b = self.b
        calls = {id(n.func): n for n in ast.walk(cls) if isinstance(n, ast.Call)}
        reported: set[str] = set()
        for node in ast.walk(cls):
            if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                if node.attr in own or _dunder(node.attr):
                    continue
                subject = f"{value.id}.{node.attr}"
            elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                subject = f"super().{node.attr}"
            else:
                continue
            hit = self._member(upstream, node.attr)
            if hit is None:
                if subject in reported:
                    continue
                reported.add(subject)
                if not complete:
                    b.result.unchecked.append(f"{cls.name}: {subject}: a base from outside the release may define it")
                    continue
                b.result.checked += 1
                names = ", ".join(base.name for _, base in upstream)
                b.result.problems.append(
                    f"{b.path}:{node.lineno}: {subject} ({cls.name}): no base ({names}) defines {node.attr} in {b.release}"
                )
                continue
            call = calls.get(id(node))
            if call is not None:
                self._bind_member_call(call, subject, hit, bound=True)
        for node in ast.walk(b.module_ast):  # ImportedClass.NAME(...)
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            if not (isinstance(owner, ast.Name) and owner.id in b.imported):
                continue
            _, _, target = b.imported[owner.id]
            if target.kind != "def" or not isinstance(target.node, ast.ClassDef):
                continue
            subject = f"{owner.id}.{node.func.attr}"
            hit = self._member([(target.module, target.node)], node.func.attr)
            if hit is None:
                if self._chain_complete(target.module, target.node, 0) and subject not in reported:
                    reported.add(subject)
                    b.result.checked += 1
                    b.result.problems.append(
                        f"{b.path}:{node.lineno}: {subject}(...): {owner.id} has no {node.func.attr} in {b.release}"
                    )
                continue
            self._bind_member_call(node, subject, hit, bound=False)

    def _bind_member_call(self, call: ast.Call, subject: str, hit, bound: bool) -> None:
        """A call of a method found in the release: through an instance or super() (`bound`), or
        through the class (a classmethod drops cls; a plain function takes self explicitly)."""
        module, base, found = hit
        shape = _call_shape(call)
        if not isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)) or shape is None:
            return
        kind = method_kind(found)
        if kind == "property":
            return
        drop = kind == "classmethod" or (kind == "method" and bound)
        b = self.b
        b.result.checked += 1
        error = bind(function_params(found, drop_first=drop), *shape)
        if error:
            b.result.problems.append(
                f"{b.path}:{call.lineno}: {subject}(...) ({base.name}.{found.name}, {module}): {error} in {b.release}"
            )


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _params_of(tree: SourceTree, target: Target) -> Params | str:
    node = target.node
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return function_params(node, drop_first=False)
    if isinstance(node, ast.ClassDef):
        return class_params(tree, target.module, node)
    return f"defined by an assignment in {target.module} (its signature is made at run time)"


BINDINGS_FILE = ".bindings.json"


def _binder_key() -> str:
    from . import facts, names

    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(Path(facts.__file__).read_bytes())
    digest.update(Path(names.__file__).read_bytes())
    return digest.hexdigest()[:16]


def bind_cached(files, version: str, variants, package: str = "vllm") -> list[Binding]:
    """bind_file for each patched file (patched.Variant) or connector module (connectors.ConnectorFile)
    on the release of `package` that `files` reads, cached beside its files: a release never
    changes, so a binding is computed again only when the bound code or this binder changes."""
    from .wheels import write_atomic

    cache_file = files.root / BINDINGS_FILE
    binder = _binder_key()
    try:
        cached = json.loads(cache_file.read_text())
        if cached.get("binder") != binder:
            cached = {}
    except (OSError, ValueError):
        cached = {}
    known = cached.get("bindings", {})
    tree = None
    out, fresh = [], False
    for variant in variants:
        used = getattr(variant, "used", None)  # a connectors.ConnectorFile: its classes are bound too
        shape = [variant.code, variant.attribute_calls, sorted(used) if used is not None else None]
        key = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()
        if key in known:
            binding = Binding(**known[key])
        else:
            tree = tree or source_tree(files, package)
            calls = variant.attribute_calls if package == "vllm" else ()  # declared calls are into vLLM
            binding = bind_file(variant.code, variant.path, tree, f"{package} {version}", calls, (package,), used)
            known[key] = {k: v for k, v in binding.to_json().items() if k not in ("patches", "versions", "allowed_by")}
            fresh = True
        binding.patches = list(variant.patches)
        binding.versions = dict(variant.versions)
        out.append(binding)
    if fresh:
        write_atomic(cache_file, json.dumps({"binder": binder, "bindings": known}, indent=1).encode())
    return out
