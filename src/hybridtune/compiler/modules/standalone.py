"""Source-level generation of standalone per-class forwards, from the AST of the modeling file.

For a class `C` the generated module holds `C_forward` (the class's own `def forward`, found by `resolve_method`,
renamed, with its own decorators and, outermost, the plan's decoration: `torch.compile(...)` or
`torch.compiler.disable(recursive=False)`) and `C_standalone.forward` (the real signature, calling `C_forward`;
`strategies.py` binds it to the module instances of one model). Every global name the code reads is imported from
the class's own module; a name the module does not define is refused at generation time. The text is compiled in
memory under a pseudo file name registered in `linecache`; after loading (`loader.py`) each function is checked
against the original: same bytecode for the body, same decorator wrappers in the same order.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import linecache
import symtable
import sys
import types

from hybridtune.compiler.modules.decoration import (
    TORCH_ALIAS,
    ChainMismatch,
    Decoration,
    GenerationError,
    NotGeneratable,
)
from hybridtune.compiler.modules.loader import ClassSection, GeneratedModule
from hybridtune.compiler.modules.plan import plan_class
from hybridtune.compiler.modules.source import MethodSource, method_source

NAME_ALIAS = "_hybridtune_method_of"


def method_of(qualname: str):
    """Decorator used by generated code: give the function its method's `__qualname__`.

    Applied innermost, before the real decorators run, because some of them read the qualified
    name (transformers' `auto_docstring` tells methods from classes by the dot in it). Returns the
    same function, so it adds no wrapper layer.
    """

    def set_name(func):
        func.__qualname__ = qualname
        return func

    return set_name


# ---------------------------------------------------------------------------------------------
# Building the text


def _class_cell_edits(node: ast.FunctionDef, class_name: str, self_name: str) -> list[tuple[ast.AST, str]]:
    """Spans to replace so the body needs no `__class__` cell: a module-level function has none.

    `super()` becomes `super(Class, self)` and a bare `__class__` becomes `Class`.
    """
    edits: list[tuple[ast.AST, str]] = []
    for n in (sub for stmt in node.body for sub in ast.walk(stmt)):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "super":
            if not n.args and not n.keywords:
                edits.append((n, f"super({class_name}, {self_name})"))
        elif isinstance(n, ast.Name) and n.id == "__class__":
            edits.append((n, class_name))
    return edits


def _body_text(ms: MethodSource, edits: list[tuple[ast.AST, str]]) -> str | None:
    """The body of the def exactly as written (comments and line layout kept), with `edits` applied.

    Kept at its original indentation: Python only needs a block to be consistent, and moving no
    line means multi-line strings stay byte for byte and the compiler lays the code out as it did
    for the original (its line-number NOPs and jump threading follow the lines). None when the body
    does not start on a line of its own.
    """
    node = ms.node
    first, last = node.body[0].lineno, node.end_lineno or node.body[-1].lineno
    if first <= node.lineno:
        return None
    source_lines = linecache.getlines(ms.filename)
    # Comment lines right above the first statement belong to the body as written.
    start = first
    while start - 1 > node.lineno and source_lines[start - 2].strip().startswith("#"):
        start -= 1
    lines = [ln.encode() for ln in source_lines[start - 1 : last]]
    first = start
    # AST columns are UTF-8 byte offsets; apply from the last span backwards so earlier ones stay put.
    for target, text in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
        if target.lineno != target.end_lineno:
            raise NotGeneratable("super() spans several lines")
        k = target.lineno - first
        ln = lines[k]
        lines[k] = ln[: target.col_offset] + text.encode() + ln[target.end_col_offset :]
    body = b"".join(lines).decode()
    return body if body.endswith("\n") else body + "\n"


def _private_names(node: ast.AST) -> list[str]:
    # Inside a class body `self.__x` is mangled to `self._C__x`; at module level it would not be.
    out = set()
    for n in ast.walk(node):
        ident = (
            n.attr
            if isinstance(n, ast.Attribute)
            else n.id
            if isinstance(n, ast.Name)
            else n.arg
            if isinstance(n, ast.arg)
            else None
        )
        if ident and ident.startswith("__") and not ident.endswith("__"):
            out.add(ident)
    return sorted(out)


def _call_forwarding(args: ast.arguments) -> tuple[list[ast.expr], list[ast.keyword]]:
    """Arguments that pass every parameter of `args` on unchanged (by position where it must)."""
    pos: list[ast.expr] = []
    kws: list[ast.keyword] = []
    positional = args.posonlyargs + args.args
    for i, a in enumerate(positional):
        # self and positional-only parameters go by position; so does everything before a *args.
        if i == 0 or i < len(args.posonlyargs) or args.vararg is not None:
            pos.append(ast.Name(a.arg, ast.Load()))
        else:
            kws.append(ast.keyword(a.arg, ast.Name(a.arg, ast.Load())))
    if args.vararg is not None:
        pos.append(ast.Starred(ast.Name(args.vararg.arg, ast.Load()), ast.Load()))
    for a in args.kwonlyargs:
        kws.append(ast.keyword(a.arg, ast.Name(a.arg, ast.Load())))
    if args.kwarg is not None:
        kws.append(ast.keyword(None, ast.Name(args.kwarg.arg, ast.Load())))
    return pos, kws


def function_name(cls: type, name: str = "forward") -> str:
    return f"{cls.__name__}_{name}"


def holder_name(cls: type) -> str:
    return f"{cls.__name__}_standalone"


def build_section(cls: type, decoration: Decoration, name: str = "forward") -> ClassSection:
    """The text of `C_forward` and `C_standalone` for one class; raises NotGeneratable.

    The `def` line and decorators are built as AST and unparsed; the body is the original text,
    taken by the AST's positions (see `_body_text`).
    """
    ms = method_source(cls, name)
    node = ms.node
    for n in ast.walk(node):
        if isinstance(n, ast.Global | ast.Nonlocal):
            raise NotGeneratable(
                f"{name} declares global/nonlocal names; moved to another module it would bind elsewhere"
            )
    private = _private_names(node)
    if private:
        raise NotGeneratable(f"{name} uses class-private names {private} (name mangling)")
    params = node.args.posonlyargs + node.args.args
    if not params:
        raise NotGeneratable(f"{name} has no positional self parameter")
    edits = _class_cell_edits(node, cls.__name__, params[0].arg)
    if edits and getattr(ms.module, cls.__name__, None) is not cls:
        raise NotGeneratable(f"{name} uses super() and {cls.__name__} is not a top-level name of its module")
    body = _body_text(ms, edits)
    if body is None:
        raise NotGeneratable(f"{name} has its body on the def line")
    real_decorators = [ast.unparse(d) for d in node.decorator_list]
    fname = function_name(cls, name)
    # The original nodes are shared, not copied: unparse reads them and they already have locations.
    decorators = list(node.decorator_list)
    if decorators:
        qual = f"{cls.__qualname__}.{name}"
        decorators.append(ast.parse(f"{NAME_ALIAS}({qual!r})", mode="eval").body)
    deco_src = decoration.source()
    if deco_src is not None:
        decorators.insert(0, ast.parse(deco_src, mode="eval").body)
    type_params = {"type_params": []} if sys.version_info >= (3, 12) else {}
    header = ast.FunctionDef(
        name=fname,
        args=node.args,
        body=[ast.Expr(ast.Constant(...))],
        decorator_list=decorators,
        returns=node.returns,
        type_comment=None,
        **type_params,
    )
    header_text = ast.unparse(ast.fix_missing_locations(header)).rsplit("\n", 1)[0]
    wrapper_args = node.args
    pos, kws = _call_forwarding(wrapper_args)
    call = ast.Call(ast.Name(fname, ast.Load()), [ast.Name(params[0].arg, ast.Load()), *pos[1:]], kws)
    wrapper = ast.FunctionDef(
        name=name,
        args=wrapper_args,
        body=[ast.Return(call)],
        decorator_list=[],
        returns=node.returns,
        type_comment=None,
        **type_params,
    )
    holder = ast.ClassDef(
        name=holder_name(cls),
        bases=[],
        keywords=[],
        body=[
            ast.Expr(ast.Constant(f"Installed on {cls.__qualname__} instances: the real signature, calling {fname}.")),
            wrapper,
        ],
        decorator_list=[],
        **type_params,
    )
    text = header_text + "\n" + body + "\n\n" + ast.unparse(ast.fix_missing_locations(holder)) + "\n"
    return ClassSection(cls, fname, holder.name, decoration, text, bool(edits), real_decorators, ms)


def _strip_annotations(tree: ast.Module) -> ast.Module:
    for n in ast.walk(tree):
        if isinstance(n, ast.arg):
            n.annotation = None
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
            n.returns = None
        elif isinstance(n, ast.AnnAssign):
            n.annotation = ast.Constant(None)
    return tree


def global_refs(text: str, future_annotations: bool) -> set[str]:
    """Names read as globals anywhere in the code `text` and not bound at its module level."""
    if future_annotations:
        # Annotations are strings under `from __future__ import annotations`; never evaluated.
        text = ast.unparse(ast.fix_missing_locations(_strip_annotations(ast.parse(text))))
    top = symtable.symtable(text, "<generated>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    refs: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for s in table.get_symbols():
            if table.get_type() == "module":
                if s.is_referenced():
                    refs.add(s.get_name())
            elif s.is_global() and (s.is_referenced() or s.is_assigned()):
                refs.add(s.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return refs - bound


def _import_lines(module: types.ModuleType, names: set[str]) -> list[str]:
    plain: list[str] = []
    from_names: list[str] = []
    for n in sorted(names):
        value = module.__dict__[n]
        if isinstance(value, types.ModuleType) and sys.modules.get(value.__name__) is value:
            plain.append(f"import {value.__name__}" if n == value.__name__ else f"import {value.__name__} as {n}")
        else:
            from_names.append(n)
    lines = sorted(plain)
    if from_names:
        lines.append(f"from {module.__name__} import (")
        lines.extend(f"    {n}," for n in from_names)
        lines.append(")")
    return lines


def _source_version(module: types.ModuleType) -> str:
    top = sys.modules.get(module.__name__.split(".")[0])
    return getattr(top, "__version__", "") if top is not None else ""


def generate(
    source_module: types.ModuleType,
    decorations: dict[type, Decoration],
    name: str = "forward",
) -> GeneratedModule:
    """Generate the standalone module for the given classes of one modeling module.

    Classes that cannot be generated with certainty are listed in `skipped` with the reason; any
    other problem raises GenerationError naming the class.
    """
    sections: list[ClassSection] = []
    texts: dict[str, str] = {}
    skipped: dict[str, str] = {}
    future = False
    refs: set[str] = set()
    for cls, deco in decorations.items():
        if cls.__module__ != source_module.__name__:
            raise ValueError(f"{cls.__qualname__} is defined in {cls.__module__}, not in {source_module.__name__}")
        try:
            section = build_section(cls, deco, name)
            text = section.text
            own = {section.function_name, section.holder_name, TORCH_ALIAS, NAME_ALIAS}
            section_refs = global_refs(text, section.source.future_annotations) - own
            # Names the source module does not define either (kernels bound only when installed) stay
            # unbound: a path that reads one fails with the same NameError as the original would.
            section.unbound = sorted(
                r for r in section_refs if r not in source_module.__dict__ and not hasattr(builtins, r)
            )
        except NotGeneratable as e:
            skipped[cls.__qualname__] = str(e)
            continue
        future = future or section.source.future_annotations
        sections.append(section)
        texts[cls.__qualname__] = text
        refs |= section_refs

    defined = {s.function_name for s in sections} | {s.holder_name for s in sections}
    clash = sorted((defined | {TORCH_ALIAS, NAME_ALIAS}) & refs)
    if clash:
        raise GenerationError(f"generated names {clash} would shadow names the generated code reads")
    imports = {r for r in refs - defined if r in source_module.__dict__}
    refs -= {n for s in sections for n in s.unbound}
    uses_name_alias = any(s.decorators for s in sections)
    header = [
        f'"""Standalone forwards generated by hybridtune from {source_module.__name__}.',
        "",
        f"Source version: {_source_version(source_module) or 'unknown'}.",
        "Each <Class>_forward is that class's own forward with its own decorators; <Class>_standalone.forward",
        "keeps the real signature and calls it. Generated in memory on every run; this copy is for reading.",
        '"""',
        "",
    ]
    if future:
        header += ["from __future__ import annotations", ""]
    header += ["import torch as " + TORCH_ALIAS]
    if uses_name_alias:
        header += [f"from hybridtune.compiler.modules.standalone import method_of as {NAME_ALIAS}"]
    header += _import_lines(source_module, imports)
    chunks = ["\n".join(header)]
    for s in sections:
        comment = f"# {s.cls.__qualname__}: {s.decoration.kind}" + (
            f" ({s.decoration.reason})" if s.decoration.reason else ""
        )
        if s.unbound:
            comment += (
                f"\n# Not defined in {source_module.__name__} either (optional kernels), so left unbound here"
                f" too: {', '.join(s.unbound)}"
            )
        chunks.append(comment + "\n" + texts[s.cls.__qualname__].rstrip("\n"))
    text = "\n\n\n".join(chunks) + "\n"
    sha = hashlib.sha256(text.encode()).hexdigest()
    # A path-like pseudo name: never a real file, but shaped like one for code that splits paths.
    filename = f"<hybridtune-generated>/{source_module.__name__}/{sha[:12]}.py"
    try:
        code = compile(text, filename, "exec", dont_inherit=True)
    except SyntaxError as e:  # our unparse produced something Python rejects: a bug here
        raise GenerationError(f"generated text does not compile: {e}") from e
    allowed = {n for s in sections for n in s.unbound}
    undefined = sorted(n for n in global_refs(text, future) if not hasattr(builtins, n) and n not in allowed)
    if undefined:
        raise GenerationError(f"generated module names undefined {undefined}")
    gm = GeneratedModule(
        source_module.__name__, text, sha, filename, {s.cls.__qualname__: s for s in sections}, skipped
    )
    gm._code = code
    return gm


def standalone_source(cls: type, decoration: Decoration | None = None, name: str = "forward") -> str:
    """The generated module text for one class (the plan's decoration unless one is given).

    Raises NotGeneratable (with the reason) when the class is left alone.
    """
    if decoration is None:
        decoration = plan_class(cls).decoration()
    gm = generate_loaded(sys.modules[cls.__module__], {cls: decoration}) if name == "forward" else None
    if gm is None:
        gm = generate(sys.modules[cls.__module__], {cls: decoration}, name)
    if cls.__qualname__ in gm.skipped:
        raise NotGeneratable(gm.skipped[cls.__qualname__])
    return gm.text


def generate_loaded(source_module: types.ModuleType, decorations: dict[type, Decoration]) -> GeneratedModule:
    """`generate` then `load`, leaving alone (in `skipped`) the classes the loader's check rejects."""
    decorations = dict(decorations)
    skipped: dict[str, str] = {}
    while True:
        gm = generate(source_module, decorations)
        try:
            gm.load()
        except ChainMismatch as e:
            skipped.update(e.classes)
            decorations = {c: d for c, d in decorations.items() if c.__qualname__ not in e.classes}
            continue
        gm.skipped.update(skipped)
        return gm
