"""attncc's version, in a module of its own so that code below the package's `__init__`
(codegen stamps it into generated sources) can read it without importing the runtime."""

__version__ = "0.1.0"
