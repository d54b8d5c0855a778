"""v2: parse the test client's URLs with urllib.parse.urlsplit, as Flask 2.2.4 does.

Werkzeug 3.0.0 removed werkzeug.urls.url_parse, which flask/testing.py of Flask 2.2.0-2.2.3
imports: `app.test_client()` fails. Flask 2.2.4 calls urllib.parse.urlsplit, whose result has the
attributes the code reads (scheme, netloc, path, query).
"""

import libcst as cst

from patcher import shapes as m
from patcher.codemod import PatchCodemod
from patcher.model import Edit, Example, Fact, Patch

from .targets import FLASK_2_2_UNTIL_FIXED, TESTING, WERKZEUG_3

WERKZEUG_IMPORT = m.SimpleStatementLine(
    body=[
        m.ImportFrom(
            module=m.Attribute(value=m.Name("werkzeug"), attr=m.Name("urls")),
            names=[m.ImportAlias(name=m.Name("url_parse"), asname=None)],
        )
    ]
)
STDLIB_IMPORT = "from urllib.parse import urlsplit\n"


class UrlSplitImport(PatchCodemod):
    """`from werkzeug.urls import url_parse` -> `from urllib.parse import urlsplit`."""

    ANCHOR = "a statement `from werkzeug.urls import url_parse`"

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        if m.matches(updated, WERKZEUG_IMPORT):
            self.rewrote()
            replacement = cst.parse_statement(STDLIB_IMPORT)
            assert isinstance(replacement, cst.SimpleStatementLine)
            return replacement.with_changes(leading_lines=updated.leading_lines)
        if cst.Module(body=[]).code_for_node(updated.with_changes(leading_lines=())) == STDLIB_IMPORT:
            self.found_patched()
        return updated


class UrlSplitCall(PatchCodemod):
    """`url_parse(path)` -> `urlsplit(path)`."""

    ANCHOR = "a call url_parse(...)"

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if m.matches(updated, m.Call(func=m.Name("url_parse"))):
            self.rewrote()
            return updated.with_changes(func=cst.Name("urlsplit"))
        if m.matches(updated, m.Call(func=m.Name("urlsplit"))):
            self.found_patched()
        return updated


BEFORE = """
    import werkzeug.test
    from werkzeug.urls import url_parse


    class EnvironBuilder(werkzeug.test.EnvironBuilder):
        def __init__(self, app, path="/", base_url=None, url_scheme=None):
            if base_url is None:
                url = url_parse(path)
                base_url = f"{url.scheme or url_scheme}://{url.netloc}"
"""

AFTER = """
    import werkzeug.test
    from urllib.parse import urlsplit


    class EnvironBuilder(werkzeug.test.EnvironBuilder):
        def __init__(self, app, path="/", base_url=None, url_scheme=None):
            if base_url is None:
                url = urlsplit(path)
                base_url = f"{url.scheme or url_scheme}://{url.netloc}"
"""

PATCH = Patch(
    id="v2-url-parse",
    title="parse the test client's URLs with urllib.parse.urlsplit (werkzeug.urls.url_parse is gone)",
    target=TESTING,
    requires=FLASK_2_2_UNTIL_FIXED,
    edits=(
        Edit(
            UrlSplitImport,
            when=WERKZEUG_3,
            answers="werkzeug.urls does not define url_parse",
            fact=Fact("lacks", "werkzeug.urls", name="url_parse", distribution="werkzeug"),
        ),
        Edit(
            UrlSplitCall,
            when=WERKZEUG_3,
            answers="werkzeug.urls does not define url_parse",
            fact=Fact("lacks", "werkzeug.urls", name="url_parse", distribution="werkzeug"),
        ),
    ),
    examples=(Example(before=BEFORE, after=AFTER),),
    satisfied=(AFTER,),
    near_misses=(
        # werkzeug's own url_parse on an attribute (another library's), not the import Flask makes
        """
            from werkzeug import urls


            def split(path):
                return urls.url_parse(path)
        """,
    ),
    upstream="Werkzeug 3.0.0 removed werkzeug.urls.url_parse: https://github.com/pallets/werkzeug/issues/2789; "
    "Flask 2.2.4 flask/testing.py calls urllib.parse.urlsplit",
    fixed_in="flask 2.2.4",
    without_it="without it on Werkzeug 3: `ImportError: cannot import name 'url_parse' from 'werkzeug.urls'` at `app.test_client()`",
    on_fixed_in="anchor-missing",
)
