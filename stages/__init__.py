"""docfuse's stage library. Importing it registers every built-in stage kind with the engine."""

from docfuse.stages import decode, fuse, pdf, text, vision  # noqa: F401  (registration side effects)
