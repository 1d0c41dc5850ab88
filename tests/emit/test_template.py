"""CodeTemplate and compose: block expansion at the placeholder's column, and strictness about names."""
from __future__ import annotations

import pytest

from flashgen.emit.template import CodeTemplate, compose


def test_a_block_takes_the_placeholders_column():
    t = CodeTemplate("f() {\n    $body\n}")
    assert t.substitute(body=["a;", "", "if (x) {", "    b;", "}"]) == "f() {\n    a;\n\n    if (x) {\n        b;\n    }\n}"


def test_compose_nests_parts_and_equals_one_template():
    whole = CodeTemplate("int $name() {\n    if ($c) {\n        $body\n    }\n}\n")
    inner = CodeTemplate("if ($c) {\n    $body\n}")
    outer = CodeTemplate("int $name() {\n    $inner_code\n}\n")
    env = {"name": "f", "c": "x > 0", "body": ["y = 1;", "z = 2;"]}
    assert compose([("inner_code", inner), ("f", outer)], env) == whole.substitute(**env)


def test_compose_refuses_names_nothing_uses_or_gives():
    part, root = CodeTemplate("$a"), CodeTemplate("$part_code $b")
    with pytest.raises(KeyError, match="unused: \\['c'\\]"):
        compose([("part_code", part), ("root", root)], {"a": "1", "b": "2", "c": "3"})
    with pytest.raises(KeyError, match="'root' names missing: \\['b'\\]"):
        compose([("part_code", part), ("root", root)], {"a": "1"})
