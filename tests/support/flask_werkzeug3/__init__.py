"""A patch set of one team's own: Flask 2.2.0-2.2.3 on Werkzeug 3 (docs/writing-a-patch-set.md)."""
