"""The decode engine: many (document, question) streams decoded together over paged tiers (see ``engine.py``)."""

from docfuse.runtime.engine.engine import Document, Engine, StreamOutput, engine_unsupported

__all__ = ["Document", "Engine", "StreamOutput", "engine_unsupported"]
