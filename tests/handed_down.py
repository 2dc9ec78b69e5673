"""The calls the server's layers hand down: where a module of one layer gives a layer below
it a function whose code is of a layer above the taker, which the taker calls later (a call
that climbs back up). ``tests/test_layout.py`` holds them to docs/development.md's list.

Read statically, with ``ast``: each module of ``batchwire`` is indexed (its imports, classes,
methods and the fields its classes set), and every call and attribute assignment in the
server is read with the types its function's annotations and assignments give. The rules:

* **Layers**, top first: :data:`LAYERS`, the order docs/development.md states. Modules
  outside them (config, errors, ``batchwire.common``, the standard library, DALI) are no
  layer: nothing handed to them, or from them, counts.
* **What is handed** is a callable and the layer whose code it runs: a lambda, a nested
  function, a function of a module; a bound method (``self._build_runner``,
  ``self.stages.add``: the layer of the object's class); a port, an object whose methods
  are called back: ``self`` itself (a stream, given to its ticket), or a name or field
  typed with a layer's class that has methods (not data); a field that holds one of these
  (``self._encode``); ``functools.partial`` of one; the iterator of a generator method
  (``self._jobs(...)``, whose ``next`` runs its code); a wrapper, a call that returns a
  ``Callable`` and is given one of these (``timed("read", read)``);
  ``a or b`` of one; a local name bound to any of these; and a parameter annotated
  ``Callable``, of the function's layer (it came from there or above): passed on further
  down (``watch_devices(callback)`` to ``PipelineHealth.listen``), it is handed again.
  Other parameters, and data, are not.
* **The taker** is a function or class of a layer, or a method of an object whose class is
  of one (``setup.ahead.follow``), or of an object such an object holds
  (``health._listeners.append``); a field of such an object typed ``Callable[..., T]`` takes
  for T's layer (``setup.schedule(read)`` gives a scheduling ``Ticket``); a method of an
  object a layer's call returned (``ticket.future(seq).add_done_callback``) for that layer;
  ``functools.partial(taker, ...)`` passes its arguments to the taker. Setting a field or
  an item of another's object hands the value to the object's class (``job.done = ...``).
* **It climbs** where the callable's layer is above the taker's.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
from collections.abc import Iterator

# The server's layers, top first (docs/development.md: "The layers import downward only").
LAYERS = ("workers", "serving", "engine", "scheduling", "runners", "pipelines", "data")


def layer(qualname: str | None) -> int | None:
    """The rank of the layer ``qualname`` (a module, or a name in one) is in, 0 the top;
    None outside the layers."""
    parts = (qualname or "").split(".")
    if parts[:2] == ["batchwire", "server"] and len(parts) > 2 and parts[2] in LAYERS:
        return LAYERS.index(parts[2])
    return None


@dataclasses.dataclass(frozen=True, order=True)
class Handed:
    """One callable handed down: by module ``module`` (``engine/_stream.py``, under
    ``src/batchwire/server/``) to ``taker`` (``StreamReadAhead.follow``; a field set:
    ``Job.done``), ``what`` as written there (``self``)."""

    module: str
    taker: str
    what: str


@dataclasses.dataclass
class _Module:
    name: str
    tree: ast.Module
    names: dict[str, str]  # a name in the module -> the qualified name it is bound to


@dataclasses.dataclass
class _Scope:
    """A function's names: the class of each one's value, the layer of the code of each
    one that is a callable of a layer, and the (layer, taker) of the call that gave it."""

    module: _Module
    cls: str | None  # the class whose method this is (its ``self``)
    types: dict[str, str] = dataclasses.field(default_factory=dict)
    code: dict[str, int] = dataclasses.field(default_factory=dict)
    given: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    in_function: bool = False

    def child(self) -> _Scope:
        """The scope of a function defined here: it sees these names (as they are now)."""
        return _Scope(
            self.module,
            self.cls,
            dict(self.types),
            dict(self.code),
            dict(self.given),
            in_function=True,
        )


_FUNCTION = (ast.FunctionDef, ast.AsyncFunctionDef)


def _is_generator(function: ast.AST) -> bool:
    return any(isinstance(node, ast.Yield | ast.YieldFrom) for node in ast.walk(function))


def _written(expr: ast.expr) -> str:
    """``expr`` as written, a lambda's body left out: ``lambda done: ...``."""
    if isinstance(expr, ast.Lambda):
        expr = ast.Lambda(expr.args, ast.Constant(...))
    return ast.unparse(expr)


def _is_callable(annotation: ast.expr | None) -> bool:
    """Whether ``annotation`` says a callable: ``Callable[...]`` (``| None`` too)."""
    return annotation is not None and ast.unparse(annotation).startswith("Callable")


def _is_self(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Name) and expr.id == "self"


def _is_property(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(ast.unparse(decorator) == "property" for decorator in function.decorator_list)


def _short(qualname: str) -> str:
    """``Cls.method`` or ``function``: a qualified name without its module."""
    parts = qualname.split(".")
    tail = [p for p in parts if p[:1].isupper()]  # from the first class on
    return ".".join(parts[parts.index(tail[0]) :]) if tail else parts[-1]


class Index:
    """The modules of ``sources`` (module name -> source), what each defines and imports."""

    def __init__(self, sources: dict[str, str]) -> None:
        self.modules: dict[str, _Module] = {}
        # Each class, function and method -> (its module, its node).
        self.defs: dict[str, tuple[_Module, ast.AST]] = {}
        # "Class.field" -> [(its annotation, a value set to it, in which method)].
        self.fields: dict[str, list[tuple[ast.expr | None, ast.expr | None, ast.AST | None]]]
        self.fields = {}
        self.reading: set[str] = set()  # the fields whose values are being read now
        for name, source in sources.items():
            self.modules[name] = _Module(name, ast.parse(source, name), {})
        for module in self.modules.values():
            self._read(module)

    def _read(self, module: _Module) -> None:
        package = module.name if self.is_package(module.name) else module.name.rpartition(".")[0]
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")
                base = base[: len(base) - node.level + 1] if node.level else []
                parent = ".".join([*base, *([node.module] if node.module else [])])
                for alias in node.names:
                    module.names[alias.asname or alias.name] = f"{parent}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    module.names[alias.asname or alias.name.split(".")[0]] = alias.name
        for node in module.tree.body:
            if isinstance(node, (*_FUNCTION, ast.ClassDef)):
                module.names[node.name] = f"{module.name}.{node.name}"
                self.defs[f"{module.name}.{node.name}"] = (module, node)
            if isinstance(node, ast.ClassDef):
                self._read_class(module, f"{module.name}.{node.name}", node)

    def is_package(self, name: str) -> bool:
        return any(other.startswith(f"{name}.") for other in self.modules)

    def _read_class(self, module: _Module, cls: str, node: ast.ClassDef) -> None:
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                self._field(f"{cls}.{item.target.id}", item.annotation, item.value, None)
            if not isinstance(item, _FUNCTION):
                continue
            self.defs[f"{cls}.{item.name}"] = (module, item)
            if _is_property(item):
                self._field(f"{cls}.{item.name}", item.returns, None, None)
            for stmt in ast.walk(item):  # the fields its methods set: self.x = ...
                targets = stmt.targets if isinstance(stmt, ast.Assign) else []
                if isinstance(stmt, ast.AnnAssign):
                    targets = [stmt.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                        annotation = stmt.annotation if isinstance(stmt, ast.AnnAssign) else None
                        value = stmt.value if isinstance(stmt, ast.Assign | ast.AnnAssign) else None
                        self._field(f"{cls}.{target.attr}", annotation, value, item)

    def _field(
        self, name: str, annotation: ast.expr | None, value: ast.expr | None, method: ast.AST | None
    ) -> None:
        self.fields.setdefault(name, []).append((annotation, value, method))

    def canonical(self, qualname: str) -> str:
        """Where ``qualname`` is defined, following re-exports (``runners.Job`` is
        ``runners._jobs.Job``)."""
        for _ in range(10):
            if qualname in self.defs:
                break
            module, _, name = qualname.rpartition(".")
            if module not in self.modules or name not in self.modules[module].names:
                break
            qualname = self.modules[module].names[name]
        return qualname

    def of_module(self, qualname: str) -> _Module:
        return self.defs[qualname][0]

    def is_class(self, qualname: str | None) -> bool:
        return qualname is not None and isinstance(self.defs.get(qualname, (0, 0))[1], ast.ClassDef)


class _Reader:
    """The handed-down calls of one module: see the module docstring."""

    def __init__(self, index: Index, module: _Module, path: str) -> None:
        self.index = index
        self.module = module
        self.path = path
        self.found: set[Handed] = set()

    # -- types ---------------------------------------------------------------------------

    def annotated(self, module: _Module, annotation: ast.expr | None) -> str | None:
        """The class of ``batchwire`` an annotation names (``X | None``, ``X[T]``: X)."""
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            annotation = ast.parse(annotation.value, mode="eval").body
        if isinstance(annotation, ast.BinOp):
            return self.annotated(module, annotation.left) or self.annotated(
                module, annotation.right
            )
        if isinstance(annotation, ast.Subscript):
            if ast.unparse(annotation.value) == "Optional":
                return self.annotated(module, annotation.slice)
            annotation = annotation.value
        if isinstance(annotation, ast.Name | ast.Attribute):
            head, _, rest = ast.unparse(annotation).partition(".")
            if head in module.names:
                found = self.index.canonical(".".join(filter(None, [module.names[head], rest])))
                return found if self.index.is_class(found) else None
        return None

    def returns(self, qualname: str | None) -> ast.expr | None:
        """The return annotation of a function or method of ``batchwire``'s."""
        node = self.index.defs.get(qualname or "", (None, None))[1]
        return node.returns if isinstance(node, _FUNCTION) else None

    def type_of(self, expr: ast.expr, scope: _Scope) -> str | None:
        """The class of ``batchwire`` of ``expr``'s value, where its annotations say."""
        if isinstance(expr, ast.Name):
            return scope.cls if expr.id == "self" else scope.types.get(expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self.type_of(expr.value, scope)
            field = f"{owner}.{expr.attr}"
            for annotation, value, method in self.index.fields.get(field, []) if owner else []:
                module = self.index.of_module(owner)
                found = self.annotated(module, annotation)
                if found is None and value is not None and field not in self.index.reading:
                    self.index.reading.add(field)
                    try:
                        found = self.type_of(value, self.method_scope(module, owner, method))
                    finally:
                        self.index.reading.discard(field)
                if found:
                    return found
            return None
        if isinstance(expr, ast.Call):
            callee = self.ref(expr.func, scope)
            if self.index.is_class(callee):
                return callee
            if callee in self.index.defs:
                return self.annotated(self.index.of_module(callee), self.returns(callee))
        return None

    def ref(self, expr: ast.expr, scope: _Scope) -> str | None:
        """The class, function or method of ``batchwire`` ``expr`` names, if it names one."""
        local = isinstance(expr, ast.Name) and (expr.id in scope.types or expr.id in scope.code)
        if isinstance(expr, ast.Name) and expr.id in scope.module.names and not local:
            return self.index.canonical(scope.module.names[expr.id])
        if isinstance(expr, ast.Attribute):
            owner = self.ref(expr.value, scope)
            if not self.index.is_class(owner):  # a method of an object, not of a class
                owner = self.type_of(expr.value, scope)
            if owner and f"{owner}.{expr.attr}" in self.index.defs:
                return f"{owner}.{expr.attr}"
        return None

    def method_scope(self, module: _Module, cls: str | None, method: ast.AST | None) -> _Scope:
        """A method's scope with only its parameters' annotations (to read a field's value)."""
        scope = _Scope(module, cls)
        if isinstance(method, _FUNCTION):
            for arg in [*method.args.posonlyargs, *method.args.args, *method.args.kwonlyargs]:
                if (found := self.annotated(module, arg.annotation)) is not None:
                    scope.types[arg.arg] = found
        return scope

    # -- what is handed, and who takes it ------------------------------------------------

    def code(self, expr: ast.expr, scope: _Scope) -> int | None:
        """The layer whose code ``expr`` runs when called back, if it is a callable (or an
        object whose methods are called) of a layer; None for data."""
        here = layer(self.module.name)
        if isinstance(expr, ast.Lambda):
            return here
        if isinstance(expr, ast.BoolOp | ast.IfExp):  # a or b, a if c else b
            values = expr.values if isinstance(expr, ast.BoolOp) else [expr.body, expr.orelse]
            return next((c for v in values if (c := self.code(v, scope)) is not None), None)
        if isinstance(expr, ast.Name):
            if expr.id == "self":
                return layer(scope.cls)
            if expr.id in scope.code:
                return scope.code[expr.id]
        if isinstance(expr, ast.Call):
            func = self.ref(expr.func, scope)
            if ast.unparse(expr.func) in ("functools.partial", "partial") and expr.args:
                return self.code(expr.args[0], scope)
            if func in self.index.defs and _is_generator(self.index.defs[func][1]):
                return layer(func)  # its iterator runs the generator's code
            if _is_callable(self.returns(func)):  # a wrapper of what it is given
                given = [*expr.args, *(k.value for k in expr.keywords)]
                return next((c for a in given if (c := self.code(a, scope)) is not None), None)
            return None
        if self._is_port(found := self.type_of(expr, scope)):
            return layer(found)  # an object whose methods are called back: a port
        func = self.ref(expr, scope)
        node = self.index.defs.get(func or "", (None, None))[1]
        if isinstance(node, _FUNCTION) and not _is_property(node):
            return layer(func)  # a module's function, or a bound method
        if isinstance(expr, ast.Attribute):  # a field holding a callable: self._encode
            owner = self.type_of(expr.value, scope)
            field = f"{owner}.{expr.attr}"
            for _, value, method in self.index.fields.get(field, []) if owner else []:
                if value is not None and field not in self.index.reading:
                    module = self.index.of_module(owner)
                    reader = _Reader(self.index, module, "")
                    self.index.reading.add(field)  # a field set from itself: self.x = self.x or y
                    try:
                        found = reader.code(value, reader.method_scope(module, owner, method))
                    finally:
                        self.index.reading.discard(field)
                    if found is not None:
                        return found
        return None

    def _is_port(self, cls: str | None) -> bool:
        """Whether ``cls`` is a class of a layer with methods of its own (not data, whose
        class has fields and properties only): an object of it handed down is a port, whose
        methods the taker calls back."""
        node = self.index.defs.get(cls or "", (None, None))[1]
        if not isinstance(node, ast.ClassDef) or layer(cls) is None:
            return False
        return any(
            isinstance(item, _FUNCTION)
            and not item.name.startswith("__")
            and not _is_property(item)
            for item in node.body
        )

    def holder(self, expr: ast.expr, scope: _Scope) -> tuple[int, str] | None:
        """(layer, name) of the object ``expr`` is: of its class (``Job``), held by an object
        of one (``PipelineHealth._listeners``), or what a layer's call returned
        (``Ticket.future()``); None where it is of no layer."""
        owner = self.type_of(expr, scope)
        if owner is not None:
            rank = layer(owner)
            return None if rank is None else (rank, _short(owner))
        if isinstance(expr, ast.Attribute) and (outer := self.holder(expr.value, scope)):
            return outer[0], f"{outer[1]}.{expr.attr}"
        if isinstance(expr, ast.Name) and expr.id in scope.given:
            rank, name = scope.given[expr.id]
            return rank, f"{name}()"
        return None

    def taker(self, func: ast.expr, scope: _Scope) -> tuple[int, str] | None:
        """(layer, name) of what a call of ``func`` hands its arguments to."""
        found = self.ref(func, scope)
        if found is not None:
            rank = layer(found)
            return None if rank is None else (rank, _short(found))
        if not isinstance(func, ast.Attribute):
            return None
        owner = self.type_of(func.value, scope)
        for annotation, _, _ in self.index.fields.get(f"{owner}.{func.attr}", []) if owner else []:
            # A field that holds a callable, Callable[..., T]: a call of it takes for T's layer.
            if isinstance(annotation, ast.Subscript) and isinstance(annotation.slice, ast.Tuple):
                gives = self.annotated(self.index.of_module(owner), annotation.slice.elts[-1])
                rank = layer(gives or owner)
                return None if rank is None else (rank, f"{_short(owner)}.{func.attr}")
        holder = self.holder(func.value, scope)
        return None if holder is None else (holder[0], f"{holder[1]}.{func.attr}")

    def hand(self, taker: tuple[int, str] | None, what: ast.expr, scope: _Scope) -> None:
        if taker is None:
            return
        code = self.code(what, scope)
        if code is not None and code < taker[0]:  # the callable's layer is above the taker's
            self.found.add(Handed(self.path, taker[1], _written(what)))

    # -- the walk ------------------------------------------------------------------------

    def read(self) -> set[Handed]:
        self.walk(self.module.tree.body, _Scope(self.module, None))
        return self.found

    def walk(self, body: list[ast.stmt], scope: _Scope) -> None:
        for stmt in body:
            self.statement(stmt, scope)

    def statement(self, stmt: ast.stmt, scope: _Scope) -> None:
        if isinstance(stmt, ast.ClassDef):
            cls = f"{self.module.name}.{stmt.name}"
            for item in stmt.body:
                self.statement(item, _Scope(self.module, cls))
            return
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            inner = scope.child()
            for arg in [*stmt.args.posonlyargs, *stmt.args.args, *stmt.args.kwonlyargs]:
                inner.code.pop(arg.arg, None)
                if (found := self.annotated(self.module, arg.annotation)) is not None:
                    inner.types[arg.arg] = found
                if _is_callable(arg.annotation):
                    # A callable given from this layer or one above: passed on, it is handed.
                    inner.code[arg.arg] = layer(self.module.name) or 0
            self.walk(stmt.body, inner)
            if scope.in_function:  # a nested function: a callable of this module's
                scope.code[stmt.name] = layer(self.module.name) or 0
            return
        for node in self.expressions(stmt):
            self.expression(node, scope)
        if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            annotation = stmt.annotation if isinstance(stmt, ast.AnnAssign) else None
            for target in targets:
                self.bind(target, stmt.value, annotation, scope)
        for field in ("body", "orelse", "finalbody", "handlers"):
            for child in getattr(stmt, field, []):
                if isinstance(child, ast.ExceptHandler):
                    self.walk(child.body, scope)
                else:
                    self.statement(child, scope)

    def expressions(self, stmt: ast.stmt) -> Iterator[ast.AST]:
        """The expressions of ``stmt`` itself (not of the statements in its body)."""
        for field, value in ast.iter_fields(stmt):
            if field not in ("body", "orelse", "finalbody", "handlers"):
                yield from (
                    v
                    for v in (value if isinstance(value, list) else [value])
                    if isinstance(v, ast.AST)
                )

    def expression(self, node: ast.AST, scope: _Scope) -> None:
        if isinstance(node, ast.Lambda):
            scope = scope.child()
        if isinstance(node, ast.Call):
            func, args = node.func, [*node.args, *(k.value for k in node.keywords)]
            if ast.unparse(func) in ("functools.partial", "partial") and node.args:
                func, args = node.args[0], args[1:]  # partial(taker, ...) hands to the taker
            taker = self.taker(func, scope)
            for arg in args:
                self.hand(taker, arg.value if isinstance(arg, ast.Starred) else arg, scope)
        for child in ast.iter_child_nodes(node):
            self.expression(child, scope)

    def bind(
        self, target: ast.expr, value: ast.expr, annotation: ast.expr | None, scope: _Scope
    ) -> None:
        """``target = value``: a field or item of another's object set hands it ``value``; a
        name learns the class, the code, or the giver of its value."""
        if isinstance(target, ast.Attribute | ast.Subscript) and not _is_self(target.value):
            holder = self.holder(target.value, scope)
            item = f".{target.attr}" if isinstance(target, ast.Attribute) else "[]"
            if holder is not None:
                self.hand((holder[0], f"{holder[1]}{item}"), value, scope)
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Call):
            callee = self.ref(value.func, scope)  # a, b = f(): f's tuple[A, B]
            returns = self.returns(callee)
            if (
                callee
                and isinstance(returns, ast.Subscript)
                and isinstance(returns.slice, ast.Tuple)
            ):
                module = self.index.of_module(callee)
                for name, part in zip(target.elts, returns.slice.elts, strict=False):
                    if isinstance(name, ast.Name) and (found := self.annotated(module, part)):
                        scope.types[name.id] = found
        elif isinstance(target, ast.Name):
            name = target.id
            found = self.annotated(self.module, annotation) or self.type_of(value, scope)
            code = self.code(value, scope)
            taker = self.taker(value.func, scope) if isinstance(value, ast.Call) else None
            for known in (scope.types, scope.code, scope.given):
                known.pop(name, None)
            if found is not None:
                scope.types[name] = found
            elif taker is not None:  # an object of no layer's class, from a layer's call
                scope.given[name] = taker
            if code is not None:
                scope.code[name] = code


def handed_down(sources: dict[str, str]) -> set[Handed]:
    """The handed-down calls in ``sources`` (module name -> source, every module of
    ``batchwire`` the server's modules name), by its server's modules."""
    index = Index(sources)
    found: set[Handed] = set()
    for name, module in index.modules.items():
        if layer(name) is not None:
            path = "/".join(name.split(".")[2:]) + ".py"
            if index.is_package(name):
                path = path.removesuffix(".py") + "/__init__.py"
            found |= _Reader(index, module, path).read()
    return found


def read_package(package: pathlib.Path) -> dict[str, str]:
    """Every module of the package at ``package`` (``src/batchwire``), by name, but those
    protoc generates."""
    sources = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[1] == "v1":
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        sources[name] = path.read_text()
    return sources
