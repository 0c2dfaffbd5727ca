"""What the code says about itself: the comments on a class's fields and on a module's
named types (read with ``tokenize`` and ``ast``), the rules a ``__post_init__`` enforces,
docstrings as Markdown."""

from __future__ import annotations

import ast
import functools
import inspect
import io
import re
import sys
import tokenize
from dataclasses import dataclass

# tool directives, and a section's title (``# -- the loop``): not documentation
_MARKERS = ("fmt:", "noqa", "type:", "pragma", "-- ")


@dataclass(frozen=True)
class Module:
    tree: ast.Module
    comments: dict[int, str]  # line -> the comment's text
    code_lines: frozenset[int]  # lines with code on them

    def above(self, line: int) -> list[str]:
        """The comment lines right above ``line`` (no blank line or code between)."""
        out: list[str] = []
        line -= 1
        while line in self.comments and line not in self.code_lines:
            out.insert(0, self.comments[line])
            line -= 1
        return out

    def trailing(self, first: int, last: int) -> list[str]:
        """Comments at the end of the code lines ``first``..``last``."""
        lines = range(first, last + 1)
        return [self.comments[n] for n in lines if n in self.comments and n in self.code_lines]

    def documentation(self, node: ast.stmt) -> str:
        return " ".join(self.above(node.lineno) + self.trailing(node.lineno, node.end_lineno))


@functools.cache
def module(name: str) -> Module:
    text = inspect.getsource(sys.modules[name])
    comments: dict[int, str] = {}
    code: set[int] = set()
    skip = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            body = tok.string.lstrip("#").strip()
            if body and not body.startswith(_MARKERS):
                comments[tok.start[0]] = body
        elif tok.type not in skip:
            code.update(range(tok.start[0], tok.end[0] + 1))
    return Module(ast.parse(text), comments, frozenset(code))


def _class_node(cls: type) -> ast.ClassDef:
    for node in module(cls.__module__).tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node
    raise LookupError(f"no class {cls.__name__} at the top of {cls.__module__}")


def field_comments(cls: type) -> dict[str, str]:
    """Each annotated field of ``cls`` -> its comment (on its lines or right above)."""
    mod = module(cls.__module__)
    return {
        node.target.id: mod.documentation(node)
        for node in _class_node(cls).body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def field_annotation_names(cls: type) -> dict[str, set[str]]:
    """Each annotated field of ``cls`` -> the names its annotation mentions."""
    return {
        node.target.id: {n.id for n in ast.walk(node.annotation) if isinstance(n, ast.Name)}
        for node in _class_node(cls).body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def named_types(module_name: str) -> dict[str, str]:
    """A module's top-level ``Name = ...`` with a comment right above: name -> comment."""
    mod = module(module_name)
    out = {}
    for node in mod.tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and (text := mod.documentation(node)):
                out[target.id] = text
    return out


def rules(cls: type) -> list[str]:
    """The messages of the ``ValueError``s its ``__post_init__`` raises: the checks a
    value must pass beyond its fields' types."""
    for node in _class_node(cls).body:
        if isinstance(node, ast.FunctionDef) and node.name == "__post_init__":
            return [
                call.args[0].value
                for call in (n.exc for n in ast.walk(node) if isinstance(n, ast.Raise))
                if isinstance(call, ast.Call) and call.args
                if isinstance(call.args[0], ast.Constant)
            ]
    return []


def own_doc(obj: object) -> str:
    """The object's own docstring (never a base class's), as Markdown."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return markdown(inspect.cleandoc(doc)) if doc else ""


def markdown(rst: str) -> str:
    """A docstring's reStructuredText as Markdown: ``x`` -> `x`; a ``::`` at a line's end
    opens the indented block below it (which Markdown shows as code)."""
    text = rst.replace("``", "`")
    text = re.sub(r"(\S)::$", r"\1:", text, flags=re.MULTILINE).replace("\n::\n", "\n")
    return escape(text)


def escape(text: str) -> str:
    """``<`` as ``&lt;`` in prose (a ``<state_dir>`` is no HTML tag), never in code: a
    backtick span, a fenced block or an indented line."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith("    "):
            parts = re.split(r"(`[^`]*`)", line)
            line = "".join(p if p.startswith("`") else p.replace("<", "&lt;") for p in parts)
        out.append(line)
    return "\n".join(out)


def cell(text: str) -> str:
    """Text for a Markdown table cell."""
    return escape(text.replace("\n", " ")).replace("|", "\\|")
