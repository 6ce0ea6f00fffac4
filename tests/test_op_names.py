"""Code outside the op table names an op as `Op.<name>` (ir/ops.py), never as a bare string.

mypy checks every `Op.<name>` against the op table's names (a misspelled or removed op fails
`make lint`); a bare "matmul" compared with an op's name is checked by nobody. Checked on the
source: every comparison whose one side is an op's name (`op.op_name`, a `name` or `op`
variable) and whose other side is a string literal naming an op (or a tuple, list or set of
them). The op table's own module is where the names are defined.
"""

import ast
import re
from pathlib import Path

from tilegraph.ir.ops import OPS, Op

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("ir", "passes", "backends", "frontends", "tilegraph")
NAMES_AN_OP = re.compile(r"op_name|\bname\b|\bop\b")
NAMES_SOMETHING_ELSE = re.compile(r"\.attr\(|kind|layout\(|mode|approximate|category")


def bare_op_names(source: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        literals = [s for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
        literals += [e for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set))
                     for e in s.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        others = [ast.get_source_segment(source, s) or "" for s in sides
                  if not isinstance(s, (ast.Constant, ast.Tuple, ast.List, ast.Set))]
        if any(c.value in OPS for c in literals) and any(NAMES_AN_OP.search(t) for t in others) \
                and not any(NAMES_SOMETHING_ELSE.search(t) for t in others):
            found.append((node.lineno, ast.get_source_segment(source, node) or ""))
    return found


def test_no_op_name_is_compared_as_a_bare_string():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {text}"
                 for package in LIBRARY for path in sorted((ROOT / package).rglob("*.py"))
                 if path != ROOT / "ir" / "ops.py"
                 for line, text in bare_op_names(path.read_text())]
    assert not offenders, "compare op names with Op.<name>:\n" + "\n".join(offenders)


def test_the_names_are_the_op_tables_and_equal_its_strings():
    assert set(Op) == set(OPS)
    assert Op.matmul == "matmul" and "matmul" in {Op.matmul} and f"{Op['not']}" == "not"


def test_the_check_finds_a_bare_name():
    assert bare_op_names('if op.op_name in ("matmul", "conv"):\n    pass\n')
    assert not bare_op_names('if op.op_name in (Op.matmul, Op.conv):\n    pass\n')
    assert not bare_op_names('if op.attr("mode") == "constant":\n    pass\n')
