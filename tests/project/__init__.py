"""Cross-cutting checks: docs links, packaging, layering, CLI, examples, bench and script tools."""
