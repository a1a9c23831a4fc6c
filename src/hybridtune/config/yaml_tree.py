"""A config's YAML text as values and as its node tree (lines; values as written), checked before any value is built:
aliases that expand past MAX_CONFIG_VALUES or hold themselves, a key given twice; scalars no type can build taken as
text (`load_yaml`)."""

from __future__ import annotations

from typing import Any

import yaml

from hybridtune.config.keys import together
from hybridtune.errors import ConfigError


def load_yaml(text: str, where: str) -> tuple[Any, yaml.Node | None]:
    """YAML text as Python values, and its node tree (lines; values as written). Aliases that expand past
    MAX_CONFIG_VALUES values, or hold themselves, are refused before any value is built; a YAMLError passes."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        expanded(node, where, {}, set())
        twice = duplicate_keys(node, where, set())
        if twice:
            raise together(twice)
        try:
            return loader.construct_document(node), node
        except ValueError:  # a scalar its type cannot build, such as the date of a 13th month: taken as its text
            as_text(node)
            return yaml.SafeLoader("").construct_document(node), node
    except RecursionError:
        raise ConfigError(f"{where}: the YAML is nested too deeply; write a flat mapping of config keys") from None
    finally:
        loader.dispose()


def as_text(node: yaml.Node) -> None:
    """Retag as text each scalar that YAML resolves to a type and then cannot build (a date of a 13th month, an int of
    more than 4,300 digits), which escaped as a bare ValueError: a text key takes it as written, any other key's type
    names it with its key and line."""
    loader, stack = yaml.SafeLoader(""), [node]
    while stack:  # (aliases are already bounded by load_yaml's count)
        n = stack.pop()
        if isinstance(n, yaml.SequenceNode):
            stack += n.value
        elif isinstance(n, yaml.MappingNode):
            stack += [x for pair in n.value for x in pair]
        else:
            try:
                loader.construct_object(n)
            except ValueError:
                n.tag = "tag:yaml.org,2002:str"
    loader.dispose()


# A YAML alias (*name) repeats the value its anchor (&name) marks; nested, a few hundred bytes expand to billions of
# values. A real config holds a few hundred, so one that expands past this many (each alias counted at each use) is
# refused before its values are built or shown.
MAX_CONFIG_VALUES = 100_000


def duplicate_keys(node: yaml.Node, where: str, seen: set[int]) -> list[ConfigError]:
    """A key given twice in one mapping, anywhere in `node` (YAML would keep the last value without a word): one
    problem for each, naming the key and both lines. A merge key (`<<: *base`) is YAML's own and may repeat."""
    if id(node) in seen:
        return []
    seen.add(id(node))
    out: list[ConfigError] = []
    kids = list(node.value) if isinstance(node, yaml.SequenceNode) else []
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key, value in node.value:
            kids.append(value)
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            line = key.start_mark.line + 1
            if key.value in first:
                at = "command line" if where == "command line" else f"{where}:{line}"
                lines = "" if where == "command line" else f" (lines {first[key.value]} and {line})"
                out.append(ConfigError(f"{at}: key '{key.value}' given twice{lines}; keep one (YAML keeps the last)"))
            else:
                first[key.value] = line
    for kid in kids:
        out += duplicate_keys(kid, where, seen)
    return out


def expanded(node: yaml.Node, where: str, sizes: dict[int, int], open_: set[int]) -> int:
    """How many values `node` stands for with every alias written out (each shared node counted once, by id)."""
    if id(node) in sizes:
        return sizes[id(node)]
    line = where if where == "command line" else f"{where}:{node.start_mark.line + 1}"
    if id(node) in open_:
        raise ConfigError(f"{line}: a YAML alias (*name) inside the value its anchor marks (a loop); write it out")
    open_.add(id(node))
    kids = node.value if isinstance(node, yaml.SequenceNode) else ()
    if isinstance(node, yaml.MappingNode):
        kids = [n for pair in node.value for n in pair]
    sizes[id(node)] = total = 1 + sum(expanded(k, where, sizes, open_) for k in kids)
    open_.discard(id(node))
    if total > MAX_CONFIG_VALUES:
        raise ConfigError(
            f"{line}: the YAML's aliases (*name) expand to more than {MAX_CONFIG_VALUES:,} values; a config "
            "needs far fewer: write the values out"
        )
    return total
