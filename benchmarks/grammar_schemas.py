"""JSON schemas of the size of extraction tasks, shared by the grammar benchmarks."""
from __future__ import annotations

_ADDRESS = {"type": "object", "properties": {
    "street": {"type": "string"}, "city": {"type": "string"}, "country": {"type": "string"},
    "postcode": {"type": "string", "pattern": "^[A-Z0-9 ]{3,10}$"}},
    "required": ["street", "city", "country"], "additionalProperties": False}

EXTRACTION_SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"}, "employed": {"type": "boolean"}, "address": _ADDRESS,
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
        "role": {"enum": ["engineer", "scientist", "artist", "other"]}},
        "required": ["name", "age", "email", "employed", "address", "skills", "role"],
        "additionalProperties": False},
    "invoice": {"type": "object", "properties": {
        "invoice_number": {"type": "string"}, "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "vendor": {"type": "object", "properties": {"name": {"type": "string"}, "address": _ADDRESS},
                   "required": ["name"], "additionalProperties": False},
        "currency": {"enum": ["USD", "EUR", "GBP"]},
        "lines": {"type": "array", "items": {"type": "object", "properties": {
            "description": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
            "unit_price": {"type": "number"}}, "required": ["description", "quantity", "unit_price"],
            "additionalProperties": False}},
        "total": {"type": "number"}},
        "required": ["invoice_number", "date", "vendor", "currency", "lines", "total"],
        "additionalProperties": False},
    "review": {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "topics": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string", "maxLength": 200}},
        "required": ["sentiment", "rating", "topics", "summary"], "additionalProperties": False},
}
