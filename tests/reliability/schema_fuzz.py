"""A small schema-driven generator: hypothesis strategies for request bodies from the JSON
schemas in the agent's OpenAPI document, valid and deliberately broken."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

_ANY = st.one_of(st.none(), st.booleans(), st.integers(-(2**65), 2**65), st.floats(), st.text(max_size=8),
                 st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


class SchemaStrategies:
    """Strategies over one OpenAPI document's ``components/schemas``."""

    def __init__(self, spec: dict[str, Any], overrides: dict[str, st.SearchStrategy[Any]] | None = None) -> None:
        self.schemas = spec["components"]["schemas"]
        self.overrides = overrides or {}  # property name -> strategy (e.g. model -> known names)

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self.schemas[schema["$ref"].rsplit("/", 1)[-1]]
        return schema

    def valid(self, schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
        s = self.resolve(schema)
        if "const" in s:
            return st.just(s["const"])
        if "enum" in s:
            return st.sampled_from(s["enum"])
        if "anyOf" in s:
            return st.one_of(*[self.valid(b, depth) for b in s["anyOf"]])
        t = s.get("type")
        if t == "null":
            return st.none()
        if t == "boolean":
            return st.booleans()
        if t == "integer":
            return st.integers(s.get("minimum", -(2**31)), min(s.get("maximum", 2**31), 2**40))
        if t == "number":
            lo = s.get("minimum", s.get("exclusiveMinimum", -1e6))
            return st.floats(lo, s.get("maximum", 1e6), exclude_min="exclusiveMinimum" in s, allow_nan=False)
        if t == "string":
            return st.text(min_size=s.get("minLength", 0), max_size=min(s.get("maxLength", 40), 40))
        if t == "array":
            hi = min(s.get("maxItems", 4), 4)
            return st.lists(self.valid(s.get("items", {}), depth + 1), min_size=min(s.get("minItems", 0), hi),
                            max_size=hi)
        if t == "object" and depth < 4:
            props = s.get("properties", {})
            req = set(s.get("required", []))
            fields = {k: self.overrides.get(k, self.valid(v, depth + 1)) for k, v in props.items()}
            return st.fixed_dictionaries({k: v for k, v in fields.items() if k in req},
                                         optional={k: v for k, v in fields.items() if k not in req})
        return _ANY

    def broken(self, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        """A valid body with one property replaced by anything, or an unknown key added."""
        props = self.resolve(schema).get("properties", {})

        @st.composite
        def mutate(draw: st.DrawFn) -> Any:
            body = dict(draw(self.valid(schema)))
            if draw(st.booleans()) and props:
                body[draw(st.sampled_from(sorted(props)))] = draw(_ANY)
            else:
                body[draw(st.text(min_size=1, max_size=12))] = draw(_ANY)
            return body

        return mutate()
