"""patcher: versioned, verified, reversible patches for a drifting Python ML stack."""

__version__ = "0.1.0"
