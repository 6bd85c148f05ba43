"""The settings file's keys as a JSON Schema, for the Helm chart's `proxy.config`.

`helm install` then refuses a mistyped key (`owner.stratgy`) before anything is deployed,
rather than a pod refusing to start. Only the keys are checked, at every level of the tree: a
value's type, range and form stay the proxy's to check at start-up (a duration may be `5` or
`"5s"`, a block may be given in a shorter form), so a file the proxy takes is not refused by
the chart, with one exception: the keys must be written as the settings name them, in lower
case (the proxy also takes the top level's in another case, `Listen:`). The `properties` and
`additionalProperties` keywords constrain objects alone: where a setting is also given as a
string or a list, those pass unchecked.

    scripts/chart-schema           # writes it into helm/idemproxy/values.schema.json
"""

from __future__ import annotations

import json
from typing import Any

from idemproxy.config.settings import Settings

JsonSchema = dict[str, Any]

# Where the chart's schema keeps the tree (its `definitions`, JSON Schema draft 7).
ROOT = "settings"
# Keys the proxy still reads, with a warning, though the settings no longer name them, and
# the block each is read as.
_RENAMED = {"redis_options": "RedisSettings"}


def keys_schema() -> dict[str, JsonSchema]:
    """The chart schema's definitions for the settings: `settings` (the file's top level)
    and one per block (`settings.RouteSettings`, …)."""
    full = Settings.model_json_schema(mode="validation")
    models: dict[str, JsonSchema] = full.get("$defs", {})
    definitions: dict[str, JsonSchema] = {}

    def block(name: str) -> JsonSchema:
        definition = f"{ROOT}.{name}"
        if definition not in definitions:
            definitions[definition] = {}  # a model that holds itself: referred to, once
            definitions[definition] = keys(models[name])
        return {"$ref": f"#/definitions/{definition}"}

    def value(node: JsonSchema) -> JsonSchema:
        """What an object given for this value may hold ({}: anything)."""
        if "$ref" in node:
            return block(str(node["$ref"]).rsplit("/", 1)[-1])
        for variants in ("anyOf", "oneOf"):
            if variants in node:
                checked = [value(variant) for variant in node[variants]]
                found = [variant for variant in checked if variant]
                # A model or nothing (`Optional[Model]`): objects are the model's.
                return found[0] if len(found) == 1 and len(checked) == 2 else {}
        if node.get("type") == "array" and isinstance(node.get("items"), dict):
            items = value(node["items"])
            return {"items": items} if items else {}
        if "properties" in node:
            return keys(node)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            each = value(extra)
            return {"additionalProperties": each} if each else {}
        return {}

    def keys(model: JsonSchema) -> JsonSchema:
        properties = {name: value(node) for name, node in model.get("properties", {}).items()}
        return {"properties": properties, "additionalProperties": False}

    root = keys(full)
    root["properties"].update({name: block(model) for name, model in _RENAMED.items()})
    definitions[ROOT] = root
    return dict(sorted(definitions.items()))


def chart_schema(schema: JsonSchema) -> str:
    """The chart's values schema with the settings' keys (`keys_schema`) in its definitions,
    in place of those it held, as the file's text."""
    definitions = {
        name: node
        for name, node in schema["definitions"].items()
        if name != ROOT and not name.startswith(f"{ROOT}.")
    }
    return _laid_out({**schema, "definitions": definitions | keys_schema()}) + "\n"


_WIDTH = 120


def _laid_out(node: Any, indent: int = 0, before: int = 0) -> str:
    """JSON with a value on one line where it fits in `_WIDTH` columns (`before`: what the
    line holds ahead of it), and one member or item per line where it does not."""
    one_line = json.dumps(node, ensure_ascii=False, separators=(", ", ": "))
    if not isinstance(node, dict | list) or not node or before + len(one_line) < _WIDTH:
        return one_line
    inner = " " * (indent + 2)
    if isinstance(node, dict):
        lines = []
        for name, member in node.items():
            label = f"{json.dumps(name, ensure_ascii=False)}: "
            lines.append(f"{inner}{label}{_laid_out(member, indent + 2, len(inner + label))}")
        opening, closing = "{", "}"
    else:
        lines = [f"{inner}{_laid_out(item, indent + 2, len(inner))}" for item in node]
        opening, closing = "[", "]"
    return f"{opening}\n" + ",\n".join(lines) + f"\n{' ' * indent}{closing}"
