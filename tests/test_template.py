import pytest

from jobrunner.jobs.template import PromptTemplate, TemplateRowError, unescape


def test_substitution_and_columns():
    t = PromptTemplate("Q: {question}\nContext: {context}\nQ again: {question}")
    assert t.columns == ["question", "context"]
    assert t.render({"question": "why?", "context": "sky", "other": 1}) == \
        "Q: why?\nContext: sky\nQ again: why?"


def test_no_placeholders():
    t = PromptTemplate("plain text")
    assert t.columns == []
    assert t.render({}) == "plain text"


def test_escaped_braces_are_literal():
    t = PromptTemplate('Answer as JSON: {{"label": "{label}"}} }}{{')
    assert t.columns == ["label"]
    assert t.render({"label": "pos"}) == 'Answer as JSON: {"label": "pos"} }{'


def test_values_are_not_reinterpreted():
    # a value containing braces or placeholders is inserted verbatim, never re-parsed
    t = PromptTemplate("{a}-{b}")
    assert t.render({"a": "{b}", "b": "{{x}}"}) == "{b}-{{x}}"


def test_non_string_values():
    t = PromptTemplate("{i} {f} {b} {d} {l} {raw}")
    out = t.render({"i": 3, "f": 0.5, "b": True, "d": {"k": "é"}, "l": [1, "x"], "raw": b"bytes"})
    assert out == '3 0.5 True {"k": "é"} [1, "x"] bytes'


def test_column_names_with_spaces_and_unicode():
    t = PromptTemplate("{first name} {ключ}")
    assert t.columns == ["first name", "ключ"]
    assert t.render({"first name": "Ada", "ключ": "v"}) == "Ada v"


@pytest.mark.parametrize("text,what", [
    ("{a.b}", "attribute access"),
    ("{a.__class__.__mro__}", "attribute access"),
    ("{a[0]}", "indexing"),
    ("{a!r}", "conversions"),
    ("{a:>10}", "format specs"),
    ("{a:{b}}", "format specs"),
    ("{}", "empty placeholder"),
    ("{ }", "empty placeholder"),
    ("{a", "never closed"),
    ("a}", "single '}'"),
    ("{a}}", "single '}'"),
])
def test_rejected_templates(text, what):
    with pytest.raises(ValueError, match="template") as e:
        PromptTemplate(text)
    assert what in str(e.value)


def test_missing_and_null_values_are_row_errors():
    t = PromptTemplate("{a} {b}")
    with pytest.raises(TemplateRowError) as e:
        t.render({"a": 1})
    assert e.value.column == "b" and "missing" in str(e.value)
    assert isinstance(e.value, KeyError)
    with pytest.raises(TemplateRowError, match="'a' is null"):
        t.render({"a": None, "b": 1})
    # empty strings are values, not missing
    assert t.render({"a": "", "b": ""}) == " "


def test_missing_columns_check():
    t = PromptTemplate("{a} {b} {c}")
    assert t.missing_columns(["a", "c", "z"]) == ["b"]
    assert t.missing_columns(["a", "b", "c"]) == []


def test_backslash_escapes_mean_the_same_from_the_command_line_and_toml():
    # the shell passes backslash-n as typed; a TOML basic string has already made it a newline
    typed, toml = PromptTemplate(r"Review: {text}\nSentiment:"), PromptTemplate("Review: {text}\nSentiment:")
    assert typed.render({"text": "ok"}) == toml.render({"text": "ok"}) == "Review: ok\nSentiment:"
    assert PromptTemplate(r"a\tb{x}\\n").render({"x": 1}) == "a\tb1\\n"     # \\ is one backslash, then n
    assert PromptTemplate(r"C:\data {x}").render({"x": 2}) == r"C:\data 2"  # other backslashes stay
    assert PromptTemplate(r"{{\n}}").render({}) == "{\n}"


def test_escapes_apply_to_the_template_not_to_values():
    assert PromptTemplate(r"{a}\n").render({"a": r"x\ny"}) == "x\\ny\n"


def test_unescape_for_the_system_prompt():
    assert unescape(r"Be brief.\nAnswer:\t\\n \d") == "Be brief.\nAnswer:\t\\n \\d"
    assert unescape("already\na newline") == "already\na newline"
