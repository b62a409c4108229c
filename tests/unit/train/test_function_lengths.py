"""train/ stays readable in pieces: no function over 80 lines, no method of a class (the Trainer's, an objective's)
at 60 or more, each counted from its ``def`` line to its last line."""

import ast

from tests.helpers.paths import REPO


def _functions(path):
    tree = ast.parse(path.read_text())
    methods = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1, id(node) in methods


def test_no_function_in_train_is_too_long():
    too_long = [f"{path.relative_to(REPO)}:{line} {name}: {n} lines"
                for path in sorted((REPO / "train").rglob("*.py"))
                for name, line, n, method in _functions(path) if n > 80 or (method and n >= 60)]
    assert not too_long, "split these (functions <= 80 lines, methods < 60):\n" + "\n".join(too_long)
