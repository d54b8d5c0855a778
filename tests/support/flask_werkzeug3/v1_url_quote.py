"""v1: quote url_for's anchor with the standard library, as Flask 2.2.4 does.

Werkzeug 3.0.0 removed werkzeug.urls.url_quote (deprecated in 2.3), so `import flask` fails on
Flask 2.2.0-2.2.3, whose flask/app.py imports it: https://github.com/pallets/werkzeug/issues/2789.
Flask 2.2.4 quotes the anchor with urllib.parse.quote and the same safe characters.
"""

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Fact, Patch

from .targets import APP, FLASK_2_2_UNTIL_FIXED, WERKZEUG_3

WERKZEUG_IMPORT = m.SimpleStatementLine(
    body=[
        m.ImportFrom(
            module=m.Attribute(value=m.Name("werkzeug"), attr=m.Name("urls")),
            names=[m.ImportAlias(name=m.Name("url_quote"), asname=None)],
        )
    ]
)
STDLIB_IMPORT = "from urllib.parse import quote as _url_quote\n"
# rv = f"{rv}#{url_quote(_anchor)}"
ANCHOR_LINE = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name("rv"))],
            value=m.FormattedString(
                parts=[
                    m.FormattedStringExpression(expression=m.Name("rv")),
                    m.FormattedStringText(value="#"),
                    m.FormattedStringExpression(
                        expression=m.Call(func=m.Name("url_quote"), args=[m.Arg(value=m.Name("_anchor"))])
                    ),
                ]
            ),
        )
    ]
)
QUOTED_ANCHOR = """_anchor = _url_quote(_anchor, safe="%!#$&'()*+,/:;=?@")\n"""
PATCHED_ANCHOR = m.SimpleStatementLine(
    body=[m.Assign(targets=[m.AssignTarget(target=m.Name("_anchor"))], value=m.Call(func=m.Name("_url_quote")))]
)


class UrlQuoteFromStandardLibrary(PatchCodemod):
    """`from werkzeug.urls import url_quote` -> `from urllib.parse import quote as _url_quote`."""

    ANCHOR = "a statement `from werkzeug.urls import url_quote`"

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        if m.matches(updated, WERKZEUG_IMPORT):
            self.rewrote()
            replacement = cst.parse_statement(STDLIB_IMPORT)
            assert isinstance(replacement, cst.SimpleStatementLine)
            return replacement.with_changes(leading_lines=updated.leading_lines)
        if m.matches(updated, m.SimpleStatementLine(body=[m.ImportFrom()])) and (
            cst.Module(body=[]).code_for_node(updated.with_changes(leading_lines=())) == STDLIB_IMPORT
        ):
            self.found_patched()
        return updated


class AnchorQuotedSafely(PatchCodemod):
    """`rv = f"{rv}#{url_quote(_anchor)}"` -> the anchor quoted first, with Flask 2.2.4's safe characters."""

    ANCHOR = 'a statement rv = f"{rv}#{url_quote(_anchor)}"'

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.FlattenSentinel[cst.SimpleStatementLine]:
        if m.matches(updated, PATCHED_ANCHOR):
            self.found_patched()
            return updated
        if not m.matches(updated, ANCHOR_LINE):
            return updated
        self.rewrote()
        quoted = cst.parse_statement(QUOTED_ANCHOR)
        joined = cst.parse_statement('rv = f"{rv}#{_anchor}"\n')
        assert isinstance(quoted, cst.SimpleStatementLine) and isinstance(joined, cst.SimpleStatementLine)
        return cst.FlattenSentinel([quoted.with_changes(leading_lines=updated.leading_lines), joined])


BEFORE = """
    from werkzeug.routing import RequestRedirect
    from werkzeug.urls import url_quote
    from werkzeug.wrappers import Response as BaseResponse


    class Flask:
        def url_for(self, endpoint, *, _anchor=None):
            rv = self.build(endpoint)

            if _anchor is not None:
                rv = f"{rv}#{url_quote(_anchor)}"

            return rv
"""

AFTER = """
    from werkzeug.routing import RequestRedirect
    from urllib.parse import quote as _url_quote
    from werkzeug.wrappers import Response as BaseResponse


    class Flask:
        def url_for(self, endpoint, *, _anchor=None):
            rv = self.build(endpoint)

            if _anchor is not None:
                _anchor = _url_quote(_anchor, safe="%!#$&'()*+,/:;=?@")
                rv = f"{rv}#{_anchor}"

            return rv
"""

PATCH = Patch(
    id="v1-url-quote",
    title="quote url_for's anchor with urllib.parse.quote (werkzeug.urls.url_quote is gone)",
    target=APP,
    requires=FLASK_2_2_UNTIL_FIXED,
    edits=(
        Edit(
            UrlQuoteFromStandardLibrary,
            when=WERKZEUG_3,
            answers="werkzeug.urls does not define url_quote",
            fact=Fact("lacks", "werkzeug.urls", name="url_quote", distribution="werkzeug"),
        ),
        Edit(
            AnchorQuotedSafely,
            when=WERKZEUG_3,
            answers="werkzeug.urls does not define url_quote",
            fact=Fact("lacks", "werkzeug.urls", name="url_quote", distribution="werkzeug"),
        ),
    ),
    examples=(Example(before=BEFORE, after=AFTER),),
    satisfied=(AFTER,),
    near_misses=(
        # another helper of werkzeug.urls (still there in 3.0) is left alone
        """
            from werkzeug.urls import iri_to_uri


            class Flask:
                def url_for(self, endpoint, *, _anchor=None):
                    return iri_to_uri(self.build(endpoint))
        """,
    ),
    upstream="Werkzeug 3.0.0 removed werkzeug.urls.url_quote: https://github.com/pallets/werkzeug/issues/2789; "
    "Flask 2.2.4 flask/app.py quotes with urllib.parse.quote",
    fixed_in="flask 2.2.4",
    without_it="without it on Werkzeug 3: `ImportError: cannot import name 'url_quote' from 'werkzeug.urls'` at `import flask`",
    on_fixed_in="anchor-missing",
)
