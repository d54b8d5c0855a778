"""The Flask files this set rewrites and the releases it serves."""

from patcher.model import TargetFile

APP = TargetFile("flask", "flask/app.py")
TESTING = TargetFile("flask", "flask/testing.py")

# Flask 2.2.4 stopped importing what Werkzeug 3.0 removed (werkzeug.urls.url_quote, url_parse)
FLASK_2_2_UNTIL_FIXED = {"flask": ">=2.2.0,<2.2.4"}
# Werkzeug 3.0.0 removed werkzeug.urls' quoting and parsing helpers (deprecated in 2.3)
WERKZEUG_3 = {"werkzeug": ">=3.0.0"}
