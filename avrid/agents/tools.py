"""Chapter 7 — tool calls: find one in a policy turn, run it, say what happened.

A tool call is text the policy wrote between two markers, at the end of its turn: the turn
stops at the closing marker (an `AgentTask.turn_stops` character), the environment runs
what is inside and hands back the result as the next observation.

    "[48*7]"  --parse_call-->  "48*7"  --calculator-->  ToolResult(ok, "336")

Two tools ship:

- `calculator`: integer arithmetic (+ - * // % ** and parentheses) evaluated from Python's
  syntax tree, never `eval`: it accepts nothing but numbers and those operators, with the
  size of every number bounded, so it runs in the caller's process (in microseconds: the
  chapter's laptop task calls it ~10**5 times);
- `python`: any code, run by `sandbox.run_python` in the run's sandbox (``tools.sandbox``):
  by default the kernel's namespaces, where the code sees a read-only Python runtime and
  nothing else of the host (not the task's data), has no network, writes only a private
  scratch directory, and every process it starts dies with the call, under rlimits (wall
  time, memory, processes, files). What each backend isolates: `sandbox/__init__.py`.

Both return a `sandbox.ToolResult`, whose `observation()` is what the policy reads.

Not here: the sandbox itself (`sandbox.py`), the episode loop (`episodes.py`).
"""

from __future__ import annotations

import ast
import operator
import time

from avrid.agents.sandbox import ToolLimits, ToolResult, run_python

MAX_DIGITS = 60
"""The calculator refuses any intermediate number longer than this (a ``9**9**9`` would
otherwise take the process's memory and minutes)."""

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def parse_call(text: str, *, open_mark: str = "[", close_mark: str = "]") -> str | None:
    """The tool call at the end of a turn's text: what lies between the last `open_mark`
    and a final `close_mark`; None if the turn does not end with a call.

    Example:
        >>> parse_call("let me see [48*7]"), parse_call("336"), parse_call("[]")
        ('48*7', None, '')
    """
    if not text.endswith(close_mark):
        return None
    start = text.rfind(open_mark, 0, len(text) - len(close_mark))
    if start < 0:
        return None
    return text[start + len(open_mark):len(text) - len(close_mark)]


def calculator(expression: str) -> ToolResult:
    """Evaluate integer arithmetic; a syntax error, a name, a float, a division by zero or a
    number past `MAX_DIGITS` digits is an "error" result saying which.

    Example:
        >>> calculator("48*7").observation(), calculator("2**").status
        ('336', 'error')
    """
    start = time.perf_counter()
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
        status, output = "ok", str(value)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        status, output = "error", f"{type(e).__name__}: {e}"
    return ToolResult(status=status, output=output, seconds=time.perf_counter() - start, pid=0)


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (right < 0 or right * max(1, abs(left)).bit_length()
                                             > MAX_DIGITS * 4):
            raise ValueError(f"power {left}**{right} out of range")
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not integer arithmetic: {ast.dump(node)[:60]}")


def _bounded(value: int) -> int:
    if len(str(abs(value))) > MAX_DIGITS:
        raise ValueError(f"a number longer than {MAX_DIGITS} digits")
    return value


def python(code: str, *, wall_s: float = 5.0, memory_mb: int = 512) -> ToolResult:
    """Run `code` in the current sandbox (`sandbox.run_python`: the run's ``tools.sandbox``,
    else the namespaces backend); its printed output is the result."""
    return run_python(code, ToolLimits(wall_s=wall_s, memory_mb=memory_mb))
